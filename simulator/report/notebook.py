"""Small helpers the notebooks share: where the checkout is, where to write, and
showing a PNG inline when running under Jupyter."""
from __future__ import annotations

import os
from pathlib import Path


def repo_root() -> Path:
    """The latsim checkout: walk up from the working directory, else the package's."""
    for d in (Path.cwd().resolve(), *Path.cwd().resolve().parents):
        if (d / "pyproject.toml").exists() and (d / "simulator").is_dir():
            return d
    return Path(__file__).resolve().parents[2]


def out_dir(name: str) -> Path:
    """Where notebook ``name`` writes: ``$LATSIM_NB_OUT/name`` or results/notebooks/name."""
    base = os.environ.get("LATSIM_NB_OUT")
    return Path(base) / name if base else repo_root() / "results" / "notebooks" / name


def show(png: Path) -> None:
    """Print the PNG's path; display it inline when running under IPython."""
    print(f"wrote {png}")
    try:
        from IPython import get_ipython
        from IPython.display import Image, display
    except ImportError:
        return
    if get_ipython() is not None:
        display(Image(filename=str(png)))
