"""``latsim data``: list the public datasets shipped in the repository's ``data/`` folder.

One entry per dataset of ``simulator.datasets.DATASETS``: its name, path under
``data/``, size on disk, licence and whether the copy is whole or a slice (which
slice), then what it is, its source and the citation its authors ask for.
``--markdown`` prints the same list as ``data/README.md``'s index table. A dataset
whose files are missing is shown as ``MISSING`` and makes the command exit 2.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from simulator.errors import LatsimError


def data(
    data_dir: Optional[Path] = typer.Option(None, "--dir", help="data folder (default: the "
                                            "repository's data/)"),
    markdown: bool = typer.Option(False, "--markdown", help="print data/README.md's index table"),
) -> None:
    """List the shipped public datasets with their size, licence and source."""
    from simulator.datasets import DATA_DIR, DATASETS, fmt_size, markdown_table

    root = data_dir or DATA_DIR
    if not root.is_dir():
        raise LatsimError("data folder not found", source=str(root))
    if markdown:
        typer.echo(markdown_table(root))
        return
    missing, total = [], 0
    for d in DATASETS:
        ok = d.exists(root)
        n = d.size_bytes(root)
        total += n
        if not ok:
            missing.append(d.name)
        typer.echo(f"{d.name}  data/{d.path}  {fmt_size(n) if ok else 'MISSING'}  {d.licence}  "
                   f"{'whole' if d.extent == 'whole' else 'slice'}")
        typer.echo(f"    {d.what}")
        if d.extent != "whole":
            typer.echo(f"    {d.extent}")
        typer.echo(f"    source: {d.source}")
        if d.cite:
            typer.echo(f"    cite: {d.cite}")
    typer.echo(f"{len(DATASETS)} datasets, {fmt_size(total)} in {root}; provenance and "
               "licences: data/README.md and each dataset's README")
    if missing:
        raise LatsimError(f"missing: {', '.join(missing)}", source=str(root))
