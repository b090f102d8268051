"""Which ops of a program an edge delegate takes, and why each other op stays outside.

    from opswap.targets.edge import delegation
    d = delegation(exported_program, "xnnpack")      # or an ExecuTorch edge program
    d.compute_share, d.time_share, d.outside          # the share in ops and in time

Two readings, said in `Delegation.basis`:

- "profile": a torch.export program (ATen ops) read against the profile's op set and
  conditions (targets.edge.profiles); every op the profile does not take is named with
  its reason.
- "lowered": an ExecuTorch program after `to_edge_transform_and_lower` (its graph calls
  `executorch_call_delegate`): the ops inside each delegate call are counted as taken,
  the ops left on the portable kernels are checked against the profile for the reason.

Time: `time_ops(program, inputs)` runs the program's graph node by node in eager PyTorch
on this CPU and times each op (ExecuTorch's ETDump needs a runtime built with event
tracing, which the pip wheel is not); the share of time is then the share of that eager
time. `Delegation.timing` says which.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from opswap.errors import TargetError
from opswap.targets.edge.profiles import LAYOUT_OPS, EdgeProfile, get_profile

_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.bool: "bool",
}


def op_name(node: fx.Node) -> str:
    """The op a call_function node calls, as profiles name it: the overload packet's name
    with an edge `_copy` suffix dropped (`view_copy` -> `view`)."""
    target = node.target
    packet = getattr(target, "_overloadpacket", None)
    raw = getattr(packet, "__name__", None) or getattr(target, "__name__", str(target))
    name = str(raw).rsplit(".", 1)[-1]
    if name.endswith("_copy") and name not in ("_to_dim_order_copy",):
        name = name[: -len("_copy")]
    return "_to_dim_order" if name == "_to_dim_order_copy" else name


def _val(x: object) -> torch.Tensor | None:
    v = x.meta.get("val") if isinstance(x, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _arg(node: fx.Node, i: int, default: Any = None) -> Any:
    return node.args[i] if len(node.args) > i else default


def _mean_4d_inner(node: fx.Node) -> str | None:
    x = _val(_arg(node, 0))
    if x is None:
        return "the input's shape is unknown"
    dims = _arg(node, 1) or []
    rank = x.dim()
    dims = sorted(d % rank for d in dims) if rank else []
    keep = bool(_arg(node, 2, node.kwargs.get("keepdim", False)))
    if rank != 4 or dims != [2, 3] or not keep:
        return (
            f"mean over dims {dims} of a rank-{rank} tensor (keepdim={keep}); the delegate "
            "averages a 4-D "
            "tensor over its last two dims with keepdim (global average pooling)"
        )
    return None


def _rank_at_most_4(node: fx.Node) -> str | None:
    x = _val(_arg(node, 0))
    if x is not None and x.dim() > 4:
        return f"a rank-{x.dim()} input; the delegate takes rank 4 at most"
    return None


def _scalar_exponent(node: fx.Node) -> str | None:
    if isinstance(_arg(node, 1), fx.Node):
        return "the exponent is a tensor; the delegate takes a constant exponent"
    return None


def _rank3(node: fx.Node) -> str | None:
    x = _val(_arg(node, 0))
    if x is not None and x.dim() != 3:
        return f"a rank-{x.dim()} batched matmul; the delegate takes rank 3"
    return None


def _conv_2d(node: fx.Node) -> str | None:
    w = _val(_arg(node, 1))
    if w is not None and w.dim() != 4:
        return f"a {w.dim() - 2}-d convolution; the delegate takes 2-d ones (1-d as 2-d)"
    if _arg(node, 6, False):
        return "a transposed convolution with output padding the delegate does not take"
    return None


def _max_dim_keepdim(node: fx.Node) -> str | None:
    if not _arg(node, 2, False):
        return "max over a dim without keepdim"
    return None


#: condition key -> check(node) returning the reason it fails, or None
CONDITIONS: dict[str, Callable[[fx.Node], str | None]] = {
    "mean_4d_inner": _mean_4d_inner,
    "rank_at_most_4": _rank_at_most_4,
    "scalar_exponent": _scalar_exponent,
    "rank3": _rank3,
    "conv_2d": _conv_2d,
    "max_dim_keepdim": _max_dim_keepdim,
}


@dataclass(frozen=True)
class OpRow:
    """One op of the program: whether the delegate takes it, and why not."""

    node: str
    op: str
    compute: bool  # does arithmetic (not a view, copy, gather or constant)
    delegated: bool
    reason: str = ""
    seconds: float | None = None


@dataclass(frozen=True)
class Delegation:
    """A program read against a profile: one row per op (a delegate call counts its ops)."""

    profile: str
    basis: str  # "profile" or "lowered"
    rows: tuple[OpRow, ...]
    timing: str = "none"  # "eager CPU, per op" when rows carry seconds
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def compute(self) -> list[OpRow]:
        return [r for r in self.rows if r.compute]

    @property
    def compute_share(self) -> float:
        """The share of compute ops the delegate takes (1.0 for a program without any)."""
        rows = self.compute
        return sum(r.delegated for r in rows) / len(rows) if rows else 1.0

    @property
    def op_share(self) -> float:
        """The share of all ops, layout ops included."""
        return sum(r.delegated for r in self.rows) / len(self.rows) if self.rows else 1.0

    @property
    def time_share(self) -> float | None:
        """The share of the timed ops' eager time spent in ops the delegate takes."""
        timed = [r for r in self.rows if r.seconds is not None]
        total = sum(r.seconds or 0.0 for r in timed)
        if not timed or total <= 0:
            return None
        return sum(r.seconds or 0.0 for r in timed if r.delegated) / total

    @property
    def outside(self) -> list[OpRow]:
        return [r for r in self.rows if not r.delegated]

    def to_dict(self) -> dict[str, Any]:
        return {
            "profile": self.profile,
            "basis": self.basis,
            "timing": self.timing,
            "compute_ops": len(self.compute),
            "compute_share": round(self.compute_share, 4),
            "op_share": round(self.op_share, 4),
            "time_share": None if self.time_share is None else round(self.time_share, 4),
            "outside": [
                {"node": r.node, "op": r.op, "compute": r.compute, "why": r.reason}
                for r in self.outside
            ],
            "notes": list(self.notes),
        }

    def markdown(self) -> str:
        """The report's section: shares, then every op left outside with its reason."""
        t = self.time_share
        lines = [
            f"**{self.profile}** ({self.basis}): {self.compute_share:.0%} of "
            f"{len(self.compute)} compute ops delegated, {self.op_share:.0%} of all ops"
            + ("" if t is None else f", {t:.0%} of the time ({self.timing})"),
        ]
        if self.outside:
            lines += ["", "| op | node | compute | why outside |", "|---|---|---|---|"]
            lines += [
                f"| {r.op} | {r.node} | {'yes' if r.compute else 'no'} | {r.reason} |"
                for r in self.outside
            ]
        return "\n".join(lines)


_SKIP = {
    "getitem",
    "sym_size",
    "sym_numel",
    "sym_stride",
    "_assert_scalar",
    "sym_constrain_range_for_size",
}


def _dtype_reason(node: fx.Node, profile: EdgeProfile) -> str | None:
    v = _val(node)
    if v is None:
        return None
    name = _DTYPE_NAMES.get(v.dtype, str(v.dtype))
    if name not in profile.dtypes and node.op == "call_function":
        return f"its output is {name}; {profile.name} takes {', '.join(profile.dtypes)}"
    return None


def check_node(node: fx.Node, profile: EdgeProfile) -> str | None:
    """Why `profile` does not take `node` (a call_function of an ATen/edge op), or None."""
    op = op_name(node)
    if not profile.takes(op):
        return f"{profile.name} has no {op}"
    for key in profile.ops[op]:
        why = CONDITIONS[key](node)
        if why:
            return why
    if op not in LAYOUT_OPS or op in ("cat",):
        return _dtype_reason(node, profile)
    return None


def _graph_of(program: Any) -> fx.GraphModule:
    if hasattr(program, "exported_program"):  # an EdgeProgramManager
        program = program.exported_program()
    if hasattr(program, "graph_module"):
        return program.graph_module
    if isinstance(program, fx.GraphModule):
        return program
    raise TargetError(
        f"delegation reads a torch.export program, an ExecuTorch edge program or an FX "
        f"graph module; it was given {type(program).__name__}."
    )


def _delegate_ops(gm: fx.GraphModule, node: fx.Node) -> list[fx.Node]:
    """The op nodes inside an executorch_call_delegate's lowered module."""
    first = node.args[0] if node.args else None
    lowered = getattr(gm, str(first.target), None) if isinstance(first, fx.Node) else None
    inner = getattr(lowered, "original_module", None)
    graph = getattr(inner, "graph", None)
    if graph is None:
        return []
    return [n for n in graph.nodes if n.op == "call_function" and op_name(n) not in _SKIP]


def delegation(
    program: Any,
    profile: str | EdgeProfile,
    seconds: Mapping[str, float] | None = None,
) -> Delegation:
    """`program`'s ops read against `profile` (a name of targets.edge.PROFILES or one):
    a Delegation with a row per op. `seconds` (node name -> eager seconds, `time_ops`)
    gives the share of time."""
    prof = get_profile(profile)
    gm = _graph_of(program)
    rows: list[OpRow] = []
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and op_name(n) not in _SKIP]
    lowered = any(op_name(n) == "executorch_call_delegate" for n in calls)
    for node in calls:
        op = op_name(node)
        if op == "executorch_call_delegate":
            for inner in _delegate_ops(gm, node):
                name = op_name(inner)
                rows.append(OpRow(inner.name, name, name not in LAYOUT_OPS, True))
            continue
        why = check_node(node, prof)
        if lowered:  # the partitioner left it out: the profile's reason, else its own
            why = why or "left outside by the partitioner (a constraint of its own)"
        s = None if seconds is None else seconds.get(node.name)
        rows.append(OpRow(node.name, op, op not in LAYOUT_OPS, why is None, why or "", s))
    basis = "lowered" if lowered else "profile"
    timing = "eager CPU, per op" if seconds else "none"
    notes = prof.notes + (() if prof.runs_here else ("this machine cannot run the delegate",))
    return Delegation(prof.name, basis, tuple(rows), timing, notes)


def time_ops(program: Any, inputs: tuple, repeat: int = 3) -> dict[str, float]:
    """Seconds each call_function node of `program`'s graph takes in eager PyTorch on this
    CPU (the least of `repeat` runs), by node name: the time basis of a Delegation."""
    gm = _graph_of(program)
    if hasattr(program, "module") and not isinstance(program, fx.GraphModule):
        gm = program.module()
    out: dict[str, float] = {}

    class _Timed(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            if n.op != "call_function":
                return super().run_node(n)
            t0 = time.perf_counter()
            r = super().run_node(n)
            dt = time.perf_counter() - t0
            out[n.name] = min(out.get(n.name, dt), dt)
            return r

    with torch.no_grad():
        for _ in range(repeat):
            _Timed(gm).run(*inputs)
    return out
