"""The roofline's default efficiencies (fractions of datasheet peaks) and engine overheads.

``DEFAULTS`` holds them, rounded to four significant digits;
``derive.calibrate_defaults()`` recomputes them from the data below and a test checks
that the two agree (``vidur_check`` and ``allreduce_check`` are ``derive``'s,
``published_check`` is ``checks``'). The
all-reduce and flash-attention terms were measured on a few GPU families and stand
for others (``link_terms``, ``flash_efficiency``).

============================  ==========================================================
term                          where it comes from
============================  ==========================================================
``e_gemm``,                   Vidur's per-operator MLP tables (``data/vidur``: the four
``e_weights_hbm2e``,          GEMMs of a layer against batch tokens, TP 1-8): A100
``e_weights_hbm3``,           Llama-2-7B, Llama-2-70B, Llama-3-8B and H100 Llama-2-7B;
``gemm_floor_us``             A100 Llama-3-70B and H100 Llama-2-70B held out
                              (``vidur_check``). The weight reads per memory technology:
                              the A100's HBM2e and the H100's HBM3 stream at different
                              shares of their datasheet rates (one shared value made the
                              fit trade one against the other)
``e_weights_hbm3e``           HBM3e (H200, B200): the reference H200's measured
                              device-to-device copy, 4,282 GB/s (read + write) of the
                              datasheet's 4,800 (``data/h200-refbench/README.md``)
(assumed)                     HBM2 (A100 40GB) and GDDR6 (L4, L40S, A10G) take HBM2e's
                              value, MI300X's HBM3 the H100's (``WEIGHT_READ``): no
                              table or published streaming measurement of theirs here
``gemm_tile_small``,          tile quantisation: a GEMM computes whole output tiles of
``gemm_tile``                 64 rows up to 64 tokens, 128 rows beyond (cuBLAS's skinny
                              tiles), read off the steps in Vidur's tables: A100
                              Llama-2-70B gate-up 605 -> 748 µs between 64 and 80
                              tokens, 720 -> 1,069 µs between 128 and 144; H100 327 ->
                              368 µs between 128 and 144 (``physics.gemm_rows``)
``p_gemm``                    3, fixed, not fitted: a pipelined GEMM (multi-stage
                              cp.async on Ampere, TMA on Hopper) overlaps its weight
                              loads with its MMAs, so near the ridge it costs about the
                              larger of the two; p = 3 leaves 26% (2^(1/3)) at the ridge
                              for the pipeline's fill and drain. Free, the fit drifts to
                              p = 1.3-1.8 (a near-sum) to absorb what is not overlap:
                              tiny GEMMs of 7B at TP 4-8 and an A100-only slowdown at
                              65-128 tokens. Held-out GEMM error at p = 2, 3, 4, 6, 12:
                              4.3, 4.4, 4.7, 4.9, 5.1% mean
``act_*``, ``elem_floor_us``  the same tables' norms, rotary, SiLU-and-mul and residual
                              add (effective passes over HBM at the datasheet rate)
``ar_lat_us_*``, ``e_link_*`` Vidur's NCCL all-reduce tables, per family: the 8-GPU
                              A100 DGX (Ampere, and PCIe-only Ada) and H100 DGX (Hopper,
                              Blackwell, MI300X), 2, 4 and 8 GPUs: ``allreduce_check``
``e_flash`` (Hopper)          the flash-attention efficiency fitted to the H200
                              reference profile (``profiles/h200-llama3-8b-refbench``:
                              torch SDPA's FlashAttention-2 on an H200), as a fraction of
                              the datasheet peak
``e_flash`` (Ampere, Ada)     FlashAttention-2 forward, causal, head_dim 128, 4k tokens on
                              an A100-SXM: 156 TFLOP/s of 312 (published benchmark,
                              liangan1/GPU_travel ``performance/flash-attn/README.md``)
``e_decode``                  the large-batch decode rows of TensorRT-LLM's published
                              throughput tables for Llama-2-7B on A100 and H100
                              (``data/published-step-times.csv``; their KV reads are
                              most of the step): ``published_check``
``ca_lat_us``, ``e_link_ca``  vLLM's custom all-reduce (one-shot / two-shot kernels on
``ca_max_mib``                peer memory, captured in the CUDA graph), which vLLM runs
                              for messages below its ``max_size`` of 8 MiB
                              (``custom_all_reduce.py``) on NVLink-connected GPUs, NCCL
                              above (with torch symmetric memory on, Hopper TP8 caps
                              the custom kernel at 256 KiB and runs symmetric memory's
                              multimem all-reduce up to 64 MiB: priced by the same
                              line, an approximation): a least-squares line through vLLM PR #24111's
                              H100 TP=4 ``ca_1stage`` times (bf16, hidden 8192: 0.5, 1,
                              1.5, 2, 3, 4 MiB in 10, 15, 19, 22, 30, 38 µs) is 6.686
                              µs + 7.82 µs/MiB, i.e. the ring volume ``1.5 x bytes`` at
                              201 GB/s = 0.4468 of NVLink 4's 450 GB/s one way; other
                              NVLink GPUs and TP sizes take the same latency and
                              fraction of their link (an assumption: only TP=4 is
                              published in this form)
``h_*``, ``p_step``           host launch cost per layer of an eager step: the H200
                              reference engine's fit (an eager PyTorch engine, an upper
                              estimate for vLLM's fused kernels); a CUDA-graph replay:
                              ``real_engine``'s fit (``profiles/h200-llama3-8b.json``)
``h_piece_us``                vLLM v1's piecewise CUDA graphs (``cudagraph_mode``
                              ``FULL_AND_PIECEWISE``, its default: a step that is not a
                              uniform decode batch replays the layers' graphs split at
                              attention, which runs eagerly between the pieces): what
                              one more piece costs, from vLLM PR #51167's H200 table
                              (batch 1, 209 output tokens): piecewise 1.150 s with
                              12,272 ``cudaGraphLaunch`` against full graphs 1.093 s with
                              208, i.e. 57 ms / 12,064 launches = 4.725 µs per piece
                              (``derive.piecewise_piece_us``)
============================  ==========================================================
"""
from __future__ import annotations

from simulator.cost.catalog import GpuSpec

DEFAULTS: dict = {
    "e_gemm": 0.7389, "e_weights_hbm2e": 0.8318, "e_weights_hbm3": 0.9701, "p_gemm": 3.0,
    "gemm_floor_us": 33.45,
    # GEMM output tiles (rows): cuBLAS's for skinny GEMMs, as Vidur's tables step.
    "gemm_tile_small": 64.0, "gemm_tile": 128.0,
    # HBM3e: the reference H200's measured device-to-device copy over its datasheet rate.
    "e_weights_hbm3e": 0.8921,
    "act_passes_repl": 11.89, "act_passes_rope": 0.9385, "act_passes_ffn": 8.124,
    "elem_floor_us": 10.6,
    "ar_lat_us_ampere": 33.59, "e_link_ampere": 0.5129,
    "ar_lat_us_hopper": 22.59, "e_link_hopper": 0.7196,
    "e_flash_hopper": 0.3054, "e_flash_ampere": 0.5009,
    "e_decode": 0.8268,
    "h_layer_ms": 0.2582, "h_decode_layer_ms": 0.153, "h_graph_ms": 2.759, "p_step": 4.517,
    "p_attn": 2.345,
    # vLLM's custom all-reduce: a line through a published benchmark, and vLLM's size limit.
    "ca_lat_us": 6.686, "e_link_ca": 0.4468, "ca_max_mib": 8.0,
    # vLLM's piecewise CUDA graphs: one more graph piece (an attention break) per layer.
    "h_piece_us": 4.725,
}
# The all-reduce terms measured on an A100 and an H100 node stand for their families;
# PCIe-only Ada parts take Ampere's (the lower efficiency), Blackwell and MI300X Hopper's.
LINK_ARCH = {"hopper": "hopper", "blackwell": "hopper", "cdna3": "hopper", "ampere": "ampere",
             "ada": "ampere"}
# The weight-read efficiency each memory technology takes (module doc): HBM2e and HBM3
# fitted (A100, H100), HBM3e measured (H200); the rest take the nearest one's.
WEIGHT_READ = {"hbm2e": "e_weights_hbm2e", "hbm2": "e_weights_hbm2e", "gddr6": "e_weights_hbm2e",
               "hbm3": "e_weights_hbm3", "hbm3e": "e_weights_hbm3e"}
FLASH_ARCH = {"hopper": "e_flash_hopper", "blackwell": "e_flash_hopper", "cdna3": "e_flash_hopper",
              "ampere": "e_flash_ampere", "ada": "e_flash_ampere"}
# How the roofline's fits (``derive``: these defaults; ``transfer``: a calibration's
# scales) run ``simulator.cost.solve``: a finite-difference step relative to the
# coefficient, lighter damping and a tighter stop than the profile fit's. Kept as they
# were tuned, so that the defaults and calibrations reproduce.
SOLVE = dict(ridge=1e-12, tol=1e-12, lam_min=1e-12, relative_step=True)


def weight_read_efficiency(spec: GpuSpec, eff: dict) -> float:
    """The share of the datasheet memory bandwidth the linear layers' weights stream at
    on the GPU's memory technology (module doc); an ``e_weights`` in ``eff`` stands for
    every technology (a fit of one GPU's rows carried to others: ``checks``)."""
    if "e_weights" in eff:
        return eff["e_weights"]
    return eff[WEIGHT_READ.get(spec.memory_type, "e_weights_hbm3")]


def flash_efficiency(spec: GpuSpec, eff: dict) -> float:
    """The flash-attention efficiency of the GPU's architecture family (module doc)."""
    return eff[FLASH_ARCH.get(spec.arch, "e_flash_hopper")]


def custom_allreduce_terms(spec: GpuSpec, eff: dict) -> tuple[float, float, float]:
    """``(latency µs, GB/s, largest message bytes)`` of vLLM's custom all-reduce on the
    GPU's own links (module doc), or zeros where vLLM does not run it: GPUs without
    NVLink (PCIe-only parts; vLLM disables it past two GPUs that are not fully connected)."""
    if not spec.link.startswith("nvlink"):
        return 0.0, 0.0, 0.0
    return (eff["ca_lat_us"], spec.link_gbs_unidir * eff["e_link_ca"],
            eff["ca_max_mib"] * 2**20)


def link_terms(spec: GpuSpec, eff: dict) -> tuple[float, float]:
    """``(all-reduce latency µs, link efficiency)`` of the GPU's family (module doc)."""
    fam = LINK_ARCH.get(spec.arch, "hopper")
    return eff[f"ar_lat_us_{fam}"], eff[f"e_link_{fam}"]
