"""NVIDIA data-centre GPUs, from NVIDIA's datasheets.

Every figure is dense (no 2:4 sparsity). The H100/H200 datasheets print tensor-core
rates *with* sparsity and say in a footnote that dense rates are one half of
them; the values below are those printed figures halved. NVIDIA's Hopper
architecture whitepaper lists the same dense rates to one more digit (494.7
TF32, 989.4 FP16/BF16, 1978.9 FP8/INT8 TFLOPS), within 0.1% of these.

'float32' is the non-tensor-core (CUDA core) FP32 rate: PyTorch runs float32
matmuls in full FP32 unless TF32 is allowed; 'tf32' is the tensor-core rate used
when it is. 'float64' is the FP64 tensor-core rate. GB and TB/s are decimal, as
in the datasheets.
"""

from __future__ import annotations

from opswap.targets.base import Target

_T = 1e12

_HOPPER_SXM_PEAKS = {
    "float64": 67 * _T,  # FP64 Tensor Core 67 TFLOPS (dense as printed)
    "float32": 67 * _T,  # FP32 67 TFLOPS
    "tf32": 989 * _T / 2,  # TF32 Tensor Core 989 TFLOPS with sparsity
    "bfloat16": 1979 * _T / 2,  # BF16 Tensor Core 1,979 TFLOPS with sparsity
    "float16": 1979 * _T / 2,  # FP16 Tensor Core 1,979 TFLOPS with sparsity
    "float8": 3958 * _T / 2,  # FP8 Tensor Core 3,958 TFLOPS with sparsity
    "int8": 3958 * _T / 2,  # INT8 Tensor Core 3,958 TOPS with sparsity
}

# PyTorch eager dispatch plus a CUDA kernel launch, per op: a GPU-bound model hides it,
# a small one does not. Measured on the H200 host used here (torch 2.11, one-element adds,
# targets.cpu.measure_dispatch): 10.2 µs per kernel, 2.1 µs per view
# (benchmarks/results/gpu_suite_artifact.json).
_LAUNCH_S = 10.2e-6
_VIEW_S = 2.1e-6  # a view launches nothing: dispatch only

_GPU_NOTES = (
    "Tensor-core rates apply to conv, matmul and attention; elementwise ops run on CUDA "
    "cores at a lower rate, but they are memory-bound on this target at any rate.",
)

H100 = Target(
    name="h100",
    description="NVIDIA H100 SXM5 80 GB (Hopper, HBM3)",
    kind="cuda",
    peak_flops=dict(_HOPPER_SXM_PEAKS),
    mem_bandwidth=3.35e12,  # GPU memory bandwidth 3.35 TB/s
    memory_bytes=80 * 10**9,  # 80 GB
    dtypes=("float64", "float32", "tf32", "bfloat16", "float16", "float8", "int8"),
    layout="channels_last",
    preferred_dtype="bfloat16",
    source="NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column (tensor-core rates: "
    "the printed with-sparsity figures halved, per the datasheet's footnote)",
    notes=_GPU_NOTES,
    dispatch_s=_LAUNCH_S,
    view_dispatch_s=_VIEW_S,
)

H200 = Target(
    name="h200",
    description="NVIDIA H200 SXM 141 GB (Hopper, HBM3e)",
    kind="cuda",
    # The H200 datasheet prints the same compute rates as the H100 SXM (same GH100 die).
    peak_flops=dict(_HOPPER_SXM_PEAKS),
    mem_bandwidth=4.8e12,  # GPU memory bandwidth 4.8 TB/s
    memory_bytes=141 * 10**9,  # 141 GB
    dtypes=("float64", "float32", "tf32", "bfloat16", "float16", "float8", "int8"),
    layout="channels_last",
    preferred_dtype="bfloat16",
    source="NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column (tensor-core rates: "
    "the printed with-sparsity figures halved, per the datasheet's footnote)",
    notes=_GPU_NOTES,
    dispatch_s=_LAUNCH_S,
    view_dispatch_s=_VIEW_S,
)

A100 = Target(
    name="a100",
    description="NVIDIA A100 SXM4 80 GB (Ampere, HBM2e)",
    kind="cuda",
    peak_flops={
        "float64": 19.5 * _T,  # FP64 Tensor Core 19.5 TFLOPS
        "float32": 19.5 * _T,  # FP32 19.5 TFLOPS
        "tf32": 156 * _T,  # TF32 Tensor Core 156 TFLOPS (312 with sparsity)
        "bfloat16": 312 * _T,  # BF16 Tensor Core 312 TFLOPS (624 with sparsity)
        "float16": 312 * _T,  # FP16 Tensor Core 312 TFLOPS (624 with sparsity)
        "int8": 624 * _T,  # INT8 Tensor Core 624 TOPS (1,248 with sparsity)
    },
    mem_bandwidth=2.039e12,  # A100 80GB SXM: 2,039 GB/s
    memory_bytes=80 * 10**9,  # 80 GB HBM2e
    dtypes=("float64", "float32", "tf32", "bfloat16", "float16", "int8"),  # no FP8 on Ampere
    layout="channels_last",
    preferred_dtype="bfloat16",
    source="NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column (dense figures "
    "as printed; the with-sparsity figures are twice these)",
    notes=_GPU_NOTES,
    dispatch_s=_LAUNCH_S,
    view_dispatch_s=_VIEW_S,
)

NVIDIA_TARGETS = {t.name: t for t in (H100, H200, A100)}
