"""What precision.bf16 and precision.fp16 share: one float32 compute-heavy op (Linear,
Conv1d/2d/3d, matmul, bmm, baddbmm, addmm) run in a 16-bit float type, everything around it
left in float32.

At a site the weights are converted once and held in half as buffers, the activations are
cast down just before the op and its output cast back to float32 just after it, so the ops
that lose most in half (softmax, the norms, reductions, exp and log, the loss) keep
reading and writing float32. The rewrite also removes the round trip between two half
sites: when the op's input comes from an earlier site's cast back to float32 through ops
that give the same bits in half as in float32 (relu, max pooling, dropout in eval, views,
transposes: each returns one of its input's values unchanged, or a zero), that chain is
rewired to read the earlier site's half output and the two casts go. It is done inside
the rewrite rather than by a rule of its own so that it follows the sites a plan takes
exactly: a site the planner skips or a rollback excludes leaves its casts, and no third
rule has to be named for the cleanup to happen.

The prediction prices the op at the target's half rate against its float32 rate, plus the
casts it adds. A CPU without native 16-bit float arithmetic (this AVX2 machine) runs a
half GEMM by widening to float32 in software: there the op is priced at the float32 rate
with float32 traffic, so the casts make every site slower and the planner skips it.
"""

from __future__ import annotations

import functools
from typing import Any, cast

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from opswap.cost import NodeCost, node_cost
from opswap.graph.ops import attr_tensor, module_of, op_kind, raw_name
from opswap.graph.shapes import amax, info
from opswap.rules._cost import op_time
from opswap.rules._edits import call, drop_dead_attrs, install_module, new_const
from opswap.rules._weights import Weighted, weighted
from opswap.rules.base import Estimate, Found, Refused
from opswap.targets.base import Target

#: the op kinds a half site starts from: the compute-heavy ones
ANCHORS = ("linear", "conv", "matmul", "addmm")

FP16_MAX = 65504.0  # the largest finite float16
#: float16 is refused where a value at the example comes within this factor of its limit:
#: the example is one sample, and other inputs may run larger
FP16_HEADROOM = 4.0

#: ops that return one of their input's values unchanged (or a zero): the same bits in half
#: as in float32, so a chain of them between two half sites may run in half
EXACT_IN_HALF = frozenset(
    {
        "relu",
        "max_pool",
        "adaptive_max_pool",
        "dropout",
        "identity",
        "view",
        "reshape",
        "flatten",
        "permute",
        "transpose",
        "contiguous",
        "squeeze",
        "expand",
    }
)

_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_HALVES = (torch.bfloat16, torch.float16)
#: the CPU flags that say a core computes in this type natively (Linux /proc/cpuinfo)
_CPU_FLAGS = {
    torch.bfloat16: ("avx512_bf16", "amx_bf16"),
    torch.float16: ("avx512_fp16", "amx_fp16"),
}


def _dtype_name(dtype: torch.dtype) -> str:
    return _NAMES.get(dtype, str(dtype).removeprefix("torch."))


# --------------------------------------------------------------------------- the modules


class HalfLinear(nn.Module):
    """A Linear whose weight and bias are buffers in a 16-bit float type; it takes and
    returns that type (the casts around it are graph nodes, so that the rewrite of the
    next site can remove them)."""

    opswap_kind = "linear"
    weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.detach().to(dtype))
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, dtype={_dtype_name(self.weight.dtype)}"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


_CONV_FN = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


class HalfConv(nn.Module):
    """A Conv1d/2d/3d (zero padding) with its weight and bias as buffers in a 16-bit float
    type; it takes and returns that type."""

    opswap_kind = "conv"
    weight: torch.Tensor
    bias: torch.Tensor | None
    padding: Any  # a tuple of ints, or "same" / "valid"

    def __init__(self, w: Weighted, dtype: torch.dtype):
        super().__init__()
        self.dims = w.weight.dim() - 2
        self.stride, self.padding, self.dilation, self.groups = (
            tuple(w.stride),
            w.padding if isinstance(w.padding, str) else tuple(w.padding),
            tuple(w.dilation),
            int(w.groups),
        )
        self.register_buffer("weight", w.weight.detach().to(dtype))
        self.register_buffer("bias", None if w.bias is None else w.bias.detach().to(dtype))

    def extra_repr(self) -> str:
        return (
            f"{self.dims}d, weight={tuple(self.weight.shape)}, stride={self.stride}, "
            f"padding={self.padding}, groups={self.groups}, dtype={_dtype_name(self.weight.dtype)}"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fn = _CONV_FN[self.dims]
        return fn(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


_HALF_MODULES = (HalfLinear, HalfConv)


# --------------------------------------------------------------------------- casts and chains


def cast_dtype(node: fx.Node) -> torch.dtype | None:
    """The dtype a pure dtype conversion converts to (`x.to(dtype)`, `x.float()`,
    `aten.to.dtype`, `aten._to_copy(x, dtype=...)`), or None when the node is not one (a
    `to` that also moves to another device is not)."""
    if op_kind(node) != "to" or node.op not in ("call_function", "call_method"):
        return None
    name = raw_name(node)
    fixed = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16}
    if name in fixed:
        return fixed[name] if len(node.args) == 1 and not node.kwargs else None
    found = [a for a in node.args[1:] if isinstance(a, torch.dtype)]
    others = [a for a in node.args[1:] if not isinstance(a, (torch.dtype, bool))]
    kw = node.kwargs.get("dtype")
    if isinstance(kw, torch.dtype):
        found.append(kw)
    allowed = {"dtype", "non_blocking", "copy", "memory_format"}
    if len(found) != 1 or others or set(node.kwargs) - allowed:
        return None
    return found[0]


def _half_of(node: fx.Node) -> torch.dtype | None:
    """The half type `node` computes in: marked by a rewrite of this pass, else its shape."""
    mark = node.meta.get("opswap_half")
    if mark is not None:
        return getattr(torch, mark)
    i = info(node)
    return i.dtype if i is not None and i.dtype in _HALVES else None


def _dropout_is_identity(node: fx.Node) -> bool:
    if node.op == "call_module":
        return not getattr(module_of(node), "training", True)
    if raw_name(node) == "dropout":  # F.dropout(x, p, training) / aten.dropout(x, p, train)
        flag = node.args[2] if len(node.args) > 2 else node.kwargs.get("training")
        flag = node.kwargs.get("train", flag)
        return flag is False
    return False


def _exact_step(node: fx.Node) -> bool:
    """Whether `node` is a one-input op that gives the same bits in half as in float32."""
    kind = op_kind(node)
    if kind not in EXACT_IN_HALF or node.op == "placeholder":
        return False
    if kind == "dropout" and not _dropout_is_identity(node):
        return False
    if kind in ("max_pool", "adaptive_max_pool") and len(node.users) != 1:
        return False
    x = node.args[0] if node.args else None
    if not isinstance(x, fx.Node):
        return False
    tensors = [a for a in node.all_input_nodes if a is not x and info(a) is not None]
    return not tensors  # size arguments are fine, a second tensor is not


class Chain:
    """A way for one activation of a site to arrive in half without a cast: `source` is an
    earlier site's half output, `cast` its conversion back to float32, `steps` the exact
    ops between that and the site (in order; empty when the site reads the cast)."""

    def __init__(self, source: fx.Node, cast: fx.Node, steps: list[fx.Node]):
        self.source, self.cast, self.steps = source, cast, steps


def chain_to_half(x: fx.Node, reader: fx.Node, dtype: torch.dtype) -> Chain | None:
    """The chain by which `x` (read by `reader` alone) comes from a cast back to float32 of a
    value already in `dtype`, through ops exact in half each read only by the next; None
    when there is none."""
    steps: list[fx.Node] = []
    cur, nxt = x, reader
    for _ in range(32):
        if set(cur.users) != {nxt}:
            return None
        if cast_dtype(cur) == torch.float32:
            src = cur.args[0] if cur.args else None
            if isinstance(src, fx.Node) and _half_of(src) == dtype:
                return Chain(src, cur, steps[::-1])
            return None
        if not _exact_step(cur):
            return None
        steps.append(cur)
        nxt, cur = cur, cast(fx.Node, cur.args[0])  # _exact_step: its first arg is a node
    return None


# --------------------------------------------------------------------------- check


def _tensor_inputs(gm: fx.GraphModule, node: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """(constants, activations) among the op's tensor arguments: get_attr tensors (weights)
    and the computed values."""
    consts, acts = [], []
    for a in node.all_input_nodes:
        if a.op == "get_attr" and attr_tensor(gm, a) is not None:
            consts.append(a)
        elif info(a) is not None:
            acts.append(a)
    return consts, acts


def check_half(gm: fx.GraphModule, node: fx.Node, dtype: torch.dtype) -> Found | Refused | None:
    """The half site at `node`, or why not."""
    name = _dtype_name(dtype)
    mod = module_of(node)
    if isinstance(mod, _HALF_MODULES) or node.meta.get("opswap_half"):
        return None
    if node.op == "call_module" and op_kind(node) in ("linear", "conv"):
        if getattr(mod, "opswap_kind", None):
            return None  # a module another opswap rule installed (Int8Linear, ...)
    out = info(node)
    if out is None:
        return Refused(f"{node.name}'s output shape and dtype are not known")
    if out.dtype in _HALVES:
        return Refused(f"{node.name} already computes in {_dtype_name(out.dtype)}")
    if out.dtype != torch.float32:
        return Refused(
            f"{node.name} computes in {_dtype_name(out.dtype)}; {name} is offered for float32 ops"
        )
    w: Weighted | None = None
    if node.op == "call_module":
        got = weighted(gm, node)
        if isinstance(got, str):
            return Refused(got)
        w = got
        if w.transposed:
            return None
        if w.padding_mode != "zeros":
            return Refused(
                f"{node.name} pads with {w.padding_mode!r}; the {name} convolution is "
                "written for zero padding"
            )
        weights = [w.weight] + ([w.bias] if w.bias is not None else [])
        acts = [a for a in node.all_input_nodes if info(a) is not None]
    else:
        consts, acts = _tensor_inputs(gm, node)
        weights = [t for t in (attr_tensor(gm, c) for c in consts) if t is not None]
    for t in weights:
        if t.dtype in _HALVES:
            return Refused(f"{node.name}'s weight is already {_dtype_name(t.dtype)}")
        if t.dtype != torch.float32:
            return Refused(
                f"{node.name}'s weight is {_dtype_name(t.dtype)}; {name} is offered for "
                "float32 layers"
            )
    for a in acts:
        ai = info(a)
        if ai is not None and ai.dtype != torch.float32 and _half_of(a) is None:
            return Refused(
                f"{node.name} reads {a.name}, a {_dtype_name(ai.dtype)} tensor; {name} is "
                "offered for float32 ops"
            )
    if dtype == torch.float16:
        why = _fp16_range(node, acts, weights)
        if why:
            return Refused(why)
    chains = {}
    for a in acts:
        c = chain_to_half(a, node, dtype)
        if c is not None:
            chains[a] = c
    extra = [n for c in chains.values() for n in (c.cast, *c.steps)]
    return Found(
        (*extra, node),
        f"{node.name} ({op_kind(node)}) in {name}, its inputs and output cast at the edges"
        + (f"; {len(chains)} cast pair(s) to the previous half site removed" if chains else ""),
        dict(w=w, acts=acts, chains=chains, dtype=dtype),
        key=node.name,
        kept=extra,
        record=dict(op=node.name, dtype=name, casts_removed=len(chains)),
    )


def _fp16_range(node: fx.Node, acts: list[fx.Node], weights: list[torch.Tensor]) -> str | None:
    """Why float16 would overflow at this op, from the values seen at the example."""
    limit = FP16_MAX / FP16_HEADROOM
    seen = [(f"{node.name}'s output", amax(node))]
    seen += [(f"its input {a.name}", amax(a)) for a in acts]
    seen += [("its weight", float(t.detach().abs().amax()) if t.numel() else 0.0) for t in weights]
    for what, value in seen:
        if value is not None and value > limit:
            return (
                f"{what} reaches {value:.3g} at the example, beyond float16's range with "
                f"{FP16_HEADROOM:g}x headroom ({FP16_MAX:g} / {FP16_HEADROOM:g}); "
                "precision.bf16 keeps float32's range"
            )
    return None


# --------------------------------------------------------------------------- rewrite


def _cast(gm: fx.GraphModule, like: fx.Node, x: fx.Node, dtype: torch.dtype) -> fx.Node:
    with gm.graph.inserting_before(like):
        return call(gm.graph, like, "to.dtype", (x, dtype))


def rewrite_half(gm: fx.GraphModule, found: Found) -> None:
    node, dtype = found.nodes[-1], found["dtype"]
    chains: dict[fx.Node, Chain] = found["chains"]
    w: Weighted | None = found["w"]
    if w is not None:  # a Linear or Conv module: the same call, on a module holding half
        mod = (
            HalfLinear(w.weight, w.bias, dtype) if op_kind(node) == "linear" else HalfConv(w, dtype)
        )
        node = install_module(gm, node, mod, str(node.target))
    else:
        consts, _ = _tensor_inputs(gm, node)
        for c in consts:
            t = attr_tensor(gm, c)
            assert t is not None  # _tensor_inputs keeps get_attrs with a tensor
            half = new_const(
                gm, node, f"{c.target}_{_dtype_name(dtype)}", t.detach().to(dtype), False
            )
            node.replace_input_with(c, half)
        drop_dead_attrs(gm, consts)
    for a in found["acts"]:
        ch = chains.get(a)
        if ch is None:
            node.replace_input_with(a, _cast(gm, node, a, dtype))
            continue
        # the earlier site's half output feeds the exact ops directly: both casts go
        (ch.steps[0] if ch.steps else node).replace_input_with(ch.cast, ch.source)
        if not ch.cast.users:
            gm.graph.erase_node(ch.cast)
    with gm.graph.inserting_after(node):
        back = call(gm.graph, node, "to.dtype", (node, torch.float32))
    back.meta.update({k: v for k, v in node.meta.items() if k != "opswap_half"})
    node.replace_all_uses_with(back, delete_user_cb=lambda u: u is not back)
    node.meta["opswap_half"] = _dtype_name(dtype)


# --------------------------------------------------------------------------- predict


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def native(target: Target, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether `target` computes in `dtype` natively, and what says so. A profile that gives
    the type its own rate does; this machine's measured `cpu` profile gives none, so its
    CPU flags decide (avx512_bf16 / amx_bf16, avx512_fp16 / amx_fp16)."""
    name = _dtype_name(dtype)
    if name in getattr(target, "peak_flops", {}):
        return True, f"{target.name}'s {name} rate"
    if getattr(target, "kind", "") == "cpu" and getattr(target, "name", "") == "cpu":
        flags = _CPU_FLAGS[dtype]
        have = [f for f in flags if f in _cpu_flags()]
        if have:
            return True, f"this CPU has {have[0]} (the float32 rate assumed: none is measured)"
        return False, (
            f"this CPU has no native {name} arithmetic (no {' or '.join(flags)}): the GEMM "
            "widens to float32 in software"
        )
    return False, f"{getattr(target, 'name', 'the target')} gives no {name} rate"


def predict_half(gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
    node, dtype = found.nodes[-1], found["dtype"]
    out = info(node)
    if out is None:
        return Estimate(note="shape unknown: no prediction")
    half = 2
    casts = [NodeCost(0, out.numel * (half + 4))]  # the output back to float32
    for a in found["acts"]:
        ai = info(a)
        if a not in found["chains"] and ai is not None:
            casts.append(NodeCost(0, ai.numel * (4 + half)))
    before = node_cost(node)
    t_before = op_time(before, target, "float32")
    t_casts = sum(op_time(c, target, "float32") for c in casts)
    is_native, why = native(target, dtype)
    name = _dtype_name(dtype)
    if is_native:
        op = NodeCost(before.flops, before.bytes // 2)
        t_op = op_time(op, target, name)
        saved_bytes = before.bytes - op.bytes - sum(c.bytes for c in casts)
    else:
        t_op, saved_bytes = t_before, -sum(c.bytes for c in casts)
    return Estimate(
        0.0,
        float(saved_bytes),
        t_before - (t_op + t_casts),
        f"{name} at {why}, half the bytes, plus {len(casts)} cast(s)"
        if is_native
        else f"{why}: priced at the float32 rate, plus {len(casts)} cast(s)",
    )
