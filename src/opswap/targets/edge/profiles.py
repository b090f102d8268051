"""Edge back ends as data: per delegate, the ops (by ATen/edge op name), the dtypes and the
shape conditions under which it takes an op. `delegation` (targets.edge.delegation) reads
a program against one of these; the legalisation rules (rules/legalize) rewrite a model
into the op set.

An op is named as its overload packet with `_copy` dropped (edge's `view_copy` is
`view`, `permute_copy` is `permute`), so that one profile reads both a torch.export
program and an ExecuTorch edge program. A condition is a key of
`delegation.CONDITIONS` (a check on the node and the reason it fails, in words).

Sources, read from the executorch package installed here (1.x) and coremltools 9.0:

- XNNPACK: backends/xnnpack/partition/config/__init__.py (ALL_PARTITIONER_CONFIGS and
  each config's `check_constraints`, e.g. MeanDimConfig: 4-D input, dims (2, 3),
  keepdim); quantized: quant_affine_configs.py and the QUANT precision types of each
  config (linear, conv, add, mul, cat, pooling and the q/dq ops).
- Vulkan: backends/vulkan/op_registry.py (every `exir_ops.edge.aten.*` it registers).
- QNN (Hexagon HTP): backends/qualcomm/builders/*.py (each builder's `target`); the op
  set only: no QNN SDK here, so nothing is compiled or run for it.
- LiteRT's XNNPACK delegate: TensorFlow Lite's xnnpack_delegate.cc op list, written as
  the ATen ops the PyTorch converter maps onto those TFLite builtins (FULLY_CONNECTED,
  CONV_2D, DEPTHWISE_CONV_2D, ADD, MUL, SUB, DIV, MEAN, SOFTMAX, LOGISTIC, TANH, GELU,
  HARD_SWISH, RELU/RELU6, MAX/AVERAGE_POOL_2D, CONCATENATION, RESHAPE, TRANSPOSE,
  BATCH_MATMUL, RSQRT, SQRT, ...).
- Core ML (ANE): coremltools 9.0's torch frontend registry (what converts), of which the
  ANE runs the float16 subset listed; ops outside fall back to the GPU or the CPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from opswap.errors import TargetError
from opswap.targets.base import Target, dtype_key

#: ops that move or reinterpret data without arithmetic: not counted as compute ops
LAYOUT_OPS = frozenset(
    {
        "view",
        "reshape",
        "_unsafe_view",
        "permute",
        "transpose",
        "t",
        "expand",
        "unsqueeze",
        "squeeze",
        "slice",
        "select",
        "clone",
        "contiguous",
        "alias",
        "_to_dim_order",
        "_clone_dim_order",
        "_to_copy",
        "cat",
        "split",
        "split_with_sizes",
        "unbind",
        "embedding",
        "index_select",
        "gather",
        "index",
        "detach",
        "lift_fresh",
        "arange",
        "full",
        "zeros",
        "ones",
        "scalar_tensor",
        "constant_pad_nd",
        "sym_size",
        "getitem",
    }
)


@dataclass(frozen=True)
class EdgeProfile:
    """One delegate's op set: `ops` maps an op name to the conditions it must meet (keys of
    delegation.CONDITIONS, all of them); `dtypes` the element types it takes."""

    name: str
    title: str
    delegate: str  # the delegate's own name (ExecuTorch backend id, or the runtime's)
    ops: Mapping[str, tuple[str, ...]]
    dtypes: tuple[str, ...]
    static_shapes: bool = False  # every dim fixed when the program is built
    runs_here: bool = True  # whether this machine can run what it delegates
    source: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)

    def takes(self, op: str) -> bool:
        return op in self.ops


def _ops(names: str, **conditions: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {n: () for n in names.split()}
    out.update(conditions)
    return out


_XNN_FP32 = _ops(
    "_native_batch_norm_legit_no_training _softmax _to_dim_order _clone_dim_order abs add "
    "addmm avg_pool2d bmm cat ceil clamp clone constant_pad_nd convolution cos div exp "
    "floor gelu hardswish hardtanh leaky_relu linear log max maximum max_pool2d mean minimum "
    "mm mul neg permute pow prelu relu rsqrt sigmoid sin slice sqrt sub tanh unsqueeze "
    "upsample_bilinear2d view",
    mean=("mean_4d_inner",),
    pow=("scalar_exponent",),
    bmm=("rank3",),
    convolution=("conv_2d",),
    max=("max_dim_keepdim",),
)

# the int8 path: what the XNNPACKQuantizer annotates and the partitioner takes quantized
_XNN_INT8 = _ops(
    "quantize_per_tensor dequantize_per_tensor quantize_per_channel dequantize_per_channel "
    "quantize_affine dequantize_affine choose_qparams_affine choose_qparams "
    "convolution linear addmm mm add mul cat avg_pool2d max_pool2d relu hardtanh mean "
    "permute view slice _to_dim_order",
    mean=("mean_4d_inner",),
    convolution=("conv_2d",),
)

_VULKAN = _ops(
    "_log_softmax _native_batch_norm_legit_no_training _softmax _to_copy abs add addmm "
    "alias amax amin arange argmax argmin avg_pool2d bitwise_and bitwise_not bitwise_or bmm "
    "cat clamp clone constant_pad_nd convolution copy cos div embedding eq exp expand flip "
    "full full_like gather ge gelu grid_sampler_2d gt hardshrink hardswish hardtanh index "
    "index_select le leaky_relu linear log10 logical_and logical_not logical_or lt "
    "max_pool2d max_pool2d_with_indices mean minimum mm mul native_group_norm "
    "native_layer_norm ne neg ones ones_like permute pixel_shuffle pow relu repeat round "
    "rsqrt scalar_tensor select sigmoid sin slice split_with_sizes sqrt squeeze sub sum t "
    "tanh unfold unsqueeze upsample_bilinear2d upsample_nearest2d view where zeros "
    "zeros_like",
    convolution=("conv_2d",),
)

_QNN = _ops(
    "_adaptive_avg_pool3d _log_softmax _softmax _to_copy abs adaptive_avg_pool2d "
    "adaptive_max_pool2d add amax amin arange argmax argmin asin atan avg_pool2d avg_pool3d "
    "bitwise_and bitwise_or bitwise_xor bmm cat ceil channel_shuffle clamp convolution copy "
    "cos cumsum div elu embedding eq exp expand flip floor floor_divide full full_like "
    "gather ge gelu grid_sampler_2d gt hardsigmoid hardswish hardtanh index index_put "
    "index_select instance_norm isinf isnan le linear log logical_not lt matmul max "
    "max_pool2d_with_indices maximum mean min minimum mul native_group_norm "
    "native_layer_norm ne neg permute pixel_shuffle pixel_unshuffle pow prelu reciprocal "
    "relu repeat rms_norm round rsqrt select sigmoid sign sin slice slice_scatter sort "
    "split_with_sizes sqrt squeeze stack sub sum tanh topk unbind unsqueeze "
    "upsample_bicubic2d upsample_bilinear2d upsample_nearest2d view where",
    mean=("rank_at_most_4",),
)

_LITERT_XNN = _ops(
    "addmm mm linear bmm convolution add sub mul div mean _softmax sigmoid tanh gelu "
    "hardswish relu hardtanh clamp avg_pool2d max_pool2d cat view permute rsqrt sqrt neg "
    "abs exp floor ceil _native_batch_norm_legit_no_training leaky_relu prelu maximum "
    "minimum constant_pad_nd slice unsqueeze squeeze pow log sin cos",
    convolution=("conv_2d",),
    pow=("scalar_exponent",),
)

_LITERT_INT8 = _ops(
    "addmm mm linear convolution add mul mean _softmax relu hardtanh avg_pool2d max_pool2d "
    "cat view permute quantize_per_tensor dequantize_per_tensor quantize_per_channel "
    "dequantize_per_channel",
    convolution=("conv_2d",),
)

_COREML_ANE = _ops(
    "addmm mm linear bmm matmul convolution add sub mul div mean sum _softmax softmax "
    "sigmoid tanh gelu silu hardswish hardsigmoid relu hardtanh clamp avg_pool2d max_pool2d "
    "adaptive_avg_pool2d cat view reshape permute transpose rsqrt sqrt neg abs exp "
    "_native_batch_norm_legit_no_training native_layer_norm layer_norm leaky_relu maximum "
    "minimum constant_pad_nd slice select unsqueeze squeeze pow embedding "
    "scaled_dot_product_attention split_with_sizes expand upsample_bilinear2d "
    "upsample_nearest2d where",
    convolution=("conv_2d",),
    mean=("rank_at_most_4",),
)

PROFILES: dict[str, EdgeProfile] = {
    p.name: p
    for p in (
        EdgeProfile(
            "xnnpack",
            "ExecuTorch XNNPACK (fp32)",
            "XnnpackBackend",
            _XNN_FP32,
            ("float32",),
            source="executorch/backends/xnnpack/partition/config/__init__.py",
        ),
        EdgeProfile(
            "xnnpack-int8",
            "ExecuTorch XNNPACK (int8, quantized)",
            "XnnpackBackend",
            _XNN_INT8,
            ("int8", "uint8", "int32", "float32"),
            source="executorch/backends/xnnpack/partition/config/quant_affine_configs.py",
            notes=("float32 only on the q/dq boundaries and the dynamic-quant path",),
        ),
        EdgeProfile(
            "vulkan",
            "ExecuTorch Vulkan (mobile GPU)",
            "VulkanBackend",
            _VULKAN,
            ("float32", "float16", "int32", "int8", "bool"),
            runs_here=False,
            source="executorch/backends/vulkan/op_registry.py",
        ),
        EdgeProfile(
            "litert-xnnpack",
            "LiteRT with the XNNPACK delegate (fp32)",
            "TfLiteXNNPackDelegate",
            _LITERT_XNN,
            ("float32",),
            source="tensorflow/lite/delegates/xnnpack/xnnpack_delegate.cc (builtin op list)",
        ),
        EdgeProfile(
            "litert-int8",
            "LiteRT int8 (XNNPACK quantized kernels)",
            "TfLiteXNNPackDelegate",
            _LITERT_INT8,
            ("int8", "int32"),
            source="tensorflow/lite/delegates/xnnpack/xnnpack_delegate.cc (QS8 paths)",
        ),
        EdgeProfile(
            "coreml-ane",
            "Core ML on the Apple Neural Engine",
            "CoreMLBackend",
            _COREML_ANE,
            ("float16",),
            static_shapes=True,
            runs_here=False,
            source="coremltools 9.0 converters/mil/frontend/torch/ops.py (ANE subset)",
            notes=("coremltools converts on Linux; running needs Apple hardware",),
        ),
        EdgeProfile(
            "qnn-htp",
            "Qualcomm QNN on the Hexagon NPU (HTP)",
            "QnnBackend",
            _QNN,
            ("int8", "uint8", "int16", "float16"),
            static_shapes=True,
            runs_here=False,
            source="executorch/backends/qualcomm/builders/*.py (each builder's target)",
            notes=("op-set description only: no QNN SDK here to compile or run",),
        ),
    )
}


def get_profile(name: str | EdgeProfile) -> EdgeProfile:
    """The edge profile called `name` (case-insensitive); a profile passes through."""
    if isinstance(name, EdgeProfile):
        return name
    key = str(name).strip().lower()
    if key not in PROFILES:
        raise TargetError(
            f"Unknown edge profile {name!r}; known edge profiles are {', '.join(PROFILES)}."
        )
    return PROFILES[key]


def _target(p: EdgeProfile) -> Target:
    # nominal ceilings of the device class each delegate is built for (roofline only; the
    # edge race measures on this CPU): a phone's big CPU cores (4 x Cortex-A78-class at
    # 2.4 GHz: 2 x 128-bit FMA units, ~150 GFLOP/s fp32, ~25 GB/s LPDDR5), a phone GPU
    # (~1 TFLOP/s fp16), the ANE (~17 TOPS fp16 as Apple states for A15/M1-class) and the
    # Hexagon HTP (~15 TOPS int8 as Qualcomm states for its 8-series)
    peaks = {
        "xnnpack": {"float32": 150e9, "int8": 600e9},
        "vulkan": {"float32": 500e9, "float16": 1e12},
        "coreml-ane": {"float32": 17e12, "float16": 17e12},
        "qnn-htp": {"float32": 7.5e12, "float16": 7.5e12, "int8": 15e12},
    }
    family = p.name.split("-")[0] if p.name.startswith("xnnpack") else p.name
    if p.name.startswith("litert"):
        family = "xnnpack"
    return Target(
        name=p.name,
        description=p.title,
        kind="edge",
        peak_flops=peaks.get(family, peaks["xnnpack"]),
        mem_bandwidth=25e9 if family in ("xnnpack", "vulkan") else 50e9,
        memory_bytes=8 * 2**30,
        dtypes=tuple(dtype_key(d) for d in p.dtypes if d != "bool"),
        preferred_dtype=dtype_key(p.dtypes[0]),
        source=p.source,
        notes=(f"edge profile {p.name}: legalise with the 'edge' rules (rules/legalize)",)
        + p.notes,
    )


#: the profiles as Targets (kind "edge"), for the planner and `--target`
EDGE_TARGETS: dict[str, Target] = {name: _target(p) for name, p in PROFILES.items()}
