"""Planning and applying the ONNX rules: each rule, in order, on a copy of the model.

The rules depend on each other's results (SkipLayerNormalization takes the
LayerNormalization that onnx.layer_norm made, BiasGelu the Gelu), so a plan is made by
applying them in order to a copy and recording what each rewrote and where it nearly
did; after every rule the graph is sorted, and what the rewrite left unread is removed.
`OnnxPlan` is what `opswap plan model.onnx` writes: the sites, the misses, the settings.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opswap.errors import PlanError, RuleError
from opswap.onnx.rule import OnnxRule, RuleRun
from opswap.onnx.rules import onnx_rules
from opswap.rules.base import EXACTNESS_ORDER, Miss, Site

if TYPE_CHECKING:
    import onnx
    import onnx_ir as ir

    from opswap.onnx.load import OnnxModel


@dataclass
class OnnxPlan:
    """What the rules did to one ONNX model, and with which settings."""

    model: str
    rules: list[str]
    exactness: str
    sites: list[Site] = field(default_factory=list)
    misses: list[Miss] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.sites:
            out[s.rule] = out.get(s.rule, 0) + 1
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "format": "opswap.onnx-plan/1",
            "model": self.model,
            "settings": {"rules": self.rules, "exactness": self.exactness},
            "sites": [s.to_json() for s in self.sites],
            "misses": [m.to_json() for m in self.misses],
            "counts": self.counts(),
        }

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return p


def select(rules: list[str] | None, exactness: str = "exact") -> list[OnnxRule]:
    """The ONNX rules named by globs (`onnx.*gelu`; all by default) no looser than
    `exactness`, in plan order; a glob that names no rule is refused."""
    if exactness not in EXACTNESS_ORDER:
        raise PlanError(f"Unknown exactness {exactness!r}; use exact, approx or lossy.")
    every = onnx_rules()
    globs = [g.strip() for g in rules or [] if g.strip()] or ["onnx.*"]
    for g in globs:
        if not any(fnmatch.fnmatchcase(r.name, g) for r in every):
            names = ", ".join(r.name for r in every)
            raise RuleError(f"No ONNX rule matches {g!r}; the ONNX rules are {names}.")
    limit = EXACTNESS_ORDER[exactness]
    return [
        r
        for r in every
        if any(fnmatch.fnmatchcase(r.name, g) for g in globs)
        and EXACTNESS_ORDER[r.exactness] <= limit
    ]


def to_ir(proto: onnx.ModelProto) -> ir.Model:
    import onnx_ir as ir

    model = ir.from_proto(proto)
    for i, node in enumerate(model.graph):
        if not node.name:
            node.name = f"{node.op_type}_{i}"
    return model


def tidy(model: ir.Model) -> None:
    """Sorted, with no unread nodes, no Identity the rewrites left, and constants made by
    rewrites stored as initializers."""
    from onnx_ir.passes import common

    common.IdentityEliminationPass()(model)
    common.RemoveUnusedNodesPass()(model)
    common.LiftConstantsToInitializersPass(lift_all_constants=False, size_limit=0)(model)
    common.TopologicalSortPass()(model)


def apply_rules(model: ir.Model, rules: list[OnnxRule]) -> list[RuleRun]:
    """Every rule in turn on `model` (changed in place); what each did."""
    runs = []
    for rule in rules:
        runs.append(rule.run(model))
        tidy(model)
    return runs


def plan_onnx(
    loaded: OnnxModel, rules: list[str] | None = None, exactness: str = "exact"
) -> tuple[OnnxPlan, onnx.ModelProto]:
    """The plan for `loaded`, and the rewritten model it describes (the input is left as
    it was)."""
    import onnx_ir as ir

    chosen = select(rules, exactness)
    model = to_ir(loaded.proto)
    runs = apply_rules(model, chosen)
    _opsets(model)
    plan = OnnxPlan(loaded.path.name, [r.name for r in chosen], exactness)
    for run in runs:
        plan.sites += run.sites
        plan.misses += run.misses
    return plan, ir.to_proto(model)


def _opsets(model: ir.Model) -> None:
    domains = {n.domain for n in model.graph}
    if "com.microsoft" in domains and "com.microsoft" not in model.opset_imports:
        model.opset_imports["com.microsoft"] = 1
        model.graph.opset_imports["com.microsoft"] = 1
