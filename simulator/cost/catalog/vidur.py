"""Vidur's published GPU profiles as plain arrays, for fitting a step-cost model.

Vidur (Agrawal et al., MLSys 2024; github.com/microsoft/vidur, MIT) profiled the
operators of a transformer layer with Sarathi-Serve's kernels and CUDA events, and
NCCL collectives between GPUs. Its files keep their layout under a root folder
(``data/vidur`` in this repository holds a subset; a full copy can be passed as
``root``)::

    profiling/compute/<device>/<org>/<model>/mlp.csv      per-layer op times vs tokens, TP
    profiling/network/<node>/{all_reduce,send_recv}.csv   collective time vs message size

What the numbers are:

* Times are **milliseconds**; each row holds min/max/mean/median/std over repeats and
  the reader returns one statistic (``stat``, default the median). A few
  ``(TP, num_tokens)`` points were profiled twice; their statistics are averaged.
* ``mlp.csv`` ops are **per transformer layer** except ``emb``: ``attn_pre_proj`` is
  the QKV GEMM, ``attn_post_proj`` the output projection, ``mlp_up_proj`` the (fused
  gate+up) GEMM, ``mlp_down_proj`` the down GEMM, plus norms, RoPE, activation and the
  residual add. Attention itself, all-reduces and CPU overheads are not in it. Each
  TP row is one GPU's shard of the layer (Vidur profiles the sharded shapes on one GPU).
* ``num_tokens`` counts every token in the batch (prefill and decode alike).
* Collective ``size`` is the message in bytes; ``devices_per_node < num_workers``
  means the workers span nodes.
* Device folders: ``a100`` is an 80 GB A100, ``h100`` an H100 80 GB, ``a40`` an A40
  (not in the GPU catalogue). Network nodes: ``a100_dgx``/``h100_dgx`` are 8-GPU
  NVSwitch nodes; ``*_pairwise_nvlink`` are 4 PCIe GPUs joined in NVLink pairs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from simulator.errors import LatsimError

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_ROOT = REPO_ROOT / "data" / "vidur"

# Vidur device folder <-> GPU catalogue name.
DEVICES: dict[str, str | None] = {"a100": "a100-80gb", "h100": "h100-80gb", "a40": None}
# Catalogue model name -> Vidur's model folder (its Hugging Face id).
MODELS: dict[str, str] = {
    "llama-2-7b": "meta-llama/Llama-2-7b-hf",
    "llama-2-70b": "meta-llama/Llama-2-70b-hf",
    "llama-3-8b": "meta-llama/Meta-Llama-3-8B",
    "llama-3-70b": "meta-llama/Meta-Llama-3-70B",
    "codellama-34b": "codellama/CodeLlama-34b-Instruct-hf",
    "internlm-20b": "internlm/internlm-20b",
    "qwen-72b": "Qwen/Qwen-72B",
    "phi-2": "microsoft/phi-2",
}
MLP_OPS = ("emb", "input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
           "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
LAYER_OPS = MLP_OPS[1:]          # everything but the embedding is per layer
GEMM_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
SHAPE_COLUMNS = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "use_gated_mlp")
STATS = ("min", "max", "mean", "median", "std")


@dataclass(frozen=True)
class OpTimes:
    """Per-operator times (ms) of one model's layer on one GPU at one TP degree."""

    device: str                    # Vidur device folder ('a100', 'h100', 'a40')
    model: str                     # Vidur model folder (HF id)
    tp: int
    stat: str
    tokens: np.ndarray             # ascending num_tokens (int64)
    ops: dict[str, np.ndarray]     # op name -> ms at each token count
    shape: dict = field(default_factory=dict)   # the model shape columns of the file

    def layer_ms(self) -> np.ndarray:
        """One layer's profiled ops summed (no attention, no all-reduce), ms."""
        return np.sum([self.ops[o] for o in LAYER_OPS], axis=0)

    def gemm_ms(self) -> np.ndarray:
        """The four GEMMs of one layer (QKV, O, up/gate, down) summed, ms."""
        return np.sum([self.ops[o] for o in GEMM_OPS], axis=0)


@dataclass(frozen=True)
class CollectiveTimes:
    """One collective's time (ms) against message size for a worker layout."""

    node: str
    collective: str                # 'all_reduce' or 'send_recv'
    num_workers: int
    devices_per_node: int          # < num_workers: the workers span nodes
    stat: str
    size_bytes: np.ndarray         # ascending
    ms: np.ndarray


@dataclass(frozen=True)
class AttentionTimes:
    """Vidur's older attention profile: decode and (chunked) prefill kernel times, ms."""

    shape: dict
    stat: str
    decode_batch: np.ndarray       # decode rows: batch size
    decode_kv: np.ndarray          #   tokens already cached per request
    decode_ms: np.ndarray          #   attention kernel (plus input/output reshape)
    prefill_chunk: np.ndarray      # prefill rows (batch 1): chunk tokens
    prefill_kv: np.ndarray         #   tokens of the prompt already cached
    prefill_ms: np.ndarray


def _root(root: str | Path | None) -> Path:
    return Path(root) if root is not None else DEFAULT_ROOT


def _device(gpu: str) -> str:
    g = gpu.lower()
    if g in DEVICES:
        return g
    for dev, canon in DEVICES.items():
        if canon == g:
            return dev
    raise LatsimError(f"no Vidur profile device for this GPU; known: {', '.join(DEVICES)}",
                      field="gpu", value=gpu, has_value=True)


def _model_dir(model: str) -> str:
    return MODELS.get(model.lower(), model)


def _read(path: Path) -> pd.DataFrame:
    if not path.is_file():
        raise LatsimError("no such Vidur profile file", source=str(path))
    return pd.read_csv(path)


def _stat(stat: str) -> str:
    if stat not in STATS:
        raise LatsimError(f"must be one of {', '.join(STATS)}", field="stat", value=stat,
                          has_value=True)
    return stat


def mlp_path(gpu: str, model: str, root: str | Path | None = None) -> Path:
    """Where the mlp.csv of a (GPU, model) pair lives under ``root``."""
    return _root(root) / "profiling" / "compute" / _device(gpu) / _model_dir(model) / "mlp.csv"


def read_mlp(gpu: str, model: str, root: str | Path | None = None,
             stat: str = "median") -> dict[int, OpTimes]:
    """Vidur's per-layer op times for a model on a GPU, one :class:`OpTimes` per TP degree.

    ``gpu`` is a Vidur device ('a100') or its catalogue name ('a100-80gb'); ``model``
    a catalogue name ('llama-2-70b') or Vidur's folder ('meta-llama/Llama-2-70b-hf').
    """
    stat = _stat(stat)
    dev, mdir = _device(gpu), _model_dir(model)
    path = mlp_path(dev, mdir, root)
    df = _read(path)
    cols = {op: f"time_stats.{op}.{stat}" for op in MLP_OPS}
    missing = [c for c in (*cols.values(), "num_tokens", "num_tensor_parallel_workers")
               if c not in df.columns]
    if missing:
        raise LatsimError("missing columns: " + ", ".join(missing), source=str(path))
    shape = {c: (bool(df[c].iloc[0]) if c == "use_gated_mlp" else int(df[c].iloc[0]))
             for c in SHAPE_COLUMNS if c in df.columns}
    # Repeated (TP, tokens) points are averaged rather than one of them dropped.
    g = (df[["num_tensor_parallel_workers", "num_tokens", *cols.values()]]
         .groupby(["num_tensor_parallel_workers", "num_tokens"], as_index=False).mean()
         .sort_values(["num_tensor_parallel_workers", "num_tokens"]))
    out: dict[int, OpTimes] = {}
    for tp, part in g.groupby("num_tensor_parallel_workers"):
        out[int(tp)] = OpTimes(
            device=dev, model=mdir, tp=int(tp), stat=stat,
            tokens=part["num_tokens"].to_numpy(dtype=np.int64),
            ops={op: part[c].to_numpy(dtype=float) for op, c in cols.items()},
            shape=dict(shape))
    return out


def read_collective(node: str, collective: str = "all_reduce", root: str | Path | None = None,
                    stat: str = "median") -> dict[tuple[int, int], CollectiveTimes]:
    """A node's collective times keyed by ``(num_workers, devices_per_node)``."""
    stat = _stat(stat)
    if collective not in ("all_reduce", "send_recv"):
        raise LatsimError("must be all_reduce or send_recv", field="collective",
                          value=collective, has_value=True)
    path = _root(root) / "profiling" / "network" / node / f"{collective}.csv"
    df = _read(path)
    col = f"time_stats.{collective}.{stat}"
    if col not in df.columns:
        raise LatsimError(f"missing column {col}", source=str(path))
    df = (df.groupby(["num_workers", "devices_per_node", "size"], as_index=False)[col].mean()
          .sort_values(["num_workers", "devices_per_node", "size"]))
    out: dict[tuple[int, int], CollectiveTimes] = {}
    for (nw, dpn), part in df.groupby(["num_workers", "devices_per_node"]):
        out[(int(nw), int(dpn))] = CollectiveTimes(
            node=node, collective=collective, num_workers=int(nw), devices_per_node=int(dpn),
            stat=stat, size_bytes=part["size"].to_numpy(dtype=np.int64),
            ms=part[col].to_numpy(dtype=float))
    return out


def read_attention_legacy(path: str | Path, stat: str = "median") -> AttentionTimes:
    """Vidur's older ``attention.csv`` layout (one model/TP per file) as arrays.

    Reshape ops are added to the kernel time: they run in the same attention call.
    """
    stat = _stat(stat)
    p = Path(path)
    df = _read(p)
    reshape = (df[f"time_stats.attn_input_reshape.{stat}"].fillna(0.0)
               + df[f"time_stats.attn_output_reshape.{stat}"].fillna(0.0))
    dec = ~df["is_prefill"].astype(bool)
    pre = df["is_prefill"].astype(bool)
    shape = {c: df[c].iloc[0] for c in ("n_embd", "n_q_head", "n_kv_head", "block_size",
                                         "num_tensor_parallel_workers", "max_model_len")
             if c in df.columns}
    d_ms = (df[f"time_stats.attn_decode.{stat}"] + reshape)[dec]
    p_ms = (df[f"time_stats.attn_prefill.{stat}"] + reshape)[pre]
    return AttentionTimes(
        shape={k: int(v) for k, v in shape.items()}, stat=stat,
        decode_batch=df["batch_size"][dec].to_numpy(dtype=np.int64),
        decode_kv=df["kv_cache_size"][dec].to_numpy(dtype=np.int64),
        decode_ms=d_ms.to_numpy(dtype=float),
        prefill_chunk=df["prefill_chunk_size"][pre].to_numpy(dtype=np.int64),
        prefill_kv=df["kv_cache_size"][pre].to_numpy(dtype=np.int64),
        prefill_ms=p_ms.to_numpy(dtype=float))


def available(root: str | Path | None = None) -> dict[str, list]:
    """What a Vidur root holds: ``{'mlp': [(device, model)], 'network': [(node, collective)]}``."""
    base = _root(root) / "profiling"
    mlp = sorted((p.relative_to(base / "compute").parts[0],
                  "/".join(p.relative_to(base / "compute").parts[1:-1]))
                 for p in (base / "compute").glob("*/*/*/mlp.csv"))
    net = sorted((p.parent.name, p.stem) for p in (base / "network").glob("*/*.csv"))
    return {"mlp": mlp, "network": net}
