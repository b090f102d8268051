"""Mixed-precision training for `opswap.train.prepare(..., precision=...)` (chapter 27).

- ``"float32"``: the default; nothing changes.
- ``"bf16"`` / ``"fp16"``: the prepared module's forward runs under
  ``torch.autocast(device_type, dtype)``; the parameters and their gradients stay float32
  (autocast casts a weight to the low dtype inside each matmul, and autograd sends the
  gradient back to the float32 leaf). Autocast's own policies differ by device: CUDA's
  runs softmax, log_softmax, layer_norm, group_norm and the losses in float32, the CPU's
  runs the losses in float32 but softmax and the norms in whatever dtype arrives, and
  neither touches opswap's own ops (a `torch.library` op sees the dtype it is handed). So
  `keep_float32` casts the input of every such op in the graph to float32, on every
  device alike: softmax, log_softmax, batch/layer/group/instance/RMS norms (and opswap's
  kernels of them), and the loss (cross-entropy, NLL; the fused linear cross-entropy
  instead gets its inputs in the low dtype, as a Linear would, and keeps its log-sum-exp
  and loss in float32 itself).
  These are the ops whose sums of exponentials or of squares lose what a bf16 mantissa
  (8 bits) cannot hold; their outputs are float32 and the next matmul casts them down
  again. The loss the prepared module returns is float32.
- ``"fp16"`` also needs loss scaling: fp16's smallest normal is 6e-5, and small
  gradients underflow to zero. `Prepared.scaler` is a ``torch.amp.GradScaler`` for the
  device, and ``Prepared.step(optimizer, loss)`` does the scaled backward, unscales,
  skips the optimizer's step when a gradient is inf or NaN (the scaler then halves its
  scale), and zeroes the gradients; it returns whether the step was taken.
- ``"fp8"``: the Linears whose in and out features are multiples of 16 (what the fp8
  GEMM takes) become torchao's ``Float8Linear`` (``convert_to_float8_training``), with
  per-tensor current scaling by default (torchao's ``"tensorwise"`` recipe; torchao 0.18
  no longer has delayed scaling) or ``"rowwise"``. The Float8Linear reads the model's own
  weight and bias Parameters. Only on CUDA with compute capability 8.9 or newer (Ada,
  Hopper), where fp8 matmuls exist.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import fx, nn

__all__ = [
    "FP8_RECIPES",
    "KEPT_FLOAT32",
    "PRECISIONS",
    "autocast_dtype",
    "float8_eligible",
    "float8_graph",
    "float8_linears",
    "keep_float32",
    "mixed",
    "precision_problem",
]

PRECISIONS = ("float32", "bf16", "fp16", "fp8")
FP8_RECIPES = ("tensorwise", "rowwise")
_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}

#: op kinds (opswap.graph.ops.op_kind, or the raw name of an op it does not classify)
#: whose floating input is cast to float32 under autocast
KEPT_FLOAT32 = frozenset(
    {
        "softmax",
        "log_softmax",
        "masked_softmax",
        "batch_norm",
        "layer_norm",
        "group_norm",
        "instance_norm",
        "rms_norm",
        "add_rms_norm",
        "local_response_norm",
        "cross_entropy",
        "cross_entropy_loss",
        "nll_loss",
        "nll_loss_nd",
        "nll_loss2d",
        "CrossEntropyLoss",
        "NLLLoss",
    }
)


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The dtype autocast runs matmuls in for `precision`; None for float32 and fp8."""
    return _AUTOCAST.get(precision)


def precision_problem(precision: str, device: torch.device) -> str | None:
    """Why `precision` cannot train on `device`, in one sentence; None when it can."""
    if precision not in PRECISIONS:
        return f"precision must be one of {', '.join(PRECISIONS)}; not {precision!r}."
    if precision == "fp8":
        if device.type != "cuda" or not torch.cuda.is_available():
            return (
                f"precision='fp8' trains only on a CUDA GPU of compute capability 8.9 or newer "
                f"(Ada, Hopper), and the model is on {device.type}; use 'bf16' there."
            )
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return (
                f"precision='fp8' needs compute capability 8.9 or newer (Ada, Hopper), and "
                f"{torch.cuda.get_device_name(device)} is {major}.{minor}; use 'bf16' there."
            )
        try:
            import torchao.float8  # noqa: F401
        except ImportError:
            return "precision='fp8' needs torchao (pip install torchao); it is not installed."
    return None


@contextmanager
def mixed(precision: str, device_type: str) -> Iterator[None]:
    """Autocast for bf16/fp16, nothing for float32 and fp8 (whose Linears cast themselves)."""
    dtype = autocast_dtype(precision)
    ctx: Any = torch.autocast(device_type, dtype=dtype) if dtype is not None else nullcontext()
    with ctx:
        yield


def to_float32(x: Any) -> Any:
    """`x` as float32 if it is a lower-precision floating tensor; anything else as it is."""
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float32:
        if x.dtype != torch.float64:
            return x.float()
    return x


def _kind(node: fx.Node) -> str:
    from opswap.graph.ops import op_kind, raw_name

    kind = op_kind(node)
    if kind.startswith("unknown:"):
        kind = kind[len("unknown:") :]
    return kind if kind in KEPT_FLOAT32 else raw_name(node)


def to_low(x: Any, dtype: torch.dtype) -> Any:
    """`x` in autocast's `dtype` if it is a float32 tensor; anything else as it is."""
    if isinstance(x, torch.Tensor) and x.dtype == torch.float32:
        return x.to(dtype)
    return x


def _fused_head(node: fx.Node) -> bool:
    from opswap.train.losses import linear_cross_entropy

    return node.op == "call_function" and node.target is linear_cross_entropy


def keep_float32(gm: fx.GraphModule, low: torch.dtype | None = None) -> list[str]:
    """Cast the input of each op of KEPT_FLOAT32 in `gm` to float32 (a `to_float32` node
    before it; in place, the graph recompiled); returns the names of the nodes kept.

    The fused linear cross-entropy (opswap.train.losses) keeps its log-sum-exp and loss in
    float32 itself, and its GEMMs need one dtype: with `low` (autocast's dtype) its hidden
    states, weight and bias are cast to `low` instead, as autocast would a Linear's."""
    kept: list[str] = []
    for node in list(gm.graph.nodes):
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        if node.target in (to_float32, to_low, operator.getitem):
            continue
        if low is not None and _fused_head(node):
            _head_to_low(gm, node, low)
            kept.append(node.name)
            continue
        if _kind(node) not in KEPT_FLOAT32 or not node.args:
            continue
        first = node.args[0]
        if not isinstance(first, fx.Node):
            continue
        with gm.graph.inserting_before(node):
            cast = gm.graph.call_function(to_float32, (first,))
        node.args = (cast, *node.args[1:])
        kept.append(node.name)
    if kept:
        gm.graph.lint()
        gm.recompile()
    return kept


def _head_to_low(gm: fx.GraphModule, node: fx.Node, low: torch.dtype) -> None:
    args = list(node.args)
    kwargs = dict(node.kwargs)
    with gm.graph.inserting_before(node):
        for i in (0, 1, 3):
            if i < len(args) and isinstance(args[i], fx.Node):
                args[i] = gm.graph.call_function(to_low, (args[i], low))
        for key in ("hidden", "weight", "bias"):
            if isinstance(kwargs.get(key), fx.Node):
                kwargs[key] = gm.graph.call_function(to_low, (kwargs[key], low))
    node.args, node.kwargs = tuple(args), kwargs


def float8_eligible(module: nn.Module) -> bool:
    """Whether `module` is an nn.Linear the fp8 GEMM takes: in and out features both
    multiples of 16."""
    return (
        isinstance(module, nn.Linear)
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def float8_linears(module: nn.Module, recipe: str = "tensorwise") -> list[str]:
    """Swap, in place, the eligible Linears of `module` for torchao's Float8Linear (the same
    weight and bias Parameters) with `recipe`'s scaling; returns their names. Builds on any
    device; it is `prepare` that refuses to train fp8 off an fp8 GPU."""
    if recipe not in FP8_RECIPES:
        raise ValueError(f"fp8 recipe must be one of {', '.join(FP8_RECIPES)}; not {recipe!r}.")
    if isinstance(module, nn.Linear):
        raise ValueError("float8_linears swaps the Linears inside a module; pass their parent.")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    names: list[str] = []

    def take(mod: nn.Module, fqn: str) -> bool:  # torchao asks of each nn.Linear only
        ok = float8_eligible(mod) and type(mod) is nn.Linear
        if ok:
            names.append(fqn)
        return ok

    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(module, module_filter_fn=take, config=config)
    return names


def float8_graph(gm: fx.GraphModule, recipe: str = "tensorwise") -> list[str]:
    """The eligible Linears of a captured graph as Float8Linear (in place): the nn.Linear
    submodules a symbolic trace leaves, and the `linear(x, weight, bias)` calls of an
    exported graph whose weight is a Parameter, each becoming a Float8Linear submodule
    that reads that same Parameter (and bias). Returns what was converted."""
    from opswap.graph.ops import attr_tensor, raw_name

    done = float8_linears(gm, recipe)
    shells = nn.Module()  # one nn.Linear per functional linear, holding the graph's Parameters
    sites: dict[str, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or raw_name(node) != "linear" or len(node.args) < 2:
            continue
        weight = attr_tensor(gm, node.args[1])
        bias_arg = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        bias = attr_tensor(gm, bias_arg) if bias_arg is not None else None
        if not isinstance(weight, nn.Parameter) or weight.dim() != 2 or node.kwargs:
            continue
        if bias_arg is not None and not isinstance(bias, nn.Parameter):
            continue
        out_f, in_f = weight.shape
        shell = nn.Linear(in_f, out_f, bias=bias is not None, device="meta")
        shell.weight = weight
        if isinstance(bias, nn.Parameter):
            shell.bias = bias
        name = f"fp8_{node.name}"
        shells.add_module(name, shell)
        sites[name] = node
    swapped = set(float8_linears(shells, recipe)) if sites else set()
    for name in swapped:
        node = sites[name]
        gm.add_submodule(name, shells.get_submodule(name))
        with gm.graph.inserting_before(node):
            new = gm.graph.call_module(name, (node.args[0],))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        done.append(name)
    if swapped:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return done
