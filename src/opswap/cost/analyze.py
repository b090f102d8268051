"""Per-op cost of a captured model on a target: FLOPs, bytes, roofline bound and time share.

    >>> a = analyze(capture(model, (x,)), "h100")
    >>> a.bottlenecks(3)
    ['layer1.0.conv1 (Conv2d) is compute-bound: 37% of the estimated time, ...']
    >>> render(a, rich.console.Console())

The time estimate is the roofline one, op by op: max(flops / peak, bytes /
bandwidth), plus the target's per-op dispatch cost (measured for the CPU, smaller for a view
that runs no kernel; on a GPU the kernel launch too), summed over ops run one after another with no fusion and
no cache reuse. It ranks ops; the report shows how far it is from measured time.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from opswap.cost._nodes import compute_dtype, tensor_inputs
from opswap.cost.node import node_cost
from opswap.cost.roofline import roofline_point
from opswap.cost.units import human, human_time, human_unit
from opswap.graph.ops import category, compute_nodes, module_of, op_kind
from opswap.graph.shapes import infos
from opswap.targets import Target, dtype_key, get_target

_TENSOR_CORE_CATEGORIES = ("conv", "matmul", "attention", "rnn")

#: (row, target) -> the clause of a bottleneck sentence that names the rules relieving it
Advice = Callable[["OpRow", Target], str]


@dataclass
class OpRow:
    """One compute node of the graph, costed."""

    name: str  # FX node name, unique in the graph
    op: str  # what it calls: 'Conv2d', 'aten.linear', 'F.relu', 'Tensor.view'
    kind: str  # opswap.graph.ops.op_kind
    category: str  # opswap.graph.ops.CATEGORIES
    module: str  # module path it belongs to ('' for the root)
    label: str  # how to name it to a person: module path, or the node name
    input_shapes: list[tuple[int, ...]]
    output_shapes: list[tuple[int, ...]]
    dtype: str
    flops: int
    bytes: int
    read: int
    written: int
    intensity: float  # FLOP/byte
    bound: str  # 'compute' | 'memory' | 'none' (costs nothing)
    est_time_s: float
    share: float = 0.0  # of the model's estimated time
    note: str = ""


@dataclass
class CategorySummary:
    category: str
    count: int = 0
    flops: int = 0
    bytes: int = 0
    est_time_s: float = 0.0
    share: float = 0.0


@dataclass
class Analysis:
    model: str
    target: Target
    method: str  # how the graph was captured: 'fx' | 'export'
    rows: list[OpRow]
    categories: dict[str, CategorySummary]
    total_flops: int
    total_bytes: int
    est_time_s: float
    notes: list[str] = field(default_factory=list)
    #: the costed graph, which the advice matches rules on (None: advice by op category only)
    gm: fx.GraphModule | None = field(default=None, repr=False, compare=False)
    #: what names the rules that relieve a row's bottleneck (report.advice.advised sets it)
    advice: Advice | None = field(default=None, repr=False, compare=False)

    @property
    def intensity(self) -> float:
        return self.total_flops / self.total_bytes if self.total_bytes else 0.0

    def row(self, name: str) -> OpRow:
        for r in self.rows:
            if r.name == name or r.label == name:
                return r
        raise KeyError(name)

    def top(self, n: int = 5) -> list[OpRow]:
        """The n ops with the largest estimated time."""
        costed = [r for r in self.rows if r.est_time_s > 0]
        return sorted(costed, key=lambda r: r.est_time_s, reverse=True)[:n]

    def bottlenecks(self, n: int = 5) -> list[str]:
        """One sentence for each of the n costliest ops: what bounds it and what would help
        (with `advice`, the rules that would do it)."""
        return [_sentence(r, self.target, self.advice) for r in self.top(n)]

    def to_json(self) -> dict:
        return {
            "model": self.model,
            "target": self.target.name,
            "target_info": self.target.to_dict(),
            "method": self.method,
            "total_flops": self.total_flops,
            "total_bytes": self.total_bytes,
            "est_time_s": self.est_time_s,
            "ops": [_row_json(r) for r in self.rows],
            "categories": {
                c.category: {
                    "count": c.count,
                    "flops": c.flops,
                    "bytes": c.bytes,
                    "est_time_s": c.est_time_s,
                    "share": c.share,
                }
                for c in self.categories.values()
            },
            "bottlenecks": self.bottlenecks(),
            "notes": list(self.notes),
        }


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _row_json(r: OpRow) -> dict:
    return {
        "name": r.name,
        "op": r.op,
        "kind": r.kind,
        "category": r.category,
        "module": r.module,
        "label": r.label,
        "input_shapes": [list(s) for s in r.input_shapes],
        "output_shapes": [list(s) for s in r.output_shapes],
        "dtype": r.dtype,
        "flops": r.flops,
        "bytes": r.bytes,
        "read": r.read,
        "written": r.written,
        "intensity": _finite(r.intensity),
        "bound": r.bound,
        "est_time_s": r.est_time_s,
        "share": r.share,
        "note": r.note,
    }


# --------------------------------------------------------------------------- naming


def op_label(node: fx.Node) -> str:
    """The human name of what a node calls: 'Conv2d', 'aten.linear', 'F.relu', 'Tensor.view'."""
    t = node.target
    if node.op == "call_module":
        return type(module_of(node)).__name__
    if node.op == "call_method":
        return f"Tensor.{t}"
    if isinstance(t, torch._ops.OpOverload):
        ns, name = t._schema.name.split("::", 1)
        return f"{ns}.{name}"
    name = getattr(t, "__name__", str(t))
    mod = getattr(t, "__module__", None) or ""
    if mod.startswith("torch.nn.functional"):
        return f"F.{name}"
    if mod == "_operator" or t in vars(operator).values():
        return f"operator.{name}"
    if mod.startswith("torch"):
        return f"torch.{name}"
    return f"{mod}.{name}" if mod else name


def module_path(node: fx.Node) -> str:
    """Module path of a node: the call_module target, else the innermost nn_module_stack entry."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1]
        path = path[0] if isinstance(path, tuple) else path
        return str(path)
    return ""


# --------------------------------------------------------------------------- analyze


def analyze(
    captured, target: Target | str = "cpu", *, model_name: str | None = None, tf32: bool = False
) -> Analysis:
    """Cost every compute node of a captured model (Captured or shape-propagated GraphModule).

    `tf32=True` rates float32 conv / matmul / attention / RNN at the target's TF32
    tensor-core peak (PyTorch's allow_tf32 setting) instead of its FP32 one.
    """
    gm = getattr(captured, "gm", captured)
    if not isinstance(gm, fx.GraphModule):
        raise TypeError(
            f"analyze() takes a Captured or an fx.GraphModule, got {type(gm).__name__}."
        )
    _ensure_shapes(captured, gm)
    tgt = get_target(target)
    method = getattr(captured, "method", "fx")
    model = model_name or _model_name(gm)
    rows = [_row(n, tgt, tf32) for n in compute_nodes(gm)]
    paths = Counter(r.module for r in rows if r.bytes or r.flops)
    for r in rows:
        if not r.module:
            r.label = r.name
        elif paths[r.module] > 1 or not (r.bytes or r.flops):
            r.label = f"{r.module}:{r.name}"
    total_time = sum(r.est_time_s for r in rows)
    categories: dict[str, CategorySummary] = {}
    for r in rows:
        r.share = r.est_time_s / total_time if total_time else 0.0
        c = categories.setdefault(r.category, CategorySummary(r.category))
        c.count += 1
        c.flops += r.flops
        c.bytes += r.bytes
        c.est_time_s += r.est_time_s
    for c in categories.values():
        c.share = c.est_time_s / total_time if total_time else 0.0
    ordered = dict(sorted(categories.items(), key=lambda kv: (-kv[1].est_time_s, kv[0])))
    notes = list(getattr(captured, "notes", []) or [])
    unrated = sorted({r.dtype for r in rows if r.flops and r.dtype not in tgt.peak_flops})
    if unrated:
        notes.append(
            f"{tgt.name} has no peak figure for {', '.join(unrated)}; those ops are "
            "rated at its float32 peak."
        )
    return Analysis(
        model=model,
        target=tgt,
        method=method,
        rows=rows,
        categories=ordered,
        total_flops=sum(r.flops for r in rows),
        total_bytes=sum(r.bytes for r in rows),
        est_time_s=total_time,
        notes=notes,
        gm=gm,
    )


def _ensure_shapes(captured, gm: fx.GraphModule) -> None:
    """Costs come from shapes: re-propagate a Captured whose graph lost them, else say so."""
    if any("tensor_meta" in n.meta or "val" in n.meta for n in gm.graph.nodes):
        return
    if hasattr(captured, "recapture_shapes"):
        captured.recapture_shapes()
        return
    raise ValueError(
        "The graph has no shapes: run opswap.graph.shapes.propagate(gm, example_inputs) "
        "first, or pass the Captured object from opswap.graph.capture.capture()."
    )


def _model_name(gm: fx.GraphModule) -> str:
    cls = type(gm).__name__
    return "model" if cls == "GraphModule" else cls


def dispatches(node: fx.Node) -> bool:
    """False for nodes that are Python, not a dispatched op: taking one output of a
    multi-output op (a tuple's getitem) and reading a size."""
    if op_kind(node) == "size":
        return False
    if node.op == "call_function" and node.target is operator.getitem and node.args:
        src = node.args[0]
        meta = (
            src.meta.get("val", src.meta.get("tensor_meta")) if isinstance(src, fx.Node) else None
        )
        return not isinstance(meta, (tuple, list))
    return True


def _row(node: fx.Node, target: Target, tf32: bool) -> OpRow:
    cost = node_cost(node)
    cat = category(node)
    dtype = dtype_key(compute_dtype(node))
    rate_key = dtype
    if (
        tf32
        and dtype == "float32"
        and cat in _TENSOR_CORE_CATEGORIES
        and "tf32" in target.peak_flops
    ):
        rate_key = "tf32"
    point = roofline_point(cost.flops, cost.bytes, target, rate_key)
    ins = [ti.shape for n, ti in tensor_inputs(node) if n.op != "get_attr"]
    return OpRow(
        name=node.name,
        op=op_label(node),
        kind=op_kind(node),
        category=cat,
        module=module_path(node),
        label=module_path(node) or node.name,
        input_shapes=ins,
        output_shapes=[o.shape for o in infos(node)],
        dtype=dtype,
        flops=cost.flops,
        bytes=cost.bytes,
        read=cost.read,
        written=cost.written,
        intensity=point.intensity,
        bound=point.bound,
        est_time_s=point.time_s
        + (target.op_overhead(bool(cost.flops or cost.bytes)) if dispatches(node) else 0.0),
        note=cost.note,
    )


# --------------------------------------------------------------------------- bottleneck sentences


# (bound, category) -> what would help. Which opswap rules do it is theirs to say (each
# rule's `relieves` names the "bound:category" it helps); report.advice joins the two.
_REMEDIES: dict[tuple[str, str], str] = {
    ("compute", "conv"): "fewer FLOPs (Winograd, depthwise-separable) or a lower-precision "
    "peak would cut its time",
    ("compute", "matmul"): "lower precision (bf16, int8 weights) would raise the ceiling it hits",
    ("compute", "attention"): "a fused attention kernel in lower precision would raise the "
    "ceiling it hits",
    ("compute", "rnn"): "lower precision would raise the ceiling it hits",
    ("memory", "elementwise"): "fusing it into its producer would save most of its traffic",
    ("memory", "activation"): "fusing it into its producer would save most of its traffic",
    ("memory", "normalization"): "folding or fusing it would save most of its traffic",
    ("memory", "softmax"): "fusing it with its neighbours would save traffic",
    ("memory", "data-movement"): "a layout that avoids this copy would save its traffic",
    ("memory", "conv"): "it moves a lot for little work: a larger batch, a channels-last "
    "layout or smaller weights would help",
    ("memory", "matmul"): "it moves a lot for little work: a larger batch, merged sibling "
    "matmuls or smaller weights would help",
    ("memory", "embedding"): "a smaller table dtype would cut the rows it gathers",
}


def bottleneck(r: OpRow) -> str:
    """The "bound:category" key of a row's bottleneck, as a rule's `relieves` names it."""
    return f"{r.bound}:{r.category}"


def remedy(r: OpRow) -> str:
    """What would help the op of row `r`, in words."""
    return _REMEDIES.get(
        (r.bound, r.category),
        (
            "fusing it with its neighbours would save most of its traffic"
            if r.bound == "memory"
            else "a cheaper formula would cut its FLOPs"
        ),
    )


def _sentence(r: OpRow, target: Target, advice: Advice | None = None) -> str:
    intensity = "inf" if math.isinf(r.intensity) else f"{r.intensity:.1f}"
    ridge = target.ridge_point(r.dtype)
    rules = f"; {advice(r, target)}" if advice is not None else ""
    return (
        f"{r.label} ({r.op}) is {r.bound}-bound: {r.share:.0%} of the estimated time, "
        f"{human_unit(r.flops, 'FLOP')} at {intensity} FLOP/byte (ridge {ridge:.1f} on "
        f"{target.name}); {remedy(r)}{rules}."
    )


# --------------------------------------------------------------------------- render


def _shapes(shapes: list[tuple[int, ...]]) -> str:
    return ", ".join("x".join(map(str, s)) if s else "scalar" for s in shapes)


def render(
    analysis: Analysis, console=None, *, top: int | None = None, show_free: bool = False
) -> None:
    """Print the per-op table, the per-category summary and the bottlenecks with rich.

    Ops that cost nothing (views, eval dropout) are left out unless show_free;
    `top` keeps only the costliest rows (shown in graph order).
    """
    from rich.console import Console, JustifyMethod
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    a = analysis
    rows = a.rows if show_free else [r for r in a.rows if r.flops or r.bytes]
    hidden = len(a.rows) - len(rows)
    if top is not None and len(rows) > top:
        keep = {id(r) for r in sorted(rows, key=lambda r: r.est_time_s, reverse=True)[:top]}
        hidden += len(rows) - len(keep)
        rows = [r for r in rows if id(r) in keep]

    t = Table(
        title=escape(f"{a.model} on {a.target.name} ({a.target.description})"), title_justify="left"
    )
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("name", "left"),
        ("op", "left"),
        ("category", "left"),
        ("shapes", "left"),
        ("FLOPs", "right"),
        ("bytes", "right"),
        ("intensity", "right"),
        ("bound", "left"),
        ("share", "right"),
    )
    for col, justify in columns:
        t.add_column(col, justify=justify, overflow="fold")
    for r in rows:
        bound = {"compute": "[magenta]compute[/]", "memory": "[cyan]memory[/]"}.get(r.bound, "-")
        t.add_row(
            escape(r.label),
            escape(str(r.op)),
            r.category,
            f"{_shapes(r.input_shapes)} -> {_shapes(r.output_shapes)}",
            human(r.flops),
            human(r.bytes) + "B",
            "inf" if math.isinf(r.intensity) else f"{r.intensity:.1f}",
            bound,
            f"{r.share:.1%}",
        )
    console.print(t)
    if hidden:
        console.print(
            f"[dim]{hidden} ops not shown (views and ops that move no data"
            f"{', or below the top rows' if top is not None else ''}).[/]"
        )

    s = Table(title="By category", title_justify="left")
    for col in ("category", "ops", "FLOPs", "bytes", "share"):
        s.add_column(col, justify="left" if col == "category" else "right")
    for c in a.categories.values():
        s.add_row(c.category, str(c.count), human(c.flops), human(c.bytes) + "B", f"{c.share:.1%}")
    s.add_row(
        "total",
        str(len(a.rows)),
        human(a.total_flops),
        human(a.total_bytes) + "B",
        "100.0%" if a.est_time_s else "0.0%",
        style="bold",
    )
    console.print(s)
    console.print(
        f"Total {human_unit(a.total_flops, 'FLOP')}, {human_unit(a.total_bytes, 'B')} "
        f"({a.intensity:.1f} FLOP/byte); roofline estimate {human_time(a.est_time_s)} on "
        f"{a.target.name}."
    )
    lines = a.bottlenecks()
    if lines:
        console.print("[bold]Bottlenecks[/]")
        for i, line in enumerate(lines, 1):
            console.print(f" {i}. {escape(line)}", highlight=False)
    for note in a.notes:
        console.print(f"[dim]Note: {escape(note)}[/]")
