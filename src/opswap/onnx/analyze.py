"""`opswap analyze model.onnx`: the ONNX graph per op type: how many nodes, FLOPs where
they are cheap to know (MatMul, Gemm, Conv, attention and the pointwise and norm ops, from
the inferred shapes at the example sizes), and each type's share of the counted FLOPs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import onnx_ir as ir

from opswap.onnx.rule import attr_int

if TYPE_CHECKING:
    from opswap.onnx.load import OnnxModel

#: elementwise ops: FLOPs = output elements times this
_POINTWISE = {
    "Add": 1,
    "Sub": 1,
    "Mul": 1,
    "Div": 1,
    "Relu": 1,
    "Sigmoid": 4,
    "Tanh": 4,
    "Erf": 4,
    "Sqrt": 1,
    "Pow": 1,
    "Exp": 1,
    "Gelu": 8,
    "FastGelu": 8,
    "BiasGelu": 9,
    "Softmax": 5,
    "LayerNormalization": 8,
    "SkipLayerNormalization": 9,
    "SimplifiedLayerNormalization": 5,
    "BatchNormalization": 2,
    "Where": 1,
}


@dataclass
class OpRow:
    op: str
    count: int = 0
    flops: float = 0.0
    unknown: int = 0  # nodes whose FLOPs the shapes did not give

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "count": self.count, "flops": self.flops, "unknown": self.unknown}


@dataclass
class OnnxAnalysis:
    model: str
    nodes: int
    rows: list[OpRow] = field(default_factory=list)
    sizes: dict[str, int] = field(default_factory=dict)

    @property
    def flops(self) -> float:
        return sum(r.flops for r in self.rows)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "nodes": self.nodes,
            "sizes": self.sizes,
            "total_flops": self.flops,
            "ops": [r.to_json() for r in self.rows],
        }


def _numel(v: ir.Value | None, sizes: dict[str, int]) -> float | None:
    if v is None or v.shape is None:
        return None
    n = 1
    for d in v.shape:
        if isinstance(d, int):
            n *= d
        elif str(d.value) in sizes:
            n *= sizes[str(d.value)]
        else:
            return None
    return float(n)


def node_flops(node: ir.Node, sizes: dict[str, int]) -> float | None:
    """Multiply-adds count 2; None when the shapes do not say."""
    out = _numel(node.outputs[0], sizes) if node.outputs else None
    if out is None:
        return None
    op = node.op_type
    if op in ("MatMul", "Gemm", "FusedMatMul"):
        a = node.inputs[0]
        if a is None or a.shape is None or not len(a.shape):
            return None
        k = a.shape[0 if op == "Gemm" and attr_int(node, "transA") else -1]
        return 2.0 * out * k if isinstance(k, int) else None
    if op == "Conv":
        w = node.inputs[1] if len(node.inputs) > 1 else None
        dims = list(w.shape) if w is not None and w.shape is not None else None
        if dims is None or not all(isinstance(d, int) for d in dims):
            return None
        per = 1
        for d in dims[1:]:
            per *= int(d)  # type: ignore[arg-type]
        return 2.0 * out * per
    if op == "MultiHeadAttention":
        nq = _numel(node.inputs[0], sizes)
        key = node.inputs[1]
        nk = key.shape[1] if key is not None and key.shape is not None else None
        if isinstance(nk, ir.SymbolicDim):
            nk = sizes.get(str(nk.value))
        return 4.0 * nq * nk if nq is not None and isinstance(nk, int) else None
    if op in _POINTWISE:
        return float(_POINTWISE[op]) * out
    return 0.0


def analyze_onnx(loaded: OnnxModel) -> OnnxAnalysis:
    from opswap.onnx.plan import to_ir

    model = to_ir(loaded.proto)
    rows: dict[str, OpRow] = {}
    n = 0
    for node in model.graph:
        n += 1
        row = rows.setdefault(node.op_type, OpRow(node.op_type))
        row.count += 1
        f = node_flops(node, loaded.sizes)
        if f is None:
            row.unknown += 1
        else:
            row.flops += f
    ordered = sorted(rows.values(), key=lambda r: (-r.flops, -r.count, r.op))
    return OnnxAnalysis(loaded.path.name, n, ordered, dict(loaded.sizes))


def render_table(result: OnnxAnalysis, console, top: int = 40) -> None:
    from rich.table import Table

    total = result.flops or 1.0
    table = Table(
        title=f"{result.model}: {result.nodes} nodes, {result.flops / 1e9:.3f} GFLOP counted"
    )
    for col in ("op", "count", "GFLOP", "share", "no FLOPs known"):
        table.add_column(col)
    for r in result.rows[:top]:
        table.add_row(
            r.op,
            str(r.count),
            f"{r.flops / 1e9:.4f}",
            f"{100 * r.flops / total:.1f}%",
            str(r.unknown or ""),
        )
    console.print(table)
