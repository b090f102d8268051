"""FLOPs of per-element ops: elementwise, activations, norms, softmax, reductions, pooling.

One FLOP per arithmetic operation of the op's textbook formula, a transcendental
function (exp, log, erf, tanh, sqrt) counting as one; the constants below say
which formula. Normalisations that compute statistics pay NORM_STATS_FLOPS per
element on top of applying them; BatchNorm in eval uses its running statistics.
"""

from __future__ import annotations

import math
import re

import torch
import torch.fx as fx

from opswap.cost._nodes import out_info, prod, tensor_inputs, tinfo
from opswap.graph.ops import arg, module_of, raw_name

# FLOPs per output element.
ELEMENTWISE_FLOPS: dict[str, int] = {
    "add": 1,
    "sub": 1,
    "mul": 1,
    "div": 1,
    "neg": 1,
    "abs": 1,
    "clamp": 1,
    "where": 1,
    "maximum": 1,
    "pow": 1,
    "sqrt": 1,
    "rsqrt": 1,
    "exp": 1,
    "log": 1,
    "erf": 1,
    "to": 0,
}

# FLOPs per output element, from each activation's formula.
ACTIVATION_FLOPS: dict[str, int] = {
    "relu": 1,  # max(x, 0)
    "relu6": 2,  # min(max(x, 0), 6)
    "leaky_relu": 2,  # compare, multiply
    "prelu": 2,
    "hardtanh": 2,  # min, max
    "tanh": 1,
    "sigmoid": 4,  # 1 / (1 + exp(-x)): neg, exp, add, div
    "silu": 5,  # x * sigmoid(x)
    "elu": 4,  # compare, exp, sub, mul
    "celu": 6,
    "selu": 6,
    "gelu": 5,  # 0.5 * x * (1 + erf(x / sqrt 2)): mul, erf, add, mul, mul
    "gelu_tanh": 9,  # 0.5 x (1 + tanh(c (x + 0.044715 x^3))): 7 mul/add + tanh + add
    "hardswish": 5,  # x * min(max(x + 3, 0), 6) / 6
    "hardsigmoid": 4,  # min(max(x + 3, 0), 6) / 6
    "softplus": 5,  # log(1 + exp(b x)) / b
    "mish": 5,  # x * tanh(softplus(x))
}

# Comparisons and other one-operation ATen ops that the op taxonomy calls 'unknown'.
ONE_FLOP_NAMES = {
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "logical_and",
    "logical_or",
    "logical_not",
    "logical_xor",
    "bitwise_and",
    "bitwise_or",
    "bitwise_not",
    "bitwise_xor",
    "masked_fill",
    "floor",
    "ceil",
    "round",
    "trunc",
    "sign",
    "reciprocal",
    "sin",
    "cos",
    "fmod",
    "remainder",
    "floor_divide",
    "isnan",
    "isinf",
    "minimum",
    "fill",
    "lerp",
    "addcmul",
    "addcdiv",
    "exp2",
    "expm1",
    "log1p",
    "log2",
}

SOFTMAX_FLOPS = 5  # per element: max, subtract, exp, sum, divide (log_softmax: ... subtract)
NORM_STATS_FLOPS = 3  # per element for mean and variance in one pass: add, multiply, add
NORM_APPLY_FLOPS = 2  # (x - mean) * rstd
AFFINE_FLOPS = 2  # * weight + bias
VAR_FLOPS = 3  # var / std per input element, one pass
VECTOR_NORM_FLOPS = 2  # p=2 norm: square and add


def shape_of(value) -> tuple[int, ...] | None:
    ti = tinfo(value)
    return ti.shape if ti is not None else None


def out_numel(node: fx.Node) -> int:
    o = out_info(node)
    return o.numel if o is not None else 0


def in_numel(node: fx.Node) -> int:
    ins = tensor_inputs(node)
    return ins[0][1].numel if ins else 0


def has_affine(node: fx.Node, kind: str) -> bool:
    mod = module_of(node)
    if mod is not None:
        return getattr(mod, "weight", None) is not None
    name = raw_name(node)
    pos = {
        "batch_norm": 1,
        "_native_batch_norm_legit_no_training": 1,
        "_native_batch_norm_legit": 1,
        "native_batch_norm": 1,
        "layer_norm": 2,
        "native_layer_norm": 2,
        "group_norm": 2,
        "native_group_norm": 1,
        "instance_norm": 3,
        "rms_norm": 2,
        "_fused_rms_norm": 2,
    }.get(name)
    return pos is not None and isinstance(arg(node, pos, "weight"), fx.Node)


def training_bn(node: fx.Node) -> bool:
    mod = module_of(node)
    if mod is not None:
        return bool(mod.training or not getattr(mod, "track_running_stats", True))
    name = raw_name(node)
    if name in ("batch_norm", "native_batch_norm", "_native_batch_norm_legit"):
        return bool(arg(node, 5, "training", False))
    return False


def norm(node: fx.Node, kind: str) -> int:
    n = in_numel(node)
    affine = AFFINE_FLOPS if has_affine(node, kind) else 0
    if kind == "batch_norm":
        stats = NORM_STATS_FLOPS if training_bn(node) else 0
        return n * (stats + NORM_APPLY_FLOPS + affine)
    if kind == "rms_norm":  # mean of squares (2), scale (1), weight (1)
        return n * (2 + 1 + (1 if affine else 0))
    if kind == "local_response_norm":
        mod = module_of(node)
        size = getattr(mod, "size", None) or arg(node, 1, "size", 5)
        return n * (2 * int(size) + 3)
    return n * (NORM_STATS_FLOPS + NORM_APPLY_FLOPS + affine)


def gelu_tanh(node: fx.Node) -> bool:
    mod = module_of(node)
    if mod is not None:
        return getattr(mod, "approximate", "none") == "tanh"
    return node.kwargs.get("approximate", "none") == "tanh" or "tanh" in node.args[1:]


def spatial_dims(node: fx.Node) -> int:
    mod = module_of(node)
    name = type(mod).__name__ if mod is not None else raw_name(node)
    m = re.search(r"([123])d", name)
    if m:
        return int(m.group(1))
    o = shape_of(node)
    return max(1, len(o) - 2) if o else 2


def kernel_elems(node: fx.Node) -> int:
    mod = module_of(node)
    k = getattr(mod, "kernel_size", None) if mod is not None else arg(node, 1, "kernel_size")
    if k is None:
        return 1
    if isinstance(k, int):
        return k ** spatial_dims(node)
    return prod(k)


def pool(node: fx.Node, kind: str) -> int:
    out = out_numel(node)
    if kind == "max_pool":
        return out * kernel_elems(node)
    if kind == "avg_pool":
        return out * (kernel_elems(node) + 1)  # adds, then one divide
    if kind == "adaptive_avg_pool":
        return in_numel(node) + out
    return in_numel(node)  # adaptive_max_pool: one comparison per input element


def reduction(node: fx.Node, kind: str) -> int:
    n = in_numel(node)
    if kind in ("var", "std"):
        return VAR_FLOPS * n
    if kind == "norm":
        return VECTOR_NORM_FLOPS * n
    if kind == "mean":
        return n + out_numel(node)
    if kind == "topk":
        k = arg(node, 1, "k", 1)
        if not isinstance(k, int):  # a size computed in the graph (min(k, n)): its example
            k = getattr(k, "meta", {}).get("val", 1)
            k = int(k) if isinstance(k, int) else 1
        return n * max(1, math.ceil(math.log2(int(k) + 1)))
    if kind == "sort":
        shape = shape_of(node.args[0]) or (1,)
        dim = arg(node, 1, "dim", -1)
        length = shape[dim] if isinstance(dim, int) and shape else 1
        return n * max(1, math.ceil(math.log2(max(2, length))))
    return n  # sum, amax/amin/argmax, prod, cumsum: one operation per input element


def upsample(node: fx.Node) -> int:
    mod = module_of(node)
    name = raw_name(node)
    if mod is not None:
        mode = getattr(mod, "mode", "nearest")
    elif name.startswith("upsample_"):  # upsample_bilinear2d, upsample_nearest2d, ...
        mode = re.sub(r"\d+d$", "", name.removeprefix("upsample_"))
    else:  # F.interpolate(input, size, scale_factor, mode, ...)
        mode = arg(node, 3, "mode", "nearest")
    if not isinstance(mode, str) or mode.startswith("nearest") or mode == "area":
        return 0
    taps = 4 if mode == "bicubic" else 2
    return 2 * taps ** spatial_dims(node) * out_numel(node)  # one multiply-add per tap


def training_dropout(node: fx.Node) -> bool:
    mod = module_of(node)
    if mod is not None:
        return bool(mod.training)
    name = raw_name(node)
    if name == "native_dropout":
        return bool(arg(node, 2, "train", True))
    if name in ("dropout", "dropout_", "feature_dropout", "alpha_dropout"):
        if isinstance(node.target, torch._ops.OpOverload):
            return bool(arg(node, 2, "train", False))
        return bool(arg(node, 2, "training", True))
    return False
