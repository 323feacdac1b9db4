"""The public data shipped in the repository's ``data/`` folder: one registry.

Every dataset the scenarios, notebooks, README examples and tests read is listed
here once, with where it came from, its licence and whether the copy is whole or
a slice. ``latsim data`` prints this list; ``data/README.md``'s index table is
``markdown_table()`` verbatim (``tests/test_datasets.py`` checks that they agree,
that every listed path exists and that nothing unlisted is shipped). Sizes are
read from the files on disk, not stored here.

To add a dataset: copy it under ``data/`` with a README giving its provenance,
add a ``Dataset`` below, and paste ``latsim data --markdown`` into ``data/README.md``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

#: The repository's data folder (beside ``simulator/`` in a checkout).
DATA_DIR = Path(__file__).resolve().parents[1] / "data"

#: Files under ``data/`` that belong to no dataset: the index and the licence texts.
NOT_DATA = ("README.md", "LICENSES")


@dataclass(frozen=True)
class Dataset:
    """One shipped dataset: a file or a folder under ``data/``."""

    name: str  # short id, as ``latsim data`` prints it
    path: str  # under data/; a folder ends with "/"
    what: str  # one line: what it is
    source: str  # upstream URL (repository and path)
    licence: str  # SPDX id
    cite: str = ""  # attribution the licence or the authors ask for
    extent: str = "whole"  # "whole", or "slice: <which slice>"
    readme: str = ""  # the README (under data/) with the full provenance

    def files(self, data_dir: Path = DATA_DIR) -> list[Path]:
        """The files of this dataset that exist under ``data_dir``."""
        p = data_dir / self.path
        if p.is_file():
            return [p]
        return sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else []

    def size_bytes(self, data_dir: Path = DATA_DIR) -> int:
        return sum(f.stat().st_size for f in self.files(data_dir))

    def exists(self, data_dir: Path = DATA_DIR) -> bool:
        p = data_dir / self.path
        return p.is_dir() if self.path.endswith("/") else p.is_file()


_AZURE = ("https://github.com/Azure/AzurePublicDataset/blob/b469a113cedca53ddc3bdea71a143dc4b7d8700c/"
          "data/")
_AZURE_CITE = ("Patel et al., \"Splitwise: Efficient generative LLM inference using phase "
               "splitting\", ISCA 2024")
_MOONCAKE = ("https://github.com/kvcache-ai/Mooncake/blob/3b5a594133958449a1feaf1c9e0fc1b553e34a28/"
             "FAST25-release/traces/")
_MOONCAKE_CITE = "Qin et al., \"Mooncake\", FAST 2025"
_SERVEGEN = "https://github.com/alibaba/ServeGen/tree/f891d1189eb32b3868dfc443800c4150548c282a/data/"
_SERVEGEN_CITE = "Xiang et al., \"ServeGen\", arXiv:2505.09999"

DATASETS: tuple[Dataset, ...] = (
    Dataset("azure-code", "azure_llm_2023/AzureLLMInferenceTrace_code.csv",
            "Azure LLM inference trace 2023, code service: 8,819 requests in one hour "
            "(timestamp, prompt and output tokens)",
            _AZURE + "AzureLLMInferenceTrace_code.csv", "CC-BY-4.0", _AZURE_CITE,
            readme="azure_llm_2023/README.md"),
    Dataset("azure-conv", "azure_llm_2023/AzureLLMInferenceTrace_conv.csv",
            "Azure LLM inference trace 2023, conversation service: 19,366 requests in one hour",
            _AZURE + "AzureLLMInferenceTrace_conv.csv", "CC-BY-4.0", _AZURE_CITE,
            readme="azure_llm_2023/README.md"),
    Dataset("mooncake-conversation", "mooncake/conversation_trace.jsonl",
            "Mooncake (Kimi) conversation trace: 12,031 requests in one hour, with prefix "
            "hash ids (512 tokens a block)",
            _MOONCAKE + "conversation_trace.jsonl", "Apache-2.0", _MOONCAKE_CITE,
            readme="mooncake/README.md"),
    Dataset("mooncake-synthetic", "mooncake/synthetic_trace.jsonl",
            "Mooncake synthetic trace: 3,993 Poisson arrivals over 1,022 s, with prefix hash ids",
            _MOONCAKE + "synthetic_trace.jsonl", "Apache-2.0", _MOONCAKE_CITE,
            readme="mooncake/README.md"),
    Dataset("sharegpt-8k-lengths",
            "sarathi_serve/processed_traces/sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
            "ShareGPT prompt/output token counts (Llama-2 tokenizer, <= 8k tokens): 30,731 "
            "rows, no timestamps",
            "https://github.com/microsoft/sarathi-serve/blob/72339db5b120614033b317880ad3a05a5e4c9415/"
            "data/processed_traces/sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
            "Apache-2.0", "Agrawal et al., \"Taming throughput-latency tradeoff in LLM inference "
            "with Sarathi-Serve\", OSDI 2024", readme="sarathi_serve/README.md"),
    Dataset("servegen-deepseek-r1", "servegen/reason/deepseek-r1/",
            "ServeGen (Alibaba Bailian) per-client arrival fits and token pmfs, DeepSeek-R1, one day",
            _SERVEGEN + "reason/deepseek-r1", "Apache-2.0", _SERVEGEN_CITE,
            "slice: all 73 client trace CSVs whole (144 windows of 600 s); dataset JSONs (token "
            "pmfs) of only the 3 largest clients, 35, 48 and 3, whole",
            readme="servegen/README.md"),
    Dataset("servegen-m-large", "servegen/language/m-large/",
            "ServeGen (Alibaba Bailian) per-client arrival fits and token pmfs, language model "
            "M-large, first day of 14",
            _SERVEGEN + "language/m-large", "Apache-2.0", _SERVEGEN_CITE,
            "slice: day 1 (0-86,400 s) of 14: all 162 client trace CSVs cut to their first 144 "
            "rows; dataset JSONs of clients 61, 143, 104 and 34 only, cut to their first 4 "
            "six-hour periods",
            readme="servegen/README.md"),
    Dataset("h200-refbench", "h200-refbench/",
            "Step costs of a Llama-3-8B-shaped reference engine measured on one NVIDIA H200, and "
            "two recorded serving runs of it",
            "this project (measured 2026-11-30)", "Apache-2.0", "",
            readme="h200-refbench/README.md"),
    Dataset("vidur", "vidur/",
            "Vidur's GPU operator profiles (mlp.csv, per-layer op times against batch tokens and "
            "TP) and NCCL all-reduce timings",
            "https://github.com/microsoft/vidur/tree/7d47513363ec447a741ac5e47241580b47724fbf/"
            "data/profiling", "MIT",
            "Agrawal et al., \"Vidur: A large-scale simulation framework for LLM inference\", "
            "MLSys 2024",
            "slice: 8 of Vidur's profile files, each whole: mlp.csv of Llama-2-7B and -70B (A100, "
            "H100) and Llama-3-8B and -70B (A100); all_reduce.csv of a100_dgx and h100_dgx",
            readme="vidur/README.md"),
    Dataset("published-step-times", "published-step-times.csv",
            "Step times (ms) published by engine vendors and projects, one measurement a row "
            "with its source: TensorRT-LLM docs, gpt-fast READMEs (Llama-2, Mixtral), NVIDIA NIM "
            "docs, vLLM's nightly benchmark, lmdeploy's A100 benchmark",
            "compiled by this project from the public pages cited in each row", "Apache-2.0", "",
            readme="catalog-sources.md"),
    Dataset("vllm-h100-runs", "vllm-h100-runs/",
            "16 recorded runs of a real vLLM v0.15 server on H100-SXM (Llama-2-7B TP1, "
            "Llama-2-70B TP4, Mixtral-8x7B TP2, CodeLlama-34B TP2; four workloads) driven by "
            "inference-perf: launch arguments, workload config, per-stage and summary "
            "latency aggregates",
            "https://github.com/inference-sim/training/tree/ed5c1d26900e6909758d5e1641a18edaf56a1caf/"
            "default_args", "no licence stated (measurements used as facts, with attribution)",
            "inference-sim/training, the measurements behind the BLIS simulator's trained "
            "coefficients",
            "slice: the 16 runs' exp-config.yaml, profile.yaml and results/ (config, per-stage "
            "and summary lifecycle metrics), server addresses and storage paths replaced",
            readme="vllm-h100-runs/README.md"),
)


def get(name: str) -> Optional[Dataset]:
    return next((d for d in DATASETS if d.name == name), None)


def fmt_size(n: int) -> str:
    """Bytes as decimal megabytes, two decimals (the README's size column)."""
    return f"{n / 1e6:.2f} MB"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table(data_dir: Path = DATA_DIR) -> str:
    """``data/README.md``'s index: one row per dataset, sizes read from ``data_dir``, then
    the total."""
    rows = ["| path | what | source | licence | size | whole / slice |",
            "|---|---|---|---|---:|---|"]
    for d in DATASETS:
        source = f"<{d.source}>" if d.source.startswith("http") else d.source
        if d.cite:
            source += f"; {d.cite}"
        if d.readme:
            source += f" (provenance: [`{d.readme}`]({d.readme}))"
        rows.append("| " + " | ".join(_cell(c) for c in (
            f"`{d.path}`", d.what, source, d.licence, fmt_size(d.size_bytes(data_dir)),
            d.extent)) + " |")
    total = sum(d.size_bytes(data_dir) for d in DATASETS)
    rows += ["", f"{len(DATASETS)} datasets, {fmt_size(total)} in all (sizes in MB of "
             "10^6 bytes; a folder's size includes its README)."]
    return "\n".join(rows)
