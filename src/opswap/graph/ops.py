"""A canonical view of FX nodes, whatever the capture produced.

FX symbolic tracing gives `call_module` leaves (nn.Conv2d), torch functions
(torch.relu, F.linear) and tensor methods (x.transpose); torch.export gives ATen
overloads (aten.conv2d.default). Rules, the taxonomy and the cost model ask one
question of every node -- "what kind of op is this?" -- and get the same answer
for all four spellings.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.fx as fx
from torch import nn

# nn.Module type -> kind. Order matters only for subclasses (checked with isinstance).
_MODULE_KINDS: list[tuple[type, str]] = [
    (nn.Conv1d, "conv"),
    (nn.Conv2d, "conv"),
    (nn.Conv3d, "conv"),
    (nn.ConvTranspose1d, "conv_transpose"),
    (nn.ConvTranspose2d, "conv_transpose"),
    (nn.ConvTranspose3d, "conv_transpose"),
    (nn.Linear, "linear"),
    (nn.Bilinear, "linear"),
    (nn.modules.batchnorm._BatchNorm, "batch_norm"),
    (nn.LayerNorm, "layer_norm"),
    (nn.GroupNorm, "group_norm"),
    (nn.modules.instancenorm._InstanceNorm, "instance_norm"),
    (nn.LocalResponseNorm, "local_response_norm"),
    (nn.ReLU6, "relu6"),
    (nn.ReLU, "relu"),
    (nn.LeakyReLU, "leaky_relu"),
    (nn.PReLU, "prelu"),
    (nn.ELU, "elu"),
    (nn.SELU, "selu"),
    (nn.CELU, "celu"),
    (nn.GELU, "gelu"),
    (nn.SiLU, "silu"),
    (nn.Mish, "mish"),
    (nn.Sigmoid, "sigmoid"),
    (nn.Tanh, "tanh"),
    (nn.Hardswish, "hardswish"),
    (nn.Hardsigmoid, "hardsigmoid"),
    (nn.Hardtanh, "hardtanh"),
    (nn.Softplus, "softplus"),
    (nn.Softmax, "softmax"),
    (nn.LogSoftmax, "log_softmax"),
    (nn.MaxPool1d, "max_pool"),
    (nn.MaxPool2d, "max_pool"),
    (nn.MaxPool3d, "max_pool"),
    (nn.AvgPool1d, "avg_pool"),
    (nn.AvgPool2d, "avg_pool"),
    (nn.AvgPool3d, "avg_pool"),
    (nn.AdaptiveAvgPool1d, "adaptive_avg_pool"),
    (nn.AdaptiveAvgPool2d, "adaptive_avg_pool"),
    (nn.AdaptiveAvgPool3d, "adaptive_avg_pool"),
    (nn.AdaptiveMaxPool1d, "adaptive_max_pool"),
    (nn.AdaptiveMaxPool2d, "adaptive_max_pool"),
    (nn.AdaptiveMaxPool3d, "adaptive_max_pool"),
    (nn.modules.dropout._DropoutNd, "dropout"),
    (nn.Identity, "identity"),
    (nn.Flatten, "flatten"),
    (nn.Unflatten, "view"),
    (nn.Embedding, "embedding"),
    (nn.EmbeddingBag, "embedding_bag"),
    (nn.RNNBase, "rnn"),
    (nn.RNNCellBase, "rnn_cell"),
    (nn.MultiheadAttention, "attention"),
    (nn.Upsample, "upsample"),
    (nn.PixelShuffle, "pixel_shuffle"),
]
if hasattr(nn, "RMSNorm"):
    _MODULE_KINDS.append((nn.RMSNorm, "rms_norm"))

# Function / method / ATen names -> kind. Names are what `_raw_name` returns.
_NAME_KINDS: dict[str, str] = {}


def _alias(kind: str, *names: str) -> None:
    for n in names:
        _NAME_KINDS[n] = kind


_alias(
    "conv",
    "conv1d",
    "conv2d",
    "conv3d",
    "convolution",
    "_convolution",
    "cudnn_convolution",
    "mkldnn_convolution",
    "conv_relu",
)  # conv_relu: opswap::conv_relu, a conv + fused ReLU
_alias("conv_transpose", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d")
_alias("linear", "linear")
_alias("addmm", "addmm")
_alias("matmul", "matmul", "mm", "bmm", "baddbmm", "addbmm", "einsum", "__matmul__", "dot", "mv")
_alias(
    "batch_norm",
    "batch_norm",
    "_native_batch_norm_legit_no_training",
    "_native_batch_norm_legit",
    "native_batch_norm",
    "_batch_norm_with_update",
    "_batch_norm_no_update",
    "cudnn_batch_norm",
)
_alias("layer_norm", "layer_norm", "native_layer_norm")
_alias("group_norm", "group_norm", "native_group_norm")
_alias("instance_norm", "instance_norm")
_alias("rms_norm", "rms_norm", "_fused_rms_norm")
_alias("relu", "relu", "relu_")
_alias("relu6", "relu6")
_alias("leaky_relu", "leaky_relu", "leaky_relu_")
_alias("gelu", "gelu")
_alias("silu", "silu", "silu_")
_alias("sigmoid", "sigmoid", "sigmoid_")
_alias("tanh", "tanh", "tanh_")
_alias("hardswish", "hardswish", "hardswish_")
_alias("hardsigmoid", "hardsigmoid", "hardsigmoid_")
_alias("hardtanh", "hardtanh", "hardtanh_")
_alias("elu", "elu", "elu_")
_alias("mish", "mish")
_alias("softplus", "softplus")
_alias("softmax", "softmax", "_softmax", "_safe_softmax")
_alias("log_softmax", "log_softmax", "_log_softmax")
_alias(
    "max_pool",
    "max_pool1d",
    "max_pool2d",
    "max_pool3d",
    "max_pool2d_with_indices",
    "max_pool3d_with_indices",
)
_alias("avg_pool", "avg_pool1d", "avg_pool2d", "avg_pool3d")
_alias(
    "adaptive_avg_pool",
    "adaptive_avg_pool1d",
    "adaptive_avg_pool2d",
    "adaptive_avg_pool3d",
    "_adaptive_avg_pool2d",
    "_adaptive_avg_pool3d",
)
_alias("adaptive_max_pool", "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d")
_alias(
    "dropout",
    "dropout",
    "dropout_",
    "feature_dropout",
    "alpha_dropout",
    "native_dropout",
    "dropout1d",
    "dropout2d",
    "dropout3d",
)
_alias("embedding", "embedding")
_alias("embedding_bag", "embedding_bag", "_embedding_bag")
_alias("rnn", "lstm", "gru", "rnn_tanh", "rnn_relu")
_alias("rnn_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell")
_alias(
    "attention",
    "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_cudnn_attention",
    "multi_head_attention_forward",
)
_alias("add", "add", "add_", "iadd", "__add__", "__radd__")
_alias("sub", "sub", "sub_", "rsub", "isub", "__sub__", "__rsub__")
_alias("mul", "mul", "mul_", "imul", "__mul__", "__rmul__")
_alias("div", "div", "div_", "truediv", "itruediv", "__truediv__", "__rtruediv__", "true_divide")
_alias("pow", "pow", "__pow__", "square")
_alias("sqrt", "sqrt")
_alias("rsqrt", "rsqrt")
_alias("exp", "exp")
_alias("log", "log")
_alias("neg", "neg", "__neg__")
_alias("abs", "abs")
_alias("clamp", "clamp", "clamp_", "clip", "clamp_min", "clamp_max")
_alias("erf", "erf")
_alias("where", "where", "masked_fill", "masked_fill_")
_alias("maximum", "maximum", "minimum")
_alias("sum", "sum")
_alias("mean", "mean")
_alias("var", "var", "var_mean")
_alias("std", "std")
_alias("amax", "amax", "max", "amin", "min", "argmax", "argmin")
_alias("prod", "prod")
_alias("norm", "norm", "linalg_vector_norm")
_alias("cumsum", "cumsum")
_alias("topk", "topk")
_alias("sort", "sort", "argsort")
_alias("view", "view", "_unsafe_view", "unflatten")
_alias("reshape", "reshape")
_alias("flatten", "flatten")
_alias("permute", "permute")
_alias("transpose", "transpose", "t", "swapaxes", "swapdims", "mT", "mH", "adjoint")
_alias("contiguous", "contiguous", "clone")
_alias("squeeze", "squeeze", "unsqueeze")
_alias("expand", "expand", "expand_as", "repeat", "broadcast_to")
_alias("cat", "cat", "concat", "concatenate", "stack")
_alias("split", "split", "chunk", "split_with_sizes", "unbind")
_alias("slice", "slice", "select", "index_select", "gather", "getitem", "index", "narrow")
_alias("pad", "pad", "constant_pad_nd")
_alias("upsample", "interpolate", "upsample_nearest2d", "upsample_bilinear2d")
_alias("pixel_shuffle", "pixel_shuffle")
_alias("to", "to", "type", "float", "half", "bfloat16", "_to_copy")
_alias("identity", "alias", "detach")
_alias("size", "size", "dim", "numel", "sym_size", "sym_numel")

CATEGORIES = (
    "conv",
    "matmul",
    "elementwise",
    "activation",
    "normalization",
    "reduction",
    "softmax",
    "pooling",
    "data-movement",
    "embedding",
    "rnn",
    "attention",
    "other",
)

_KIND_CATEGORY: dict[str, str] = {}
for _cat, _kinds in {
    "conv": ["conv", "conv_transpose"],
    "matmul": ["linear", "addmm", "matmul"],
    "elementwise": [
        "add",
        "sub",
        "mul",
        "div",
        "pow",
        "sqrt",
        "rsqrt",
        "exp",
        "log",
        "neg",
        "abs",
        "clamp",
        "erf",
        "where",
        "maximum",
        "to",
    ],
    "activation": [
        "relu",
        "relu6",
        "leaky_relu",
        "prelu",
        "elu",
        "selu",
        "celu",
        "gelu",
        "silu",
        "mish",
        "sigmoid",
        "tanh",
        "hardswish",
        "hardsigmoid",
        "hardtanh",
        "softplus",
    ],
    "normalization": [
        "batch_norm",
        "layer_norm",
        "group_norm",
        "instance_norm",
        "rms_norm",
        "local_response_norm",
    ],
    "reduction": ["sum", "mean", "var", "std", "amax", "prod", "norm", "cumsum", "topk", "sort"],
    "softmax": ["softmax", "log_softmax"],
    "pooling": ["max_pool", "avg_pool", "adaptive_avg_pool", "adaptive_max_pool"],
    "data-movement": [
        "view",
        "reshape",
        "flatten",
        "permute",
        "transpose",
        "contiguous",
        "squeeze",
        "expand",
        "cat",
        "split",
        "slice",
        "pad",
        "upsample",
        "pixel_shuffle",
        "identity",
        "dropout",
    ],
    "embedding": ["embedding", "embedding_bag"],
    "rnn": ["rnn", "rnn_cell"],
    "attention": ["attention"],
}.items():
    for _k in _kinds:
        _KIND_CATEGORY[_k] = _cat


def raw_name(node: fx.Node) -> str:
    """The bare name of what a node calls: 'conv2d', 'add', 'transpose', or the module type
    (for a loaded program's direct call of an opswap op, backends.eager, the op's)."""
    t = getattr(node.target, "opswap_op", node.target)
    if node.op == "call_method":
        return str(t)
    if node.op == "call_module":
        return type(_owner(node).get_submodule(str(t))).__name__
    if node.op != "call_function":
        return node.op
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name.split("::", 1)[-1]
    if isinstance(t, torch._ops.OpOverloadPacket):
        return t._qualified_op_name.split("::", 1)[-1]
    if t is operator.getitem:
        return "getitem"
    return getattr(t, "__name__", str(t))


def _owner(node: fx.Node) -> nn.Module:
    # the nodes opswap reads live in a GraphModule's graph
    return cast(fx.GraphModule, node.graph.owning_module)


def module_of(node: fx.Node) -> nn.Module | None:
    """The submodule a call_module node calls, else None."""
    if node.op != "call_module":
        return None
    return _owner(node).get_submodule(str(node.target))


def op_kind(node: fx.Node) -> str:
    """Canonical op kind of a node ('conv', 'linear', 'relu', 'transpose', ...).

    Placeholders, outputs and constants return their FX op ('placeholder',
    'output', 'get_attr'); anything unrecognised returns 'unknown:<name>'.
    """
    if node.op == "call_module":
        mod = module_of(node)
        own = getattr(mod, "opswap_kind", None)  # modules opswap installs say what they are
        if own:
            return own
        for cls, kind in _MODULE_KINDS:
            if isinstance(mod, cls):
                return kind
        return f"unknown:{type(mod).__name__}"
    if node.op in ("placeholder", "output", "get_attr"):
        return node.op
    name = raw_name(node)
    if name == "getattr" and node.args[1:2] in (("T",), ("mT",), ("mH",)):
        return "transpose"  # FX traces x.T and x.mT as getattr(x, "T")
    found = _NAME_KINDS.get(name) or _NAME_KINDS.get(name.rstrip("_"))
    return found if found else f"unknown:{name}"


def category(node: fx.Node) -> str:
    """Chapter-2 taxonomy: one of CATEGORIES."""
    return _KIND_CATEGORY.get(op_kind(node), "other")


def is_compute(node: fx.Node) -> bool:
    """True for nodes that run an op (not inputs, outputs, constants or shape queries)."""
    if node.op not in ("call_module", "call_function", "call_method"):
        return False
    if node.op == "call_module" and str(node.target).startswith("_guards"):
        return False
    return op_kind(node) != "size"


def compute_nodes(gm: fx.GraphModule) -> Iterable[fx.Node]:
    return (n for n in gm.graph.nodes if is_compute(n))


def is_aten(node: fx.Node) -> bool:
    """True when the node calls an ATen overload (the torch.export flavour)."""
    t = getattr(node.target, "opswap_op", node.target)  # backends.eager's direct calls
    return isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))


def copy_meta(new: fx.Node, old: fx.Node) -> None:
    """Give a node a rewrite created the metadata of the value it stands for, so later
    matches in the same pass can still read its shape (shapes are re-propagated only
    between rules) and reports still name its module, and calibration's observer of the
    value (graph.calibrate) stays with it."""
    for key in (
        "tensor_meta", "probe_meta", "val", "nn_module_stack", "stack_trace",
        "opswap.observer", "opswap.observed_once",
    ):  # fmt: skip
        if key in old.meta:
            new.meta[key] = old.meta[key]


# --------------------------------------------------------------------------- tensors of a node


def attr_tensor(gm: nn.Module | None, node_or_value) -> torch.Tensor | None:
    """The constant tensor behind a get_attr node (or the value itself if already a tensor);
    None for a node of a graph no module owns (`gm` None)."""
    if isinstance(node_or_value, torch.Tensor):
        return node_or_value
    if isinstance(node_or_value, fx.Node) and node_or_value.op == "get_attr":
        obj: Any = gm
        for part in str(node_or_value.target).split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                return None
        return obj if isinstance(obj, torch.Tensor) else None
    return None


def set_attr_tensor(gm: nn.Module, target: str, value: torch.Tensor, *, as_param: bool) -> None:
    """Install `value` at dotted path `target` on gm, creating parent modules as needed."""
    *parents, leaf = target.split(".")
    obj = gm
    for part in parents:
        if not hasattr(obj, part):
            obj.add_module(part, nn.Module())
        obj = getattr(obj, part)
    if hasattr(obj, leaf):
        delattr(obj, leaf)
    if as_param:
        obj.register_parameter(leaf, nn.Parameter(value, requires_grad=value.is_floating_point()))
    else:
        obj.register_buffer(leaf, value)


def fresh_attr_name(gm: nn.Module, base: str) -> str:
    """A dotted-free attribute name on gm that is not yet taken."""
    base = base.replace(".", "_")
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    return name


def arg(node: fx.Node, index: int, name: str, default=None):
    """A call argument by position or keyword."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)
