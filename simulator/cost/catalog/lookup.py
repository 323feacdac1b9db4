"""Lookups in the catalogues: a GPU or a model by name, alias, Hugging Face id or
config.json path (the package's ``gpu``, ``gpu_in_text``, ``model`` and their names).
Names are case-insensitive; ``_`` and spaces count as ``-``; an unknown name is a
one-line error naming the closest known ones."""
from __future__ import annotations

import difflib
from pathlib import Path

from simulator.errors import LatsimError
from simulator.cost.catalog.gpus import GPUS, GpuSpec
from simulator.cost.catalog.hf import load_config
from simulator.cost.catalog.models import ModelArch
from simulator.cost.catalog.modeltable import MODELS


def _key(name: str) -> str:
    return "-".join(str(name).strip().lower().replace("_", "-").split())


def _index(table: dict, extra) -> dict[str, str]:
    idx: dict[str, str] = {}
    for canon, item in table.items():
        idx[_key(canon)] = canon
        for alias in extra(item):
            idx.setdefault(_key(alias), canon)
    return idx


_GPU_INDEX = _index(GPUS, lambda g: g.aliases)
# Models answer to their catalogue name, their HF id and the HF id's last part, and
# to the names real_engine's presets and profiles use.
_MODEL_ALIASES = {"llama3-8b": "llama-3-8b", "llama3-70b": "llama-3-70b"}


def _post_trained(hf_id: str) -> tuple[str, ...]:
    """The ids of a base model's instruction-tuned sibling of the same shape, as the
    Hugging Face Hub spells them (``codellama/CodeLlama-34b-Instruct-hf``,
    ``meta-llama/Llama-2-7b-chat-hf``, ``meta-llama/Llama-3.1-8B-Instruct``): fine-tuning
    changes no shape number, so they price the same."""
    if hf_id.endswith("-hf"):
        base = hf_id[:-3]
        return (f"{base}-Instruct-hf", f"{base}-chat-hf")
    if hf_id.startswith("meta-llama/") and not hf_id.endswith("-Instruct"):
        return (f"{hf_id}-Instruct",)
    return ()


_MODEL_INDEX = _index(MODELS, lambda m: (
    m.hf_id, m.hf_id.split("/")[-1],
    *[i for p in _post_trained(m.hf_id) for i in (p, p.split("/")[-1])],
    *[a for a, c in _MODEL_ALIASES.items() if c == m.name]))


def _unknown(kind: str, name: str, index: dict[str, str], canon: list[str]) -> LatsimError:
    near = difflib.get_close_matches(_key(name), list(index), n=3, cutoff=0.6)
    names = list(dict.fromkeys(index[n] for n in near)) or canon
    return LatsimError(f"unknown {kind}; nearest known: {', '.join(names)}",
                       field=kind, value=name, has_value=True)


def gpu_names() -> list[str]:
    """Canonical names of the catalogued GPUs."""
    return sorted(GPUS)


def model_names() -> list[str]:
    """Canonical names of the catalogued models."""
    return sorted(MODELS)


def gpu(name: str) -> GpuSpec:
    """The :class:`GpuSpec` of a GPU name or alias ('h100-sxm', 'A100_80GB', ...)."""
    canon = _GPU_INDEX.get(_key(name))
    if canon is None:
        raise _unknown("gpu", name, _GPU_INDEX, gpu_names())
    return GPUS[canon]


def gpu_in_text(text: str) -> GpuSpec | None:
    """The catalogued GPU a hardware description names ('NVIDIA H200 141GB (132 SMs)'
    -> h200), or None. Names and aliases are tried longest first, each only where it
    stands as a whole word (so 'l4' is not found inside 'l40s')."""
    import re
    t = _key(text)
    for alias in sorted(_GPU_INDEX, key=len, reverse=True):
        if re.search(rf"(?<![a-z0-9]){re.escape(alias)}(?![a-z0-9])", t):
            return GPUS[_GPU_INDEX[alias]]
    return None


def model(name_or_path: str | Path) -> ModelArch:
    """A :class:`ModelArch` by catalogue name, HF id, or config.json path.

    An existing file or folder is read as a Hugging Face config; a string that names
    a catalogued model (or its HF id) is looked up; anything ending in ``.json`` or
    written as a relative/absolute path must exist.
    """
    p = Path(name_or_path)
    if p.exists():
        return load_config(p)
    canon = _MODEL_INDEX.get(_key(str(name_or_path)))
    if canon is not None:
        return MODELS[canon]
    s = str(name_or_path)
    if s.endswith(".json") or s.startswith(("./", "../", "/", "~")):
        return load_config(p.expanduser())
    raise _unknown("model", s, _MODEL_INDEX, model_names())
