"""The weights of the ops rules fold things into, read in any capture flavour, and the
one way to fold a per-channel affine map into them.

The same convolution reaches a rule as an `nn.Conv2d` call_module (FX), as
`torch.conv2d(x, self.w)` with a get_attr weight (FX, functional code), or as
`aten.conv2d.default` / `aten.convolution.default` (torch.export). `weighted` reads
any of them into a `Weighted`; `batch_norm` reads an inference BatchNorm into its
running statistics. Each returns the dataclass, or a reason string a user can read
when the node does not qualify. `fold_affine` turns "op, then y * scale + shift per
output channel" into new weights for the op alone.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import cast, overload

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from opswap.graph.ops import arg, module_of, op_kind, raw_name
from opswap.rules._matching import const, describe_source


@overload
def _ntuple(v: str, n: int) -> str: ...
@overload
def _ntuple(v: int | list[int] | tuple[int, ...], n: int) -> tuple[int, ...]: ...
def _ntuple(v: str | int | list[int] | tuple[int, ...], n: int) -> tuple[int, ...] | str:
    """`v` (one int, or one per spatial dim) as a tuple of `n` ints; a padding mode
    ("same", "valid") as it is."""
    if isinstance(v, str):
        return v
    if isinstance(v, (list, tuple)):
        return tuple(int(x) for x in v) if len(v) == n else tuple(int(v[0]) for _ in range(n))
    return tuple(int(v) for _ in range(n))


# --------------------------------------------------------------------------- weighted ops


@dataclass
class Weighted:
    """A conv or linear node with constant weights, read in any flavour.

    `weight_at`/`bias_at` are the argument positions in the call (function flavour);
    for a call_module node the tensors live on `module`.
    """

    node: fx.Node
    weight: torch.Tensor
    bias: torch.Tensor | None
    module: nn.Module | None = None
    transposed: bool = False
    stride: tuple = (1,)
    padding: tuple | str = (0,)
    dilation: tuple = (1,)
    groups: int = 1
    padding_mode: str = "zeros"
    extra: dict = field(default_factory=dict)

    @property
    def out_channels(self) -> int:
        if self.transposed:
            return self.weight.shape[1] * self.groups
        return self.weight.shape[0]


# Function-flavour conv spellings: name -> positions of (stride, padding, dilation, groups,
# transposed, output_padding) in the call; None where the spelling has no such argument.
_CONV_ARGS = {
    "conv1d": (3, 4, 5, 6, None, None),
    "conv2d": (3, 4, 5, 6, None, None),
    "conv3d": (3, 4, 5, 6, None, None),
    "conv_transpose1d": (3, 4, 7, 6, None, 5),
    "conv_transpose2d": (3, 4, 7, 6, None, 5),
    "conv_transpose3d": (3, 4, 7, 6, None, 5),
    "convolution": (3, 4, 5, 8, 6, 7),
}
_CONV_NAMES = ("stride", "padding", "dilation", "groups", "transposed", "output_padding")


def weighted(gm: fx.GraphModule, node: fx.Node) -> Weighted | str:
    """The weights and settings of a conv / conv_transpose / linear node, or why they
    cannot be read (a non-constant weight, an unfamiliar spelling)."""
    kind = op_kind(node)
    if kind not in ("conv", "conv_transpose", "linear"):
        return f"{node.name} is not a convolution or linear layer"
    if node.op == "call_module":
        mod = module_of(node)
        if kind == "linear":
            if not isinstance(mod, nn.Linear):
                return f"{node.name} is a {type(mod).__name__}, not an nn.Linear"
            return Weighted(node, mod.weight, mod.bias, mod)
        if fused := getattr(mod, "fused_activation", None):
            return (
                f"{node.name} already applies a fused {fused}, so nothing "
                "after it can be folded into its weights"
            )
        if not isinstance(mod, nn.modules.conv._ConvNd):
            return f"{node.name} is a {type(mod).__name__}, not a standard convolution"
        return Weighted(
            node,
            mod.weight,
            mod.bias,
            mod,
            transposed=mod.transposed,
            stride=mod.stride,
            padding=mod.padding,
            dilation=mod.dilation,
            groups=mod.groups,
            padding_mode=mod.padding_mode,
            extra={"output_padding": mod.output_padding},
        )
    w_node, b_node = arg(node, 1, "weight"), arg(node, 2, "bias")
    w = const(gm, w_node)
    if w is None:
        return f"the weight of {node.name} is not a constant: it is {describe_source(w_node)}"
    b = None
    if b_node is not None:
        b = const(gm, b_node)
        if b is None:
            return f"the bias of {node.name} is not a constant: it is {describe_source(b_node)}"
    if kind == "linear":
        if raw_name(node) != "linear" or w.dim() != 2:
            return f"{node.name} is a {raw_name(node)} call, which opswap does not read as a linear"
        return Weighted(node, w, b)
    name = raw_name(node)
    if name not in _CONV_ARGS:
        return f"{node.name} is a {name} call, whose arguments opswap does not read"
    pos = _CONV_ARGS[name]
    d = w.dim() - 2
    defaults = (1, 0, 1, 1, name.startswith("conv_transpose"), 0)
    vals = [
        defaults[i] if p is None else arg(node, p, _CONV_NAMES[i], defaults[i])
        for i, p in enumerate(pos)
    ]
    if any(isinstance(v, fx.Node) for v in vals):
        return f"{node.name}'s stride, padding or groups are computed at run time"
    stride, padding, dilation, groups, transposed, output_padding = vals
    return Weighted(
        node,
        w,
        b,
        None,
        transposed=bool(transposed),
        stride=_ntuple(stride, d),
        padding=_ntuple(padding, d),
        dilation=_ntuple(dilation, d),
        groups=int(groups),
        extra={"output_padding": _ntuple(output_padding, d)},
    )


# --------------------------------------------------------------------------- batch norm


@dataclass
class BatchNormParts:
    """An inference BatchNorm: y = (x - mean) / sqrt(var + eps) * weight + bias."""

    node: fx.Node
    out: fx.Node  # the node whose value is the normalised tensor (a getitem for tuple ops)
    mean: torch.Tensor
    var: torch.Tensor
    eps: float
    weight: torch.Tensor | None
    bias: torch.Tensor | None

    def scale_shift(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, shift) in float64 such that bn(x) = x * scale + shift per channel."""
        var, mean = self.var.double(), self.mean.double()
        scale = torch.rsqrt(var + self.eps)
        if self.weight is not None:
            scale = scale * self.weight.double()
        shift = -mean * scale
        if self.bias is not None:
            shift = shift + self.bias.double()
        return scale, shift


def _bn_out(node: fx.Node) -> fx.Node | str:
    """The node carrying the normalised output (tuple-returning ATen overloads)."""
    if not raw_name(node).startswith("_native_batch_norm"):
        return node
    firsts = [u for u in node.users if u.target is operator.getitem and u.args[1] == 0]
    rest = [u for u in node.users if u not in firsts and u.users]
    if len(firsts) != 1 or rest:
        return f"{node.name}'s saved statistics are read by other nodes"
    return firsts[0]


def batch_norm(gm: fx.GraphModule, node: fx.Node) -> BatchNormParts | str:
    """The running statistics and affine parameters of an inference BatchNorm, or the
    reason it cannot be folded (training mode, batch statistics, non-constants)."""
    if node.op == "call_module":
        mod = module_of(node)
        if not isinstance(mod, nn.modules.batchnorm._BatchNorm):
            return f"{node.name} is a {type(mod).__name__}, not a BatchNorm"
        if mod.training:
            return (
                f"BatchNorm {node.name} is in training mode (it normalises with batch statistics)"
            )
        if mod.running_mean is None or mod.running_var is None:
            return (
                f"BatchNorm {node.name} has no running statistics (track_running_stats=False), "
                "so it normalises with batch statistics"
            )
        return BatchNormParts(
            node, node, mod.running_mean, mod.running_var, float(mod.eps), mod.weight, mod.bias
        )
    name = raw_name(node)
    order: dict[str, int | None]
    if node.target is F.batch_norm:
        order = dict(mean=1, var=2, weight=3, bias=4, training=5, eps=7)
    elif name == "batch_norm":
        order = dict(weight=1, bias=2, mean=3, var=4, training=5, eps=7)
    elif name == "_native_batch_norm_legit_no_training":
        order = dict(weight=1, bias=2, mean=3, var=4, training=None, eps=6)
    elif name in (
        "_native_batch_norm_legit",
        "native_batch_norm",
        "_native_batch_norm_legit_functional",
        "_batch_norm_with_update",
    ):
        return f"BatchNorm {node.name} is in training mode (it normalises with batch statistics)"
    else:
        return f"{node.name} is a {name} call, whose arguments opswap does not read"
    names = {
        "mean": "running_mean",
        "var": "running_var",
        "weight": "weight",
        "bias": "bias",
        "training": "training",
        "eps": "eps",
    }
    get = {k: (None if i is None else arg(node, i, names[k])) for k, i in order.items()}
    if get["training"] is True:
        return f"BatchNorm {node.name} is in training mode (it normalises with batch statistics)"
    if isinstance(get["training"], fx.Node):
        return f"BatchNorm {node.name}'s training flag is computed at run time"
    if get["mean"] is None or get["var"] is None:
        return f"BatchNorm {node.name} has no running statistics, so it uses batch statistics"
    tensors: dict[str, torch.Tensor | None] = {}
    for k in ("mean", "var", "weight", "bias"):
        if get[k] is None:
            tensors[k] = None
            continue
        t = const(gm, get[k])
        if t is None:
            label = "running " + k if k in ("mean", "var") else k
            return (
                f"the {label} of BatchNorm {node.name} is not a constant: it is "
                f"{describe_source(get[k])}"
            )
        tensors[k] = t
    eps = get["eps"] if get["eps"] is not None else 1e-5
    if not isinstance(eps, (int, float)):
        return f"the eps of BatchNorm {node.name} is not a constant number"
    out = _bn_out(node)
    if isinstance(out, str):
        return out
    # mean and var were checked above to be given and constant
    mean, var = cast(torch.Tensor, tensors["mean"]), cast(torch.Tensor, tensors["var"])
    return BatchNormParts(node, out, mean, var, float(eps), tensors["weight"], tensors["bias"])


# --------------------------------------------------------------------------- folding


def fold_affine(
    w: Weighted, scale: torch.Tensor, shift: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Weight and bias of `w` followed by y * scale + shift, per output channel.

    `scale` has one value per output channel (or one for all); `shift` likewise, or
    None for no shift, in which case a bias-free op stays bias-free. Computed in
    float64 and cast back, so the fold adds no more than one rounding per weight.
    """
    scale = scale.detach().double().reshape(-1).expand(w.out_channels)
    weight = w.weight.detach().double()
    if w.transposed:
        # weight: [C_in, C_out / groups, *k]; output channel = group * (C_out/groups) + j
        g = w.groups
        grouped = weight.reshape(g, weight.shape[0] // g, *weight.shape[1:])
        weight = (grouped * scale.reshape(g, 1, -1, *[1] * (weight.dim() - 2))).reshape(
            weight.shape
        )
    else:
        weight = weight * scale.reshape(-1, *[1] * (weight.dim() - 1))
    weight = weight.to(w.weight.dtype).contiguous()
    if w.bias is None and shift is None:
        return weight, None
    if w.bias is None:
        bias = torch.zeros(w.out_channels, dtype=torch.float64, device=scale.device)
        bias_dtype = w.weight.dtype
    else:
        bias, bias_dtype = w.bias.detach().double(), w.bias.dtype
    bias = bias * scale
    if shift is not None:
        bias = bias + shift.detach().double()
    return weight, bias.to(bias_dtype)


def zero_padding(w: Weighted, conv: fx.Node) -> tuple[int, ...] | str:
    """Explicit symmetric zero padding of a conv, or why it has none."""
    if w.padding_mode != "zeros":
        return (
            f"{conv.name} pads with padding_mode={w.padding_mode!r}; the fused kernel "
            "pads with zeros only"
        )
    if not isinstance(w.padding, str):
        return tuple(w.padding)
    if w.padding == "valid":
        return (0,) * (w.weight.dim() - 2)
    total = [d * (k - 1) for d, k in zip(w.dilation, w.weight.shape[2:], strict=True)]
    if any(t % 2 for t in total):
        return (
            f"{conv.name} uses padding='same' with an even kernel, which pads unevenly; "
            "the replacement pads both sides equally"
        )
    return tuple(t // 2 for t in total)
