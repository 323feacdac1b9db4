"""GPU datasheet numbers: the rates a physics step-cost model divides work by.

Every entry is a peak from the vendor's datasheet (or the named source), not an
achieved rate: a cost model multiplies these by its own efficiency factors.

Conventions used by every entry:

* Compute is **dense** (no 2:4 structured sparsity). NVIDIA datasheets print the
  sparse figure with an asterisk; the dense one is half of it.
* ``memory_gb`` is the datasheet capacity; ``reported_mib`` is the total the driver
  reports (``nvidia-smi``), which is what an engine can actually allocate from.
  Where it is unknown, :attr:`GpuSpec.memory_bytes` reads the datasheet GB as GiB,
  which is within 1% of the reported total on the HBM parts listed here.
* Bandwidths are in GB/s (10^9 bytes per second).
* Intra-node interconnect bandwidth is **per GPU, per direction** (unidirectional).
  Datasheets quote NVLink, Infinity Fabric and PCIe as bidirectional totals
  ("NVLink 900 GB/s", "PCIe Gen4 64 GB/s"); those are halved here, because a ring
  all-reduce or a pipeline send is limited by what one GPU can push one way.
* Price per GPU-hour is left ``None``: public on-demand prices change too often
  (and differ by region and commitment) to be catalogue data.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator's peak rates and capacities (units in the field names)."""

    name: str                      # canonical lower-case name
    aliases: tuple[str, ...]       # other accepted names
    vendor: str
    bf16_tflops: float             # dense BF16 tensor-core peak, TFLOP/s
    fp8_tflops: float | None       # dense FP8 peak, TFLOP/s; None where unsupported
    int8_tops: float | None        # dense INT8 peak, TOP/s
    memory_gb: float               # datasheet capacity, GB
    reported_mib: int | None       # total the driver reports, MiB (None: unknown)
    memory_bw_gbs: float           # HBM/GDDR bandwidth, GB/s
    sm_count: int                  # streaming multiprocessors (NVIDIA) or compute units (AMD)
    link: str                      # intra-node GPU-to-GPU path
    link_gbs_unidir: float         # that path's bandwidth per GPU, one direction, GB/s
    pcie_gen: int
    pcie_gbs_unidir: float         # host link (x16), one direction, GB/s
    tdp_w: int                     # board power, W
    price_per_gpu_hour: float | None
    source: str                    # datasheet title / URL the numbers come from
    notes: str = ""
    arch: str = ""                 # architecture family: ampere, ada, hopper, blackwell, cdna3
    # the memory technology: gddr6, hbm2, hbm2e, hbm3, hbm3e (what the roofline's
    # weight-read efficiency depends on: ``roofline.defaults.weight_read_efficiency``)
    memory_type: str = ""

    @property
    def memory_bytes(self) -> int:
        """Device memory an engine can allocate from, in bytes."""
        if self.reported_mib is not None:
            return self.reported_mib * 2**20
        return int(self.memory_gb * 2**30)

    @property
    def link_gbs_bidir(self) -> float:
        """The interconnect figure as datasheets print it (both directions summed)."""
        return 2.0 * self.link_gbs_unidir

    def peak_tflops(self, dtype: str) -> float | None:
        """Dense peak for a compute dtype ('bf16', 'fp16', 'fp8', 'int8')."""
        d = dtype.lower()
        if d in ("bf16", "fp16"):
            return self.bf16_tflops
        if d == "fp8":
            return self.fp8_tflops
        if d == "int8":
            return self.int8_tops
        raise ValueError(f"no peak rate for dtype {dtype!r}")


_NV_A100 = ("NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4); "
            "SM count from the NVIDIA A100 Tensor Core GPU Architecture whitepaper")
_NV_H100 = ("NVIDIA H100 Tensor Core GPU datasheet "
            "(resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet); "
            "SM counts from the NVIDIA H100 Tensor Core GPU Architecture whitepaper")

# Each row: the numbers and where they come from. data/catalog-sources.md lists the same.
GPUS: dict[str, GpuSpec] = {g.name: g for g in (
    GpuSpec(
        name="a10g", arch="ampere", memory_type="gddr6", aliases=("nvidia-a10g", "aws-a10g"), vendor="nvidia",
        bf16_tflops=70.0, fp8_tflops=None, int8_tops=140.0,
        memory_gb=24, reported_mib=23028, memory_bw_gbs=600, sm_count=80,
        link="pcie4", link_gbs_unidir=32, pcie_gen=4, pcie_gbs_unidir=32, tdp_w=300,
        price_per_gpu_hour=None,
        source=("AWS EC2 G5 instance page (A10G: 24 GB, 80 RT cores); tensor rates from "
                "Baseten, 'NVIDIA A10 vs A10G for ML model inference' (A10G 70 TFLOPS BF16); "
                "23028 MiB and 300 W as nvidia-smi reports on g5 instances"),
        notes=("NVIDIA publishes no A10G datasheet; the A10 (72 SMs, 150 W) is a different card "
               "with 125 TFLOPS BF16. No NVLink on G5: GPUs talk over PCIe."),
    ),
    GpuSpec(
        name="l4", arch="ada", memory_type="gddr6", aliases=("nvidia-l4",), vendor="nvidia",
        bf16_tflops=121.0, fp8_tflops=242.5, int8_tops=242.5,
        memory_gb=24, reported_mib=23034, memory_bw_gbs=300, sm_count=58,
        link="pcie4", link_gbs_unidir=32, pcie_gen=4, pcie_gbs_unidir=32, tdp_w=72,
        price_per_gpu_hour=None,
        source=("NVIDIA L4 Tensor Core GPU datasheet (BF16 242*, FP8 485*, INT8 485* with "
                "sparsity; 24 GB GDDR6, 300 GB/s, 72 W, PCIe Gen4 x16 64 GB/s)"),
        notes="58 SMs = 232 fourth-generation tensor cores / 4. No NVLink.",
    ),
    GpuSpec(
        name="l40s", arch="ada", memory_type="gddr6", aliases=("nvidia-l40s",), vendor="nvidia",
        bf16_tflops=362.05, fp8_tflops=733.0, int8_tops=733.0,
        memory_gb=48, reported_mib=46068, memory_bw_gbs=864, sm_count=142,
        link="pcie4", link_gbs_unidir=32, pcie_gen=4, pcie_gbs_unidir=32, tdp_w=350,
        price_per_gpu_hour=None,
        source=("NVIDIA L40S datasheet (BF16 362.05 | 733*, FP8 733 | 1,466*, INT8 733 | 1,466*; "
                "48 GB GDDR6 864 GB/s; PCIe Gen4 x16 64 GB/s bidirectional; 350 W)"),
        notes="142 SMs = 568 tensor cores / 4. No NVLink.",
    ),
    GpuSpec(
        name="a100-40gb", arch="ampere", memory_type="hbm2", aliases=("a100-sxm4-40gb", "a100-40g", "a100-sxm-40gb"), vendor="nvidia",
        bf16_tflops=312.0, fp8_tflops=None, int8_tops=624.0,
        memory_gb=40, reported_mib=40960, memory_bw_gbs=1555, sm_count=108,
        link="nvlink3", link_gbs_unidir=300, pcie_gen=4, pcie_gbs_unidir=32, tdp_w=400,
        price_per_gpu_hour=None,
        source=_NV_A100 + " (SXM4 40GB: HBM2 1,555 GB/s, NVLink 600 GB/s, 400 W)",
    ),
    GpuSpec(
        name="a100-80gb", arch="ampere", memory_type="hbm2e", aliases=("a100", "a100-sxm4-80gb", "a100-80g", "a100-sxm"), vendor="nvidia",
        bf16_tflops=312.0, fp8_tflops=None, int8_tops=624.0,
        memory_gb=80, reported_mib=81920, memory_bw_gbs=2039, sm_count=108,
        link="nvlink3", link_gbs_unidir=300, pcie_gen=4, pcie_gbs_unidir=32, tdp_w=400,
        price_per_gpu_hour=None,
        source=_NV_A100 + " (SXM4 80GB: HBM2e 2,039 GB/s, NVLink 600 GB/s, 400 W)",
        notes="Vidur's 'a100' compute profiles were taken on 80 GB A100s.",
    ),
    GpuSpec(
        name="h100-80gb", arch="hopper", memory_type="hbm3", aliases=("h100-sxm", "h100", "h100-sxm5", "h100-80gb-hbm3"), vendor="nvidia",
        bf16_tflops=989.4, fp8_tflops=1978.9, int8_tops=1978.9,
        memory_gb=80, reported_mib=81559, memory_bw_gbs=3350, sm_count=132,
        link="nvlink4", link_gbs_unidir=450, pcie_gen=5, pcie_gbs_unidir=64, tdp_w=700,
        price_per_gpu_hour=None,
        source=_NV_H100 + " (H100 SXM: BF16 1,979*, FP8 3,958*, 3.35 TB/s, NVLink 900 GB/s, 700 W)",
    ),
    GpuSpec(
        name="h100-pcie", arch="hopper", memory_type="hbm2e", aliases=("h100-pcie-80gb",), vendor="nvidia",
        bf16_tflops=756.5, fp8_tflops=1513.0, int8_tops=1513.0,
        memory_gb=80, reported_mib=None, memory_bw_gbs=2000, sm_count=114,
        link="pcie5", link_gbs_unidir=64, pcie_gen=5, pcie_gbs_unidir=64, tdp_w=350,
        price_per_gpu_hour=None,
        source=_NV_H100 + " (H100 PCIe: BF16 1,513*, FP8 3,026*, HBM2e 2 TB/s, 300-350 W)",
        notes=("GPUs reach each other over PCIe Gen5; an optional NVLink bridge joins pairs at "
               "600 GB/s bidirectional (300 GB/s one way), only within a pair."),
    ),
    GpuSpec(
        name="h200", arch="hopper", memory_type="hbm3e", aliases=("h200-sxm", "h200-141gb", "h200-sxm5"), vendor="nvidia",
        bf16_tflops=989.4, fp8_tflops=1978.9, int8_tops=1978.9,
        memory_gb=141, reported_mib=143771, memory_bw_gbs=4800, sm_count=132,
        link="nvlink4", link_gbs_unidir=450, pcie_gen=5, pcie_gbs_unidir=64, tdp_w=700,
        price_per_gpu_hour=None,
        source=("NVIDIA H200 Tensor Core GPU datasheet / product page (H200 SXM: 141 GB HBM3e, "
                "4.8 TB/s, FP8 3,958*, BF16 1,979*, NVLink 900 GB/s, up to 700 W)"),
        notes="Same GH100 compute as the H100 SXM; only the memory differs.",
    ),
    GpuSpec(
        name="b200", arch="blackwell", memory_type="hbm3e", aliases=("b200-sxm", "hgx-b200", "b200-180gb"), vendor="nvidia",
        bf16_tflops=2250.0, fp8_tflops=4500.0, int8_tops=4500.0,
        memory_gb=180, reported_mib=183359, memory_bw_gbs=8000, sm_count=148,
        link="nvlink5", link_gbs_unidir=900, pcie_gen=5, pcie_gbs_unidir=64, tdp_w=1000,
        price_per_gpu_hour=None,
        source=("NVIDIA HGX B200 / DGX B200 datasheets (per GPU: 180 GB HBM3e, 8 TB/s, "
                "NVLink 5 1.8 TB/s, 1,000 W; FP8 9 PFLOPS and BF16 4.5 PFLOPS with sparsity); "
                "dense per-GPU table in G. Lockwood, 'B200' (glennklockwood.com)"),
        notes=("HGX (1,000 W) rates; the GB200 part runs faster at 1,200 W. FP4 9 PFLOPS dense "
               "is not catalogued. SM count 148 as the CUDA device query reports."),
    ),
    GpuSpec(
        name="mi300x", arch="cdna3", memory_type="hbm3", aliases=("amd-mi300x", "instinct-mi300x"), vendor="amd",
        bf16_tflops=1307.4, fp8_tflops=2614.9, int8_tops=2614.9,
        memory_gb=192, reported_mib=None, memory_bw_gbs=5300, sm_count=304,
        link="infinity-fabric", link_gbs_unidir=448, pcie_gen=5, pcie_gbs_unidir=64, tdp_w=750,
        price_per_gpu_hour=None,
        source=("AMD Instinct MI300X data sheet / amd.com product page (BF16 1,307.4 TFLOPS dense, "
                "FP8 2,614.9; 192 GB HBM3 5.3 TB/s; 304 CUs; 750 W; 7 Infinity Fabric links to "
                "peers at 128 GB/s bidirectional each = 896 GB/s)"),
        notes=("Infinity Fabric is point-to-point: 64 GB/s one way to each of the 7 peers, "
               "448 GB/s one way in total; a 2-GPU group only gets one link."),
    ),
)}
