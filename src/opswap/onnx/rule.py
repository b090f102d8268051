"""The ONNX rule: onnxscript's pattern -> check -> rewrite, with sites and misses reported.

A rule here is an onnxscript `RewriteRuleClassBase` (its `pattern`, `check` and
`rewrite` are onnxscript's), with what opswap's rules carry besides: a `name`
(`onnx.<what>`), `exactness`, the op types it `produces`, a description. `check` returns
a `MatchResult`, failed with the reason of a near miss in a user's words (`refuse`), and
`run` applies the rule to a model and returns what it did as opswap's own `Site`s and
`Miss`es (rules.base), so plans, reports and the CLI show ONNX rules like the PyTorch
ones. The matching runs through onnxscript's `RewriteRuleSet` with a tracer that records
each anchor's outcome; misses at an anchor that another variant of the pattern (commuted
inputs) rewrote are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern as orp

from opswap.rules.base import Exactness, Miss, Site

MS_DOMAIN = "com.microsoft"


def refuse(reason: str) -> orp.MatchResult:
    """A failed match that says why."""
    out = orp.MatchResult()
    out.fail(reason)
    return out


def ok() -> orp.MatchResult:
    return orp.MatchResult()


def const(value: ir.Value | None) -> np.ndarray | None:
    """The value's constant contents (an initializer or a Constant node's), else None."""
    if value is None:
        return None
    t = ir.convenience.get_const_tensor(value)
    return None if t is None else t.numpy()


def scalar(value: ir.Value | None) -> float | None:
    """A constant holding one number (of any rank), as a float; else None."""
    a = const(value)
    return float(a.reshape(-1)[0]) if a is not None and a.size == 1 else None


def near(value: ir.Value | None, want: float, rel: float = 1e-3) -> bool:
    got = scalar(value)
    return got is not None and abs(got - want) <= rel * abs(want)


def rank(value: ir.Value | None) -> int | None:
    return None if value is None or value.shape is None else len(value.shape)


def bias_of(value: ir.Value) -> tuple[ir.Value, ir.Value] | None:
    """(product, bias) when `value` is MatMul(x, W) + b with a constant 1-D b read by
    nothing else: a fused op that takes a bias input can absorb the Add."""
    node = value.producer()
    if node is None or node.op_type != "Add" or len(value.uses()) != 1:
        return None
    for mm, b in (node.inputs, node.inputs[::-1]):
        if mm is None or b is None:
            continue
        producer = mm.producer()
        t = const(b)
        if producer is not None and producer.op_type == "MatMul" and t is not None and t.ndim == 1:
            if len(mm.uses()) == 1 and last_dim(mm) == t.shape[0]:
                return mm, b
    return None


def spec_default(node: ir.Node, name: str) -> Any:
    """The default the ONNX spec gives attribute `name` of `node`'s op at the opset the
    model imports for its domain (bytes decoded to str); None where the spec gives none
    or does not know the op (com.microsoft's)."""
    import onnx

    domain = node.domain or ""
    version = node.version
    if version is None and node.graph is not None:
        version = node.graph.opset_imports.get(domain)
    try:
        if version is None:
            schema = onnx.defs.get_schema(node.op_type, domain)
        else:
            schema = onnx.defs.get_schema(node.op_type, version, domain)
    except onnx.defs.SchemaError:
        return None
    a = schema.attributes.get(name)
    if a is None or a.default_value.type == onnx.AttributeProto.UNDEFINED:
        return None
    value = onnx.helper.get_attribute_value(a.default_value)
    return value.decode() if isinstance(value, bytes) else value


def _attr(node: ir.Node, name: str, default: Any) -> Any:
    """The attribute as set on the node, else the spec's default, else `default` (for ops
    the spec does not define)."""
    a = node.attributes.get(name)
    if a is not None:
        return a.value
    found = spec_default(node, name)
    if found is None and default is None:
        raise ValueError(f"{node.op_type} has no attribute {name} and the spec no default")
    return default if found is None else found


def attr_int(node: ir.Node, name: str, default: int | None = None) -> int:
    """An int attribute, defaulting as the ONNX spec says for the node's opset."""
    return int(_attr(node, name, default))


def attr_float(node: ir.Node, name: str, default: float | None = None) -> float:
    """A float attribute, defaulting as the ONNX spec says for the node's opset (a
    LayerNormalization without epsilon has 1e-5)."""
    return float(_attr(node, name, default))


def attr_str(node: ir.Node, name: str, default: str | None = None) -> str:
    value = _attr(node, name, default)
    return value.decode() if isinstance(value, bytes) else str(value)


def last_dim(value: ir.Value) -> int | None:
    """The size of `value`'s last axis: from its shape, else from the constant weight of
    the MatMul or Gemm that made it."""
    if value.shape is not None and len(value.shape) and isinstance(value.shape[-1], int):
        return value.shape[-1]
    node = value.producer()
    if node is not None and node.op_type in ("MatMul", "Gemm") and len(node.inputs) > 1:
        w = const(node.inputs[1])
        if w is not None and w.ndim == 2:
            trans = node.op_type == "Gemm" and attr_int(node, "transB")
            return int(w.shape[0] if trans else w.shape[1])
    if node is not None and node.op_type == "Add":
        dims = [last_dim(v) for v in node.inputs if v is not None]
        return next((d for d in dims if d is not None), None)
    return None


def reduce_axes(node: ir.Node | None) -> list[int] | None:
    """The axes a Reduce* node reduces over: the attribute (opset < 18) or the constant
    second input (opset >= 18); None when they are not constants."""
    if node is None:
        return None
    attr = node.attributes.get("axes")
    if attr is not None:
        return list(attr.as_ints())
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        a = const(node.inputs[1])
        return None if a is None else [int(x) for x in a.reshape(-1)]
    return None


def last_axis(axes: list[int] | None, r: int | None) -> bool:
    """Whether `axes` is the last axis alone, as -1 or as rank - 1."""
    return (
        axes is not None
        and len(axes) == 1
        and (axes[0] == -1 or (r is not None and axes[0] == r - 1))
    )


@dataclass
class RuleRun:
    """What one rule did to a model: the sites it rewrote and its near misses."""

    rule: str
    sites: list[Site] = field(default_factory=list)
    misses: list[Miss] = field(default_factory=list)


class OnnxRule(orp.RewriteRuleClassBase):
    """Base of opswap's ONNX rules. Subclasses define `pattern(op, ...)`,
    `check(context, ...) -> MatchResult` and `rewrite(op, ...)` as onnxscript's rewriter
    does, and the class attributes below. A rule whose pattern has several forms sets
    `variants`; `self.variant` says which one `pattern` builds."""

    name: str  # onnx.<what>, set by each rule's class
    exactness: ClassVar[Exactness] = "exact"
    description: ClassVar[str] = ""
    #: the op types the rewrite creates (what the peer comparison counts)
    produces: ClassVar[tuple[str, ...]] = ()
    #: how many forms the pattern has (`pattern` reads `self.variant`)
    variants: ClassVar[int] = 1
    #: try the pattern with the inputs of commutative ops swapped too
    commute: ClassVar[bool] = False
    #: leave the matched nodes in place for dead-code removal (the rewrite re-routes a
    #: value the pattern computes and something outside it also reads)
    keeps_nodes: ClassVar[bool] = False
    family: ClassVar[str] = "onnx"
    chapter: ClassVar[int] = 21
    #: where the rule runs in a plan, and which rules (names or globs) must run before
    #: and after it: the PyTorch rules' declarations, ordered the same way (rules/order.py)
    phase: ClassVar[str] = "main"
    after: ClassVar[tuple[str, ...]] = ()
    before: ClassVar[tuple[str, ...]] = ()

    def __init__(self, variant: int = 0) -> None:
        super().__init__(self.name, remove_nodes=not self.keeps_nodes)
        self.variant = variant
        self._run: RuleRun | None = None
        self._checked: ir.Node | None = None
        self._matched: tuple[str, ...] = ()
        self._replaced: list[ir.Value] = []

    def _rewrite_rules(self, run: RuleRun) -> list[orp.RewriteRule]:
        out = []
        for v in range(self.variants):
            form = type(self)(v)
            form._run = run
            out.append(
                orp.RewriteRule(
                    form.pattern,
                    form._rewrite,
                    form._check,
                    name=f"{self.name}#{v}",
                    remove_nodes=not self.keeps_nodes,
                )
            )
        return out

    def run(self, model: ir.Model) -> RuleRun:
        """Apply this rule everywhere in `model` (in place); the sites it rewrote and its
        near misses (a miss at a node another form of the pattern rewrote is dropped)."""
        run = RuleRun(self.name)
        orp.RewriteRuleSet(self._rewrite_rules(run), commute=self.commute).apply_to_model(model)
        done = {n for s in run.sites for n in s.nodes}
        seen: set[tuple[str, str]] = set()
        misses = []
        for m in run.misses:
            if m.where not in done and (m.where, m.reason) not in seen:
                seen.add((m.where, m.reason))
                misses.append(m)
        run.misses = misses
        return run

    def _check(self, context, **bindings):
        answer = self.check(context, **bindings)
        root = context.root
        if not answer:
            reason = getattr(answer, "reason", "") or "the pattern's conditions do not hold"
            assert self._run is not None
            self._run.misses.append(Miss(self.name, _name(root), reason))
        else:
            self._checked = root
            self._matched = tuple(_name(n) for n in context.nodes)
            self._replaced = list(context.output_values)
        return answer

    def _rewrite(self, op, **bindings):
        out = self.rewrite(op, **bindings)
        new = out if isinstance(out, (list, tuple)) else [out]
        for value, old in zip(new, self._replaced, strict=False):
            if isinstance(value, ir.Value) and value.shape is None:
                value.shape, value.type = old.shape, old.type  # what the rewrite stands for
        if out is not None and out is not False and self._checked is not None:
            assert self._run is not None
            root, names = self._checked, self._matched
            self._run.sites.append(
                Site(self.name, "+".join(names), names, self.describe(root, names), {}, _name(root))
            )
        return out

    def describe(self, root: ir.Node, nodes: tuple[str, ...]) -> str:
        made = " + ".join(self.produces) or "rewritten"
        return f"{len(nodes)} nodes ending at {_name(root)} -> {made}"

    @classmethod
    def info(cls) -> dict[str, Any]:
        return {
            "name": cls.name,
            "family": cls.family,
            "chapter": cls.chapter,
            "exactness": cls.exactness,
            "targets": ["onnxruntime"],
            "description": cls.description,
            "produces": list(cls.produces),
            "phase": cls.phase,
            "after": list(cls.after),
            "before": list(cls.before),
        }


def _name(node: ir.Node) -> str:
    return node.name or node.op_type
