"""The mixed-precision debugger: which layers must stay in float32 for a lower-precision
scheme (bfloat16, float16, int8, any approx or lossy rule) to meet a tolerance.

1. Sensitivity. The scheme's plan lists its sites; each is applied alone (a plan made with
   every other site excluded) and the model's output is compared with the reference's
   over several samples: relative L2, cosine and SQNR, worst over samples and outputs.
2. Search. When the scheme everywhere misses the tolerance, sites are kept in float32 in
   order of their sensitivity, most sensitive first: bisection over that order finds the
   shortest prefix whose exclusion meets the tolerance, and then each kept site, least
   sensitive first, is put back in low precision when the tolerance still holds without it.
3. Verification. The final plan (the scheme minus the kept sites) is verified like any
   other, at the example's shape and at the others the capture claims.

What it guarantees: the result meets the tolerance on the samples measured (and the final
verification says whether it does at the other shapes), and no single kept site can be
given back to the scheme without breaking it there. What it does not: that the kept set is
the smallest possible. Errors of sites do not add up monotonically (two errors may cancel,
or compound), bisection assumes that keeping more of the ordered list never hurts, and
sensitivity alone is one ordering among many; an exact minimum would try subsets, which
grows as 2^n. Every plan is made with `make_plan(exclude_sites=...)` and applied with
`apply_plan`, so a site that is not predicted to pay on the target is not a candidate here
either: the debugger answers for the plans `optimize` would make.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from opswap.errors import VerificationError
from opswap.graph.capture import Captured, capture
from opswap.graph.copies import private_copy
from opswap.graph.inputs import fresh
from opswap.graph.ops import op_kind
from opswap.planner import Decision, Plan, apply_plan, make_plan
from opswap.rules import registry
from opswap.rules.base import EXACTNESS_ORDER, node_by_name
from opswap.verify.metrics import Metrics, combine, compare
from opswap.verify.outputs import Verification, full_precision, same_random, verify
from opswap.verify.samples import make_samples
from opswap.verify.tolerance import Tolerance, as_tolerance

DEFAULT_RULES = ("precision.bf16",)

#: the reason a plan gives a site the debugger keeps in float32
KEPT = "kept in float32 by the mixed-precision debugger"


@dataclass
class LayerSensitivity:
    """One site of the scheme: where it is, what the model's output loses when it alone is
    in low precision, and whether the search keeps it in float32."""

    rule: str
    site: str
    module: str
    op: str
    alone: Metrics
    kept: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "site": self.site,
            "module": self.module,
            "op": self.op,
            "rel_l2": self.alone.rel_l2,
            "cosine": self.alone.cosine,
            "sqnr_db": self.alone.sqnr_db,
            "nonfinite": self.alone.nonfinite,
            "kept_fp32": self.kept,
        }


@dataclass
class MixedPrecision:
    """The debugger's answer: the per-site table (in graph order), the scheme's error
    everywhere and with the kept sites in float32, the plan to use, its verification, and
    how many plans the search measured."""

    model: str
    rules: list[str]
    target: str
    tolerance: Tolerance
    samples: int
    layers: list[LayerSensitivity]
    everywhere: Metrics
    result: Metrics
    plan: Plan
    verification: Verification | None
    trials: int
    skipped: list[str] = field(default_factory=list)  # sites the plan left out, and why

    @property
    def kept(self) -> list[LayerSensitivity]:
        return [s for s in self.layers if s.kept]

    @property
    def passed(self) -> bool:
        return self.verification is not None and self.verification.passed

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "rules": list(self.rules),
            "target": self.target,
            "tolerance": self.tolerance.to_json(),
            "samples": self.samples,
            "sites": len(self.layers),
            "kept_fp32": [s.site for s in self.kept],
            "everywhere": self.everywhere.to_json(),
            "result": self.result.to_json(),
            "passed": self.passed,
            "verification": None if self.verification is None else self.verification.to_json(),
            "trials": self.trials,
            "layers": [s.to_json() for s in self.layers],
            "skipped": list(self.skipped),
            "plan": self.plan.to_json(),
            "guarantee": GUARANTEE,
        }


GUARANTEE = (
    "The kept set meets the tolerance on the samples measured, and no single kept site can "
    "be put back in low precision without breaking it; it is not proven to be the smallest "
    "such set (site errors need not add up monotonically)."
)


class _Measure:
    """The reference's outputs on the samples, computed once, and the distance of a plan's
    result from them; counts the plans it measured."""

    def __init__(self, reference: Callable, captured: Captured, samples: int, seed: int):
        self.captured = captured
        self.inputs = make_samples(captured.example_inputs, samples, seed)
        self.seed = seed
        self.trials = 0
        with torch.no_grad(), full_precision():
            self.refs = [self._run(reference, i, x) for i, x in enumerate(self.inputs)]

    def _run(self, fn: Callable, i: int, x: tuple) -> list[torch.Tensor]:
        with same_random(self.seed + i):
            out = fn(*fresh(x))
        return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]

    def __call__(self, plan: Plan) -> Metrics:
        self.trials += 1
        gm = apply_plan(self.captured, plan, shapes=False).gm
        found = []
        with torch.no_grad(), full_precision():
            for i, x in enumerate(self.inputs):
                for r, c in zip(self.refs[i], self._run(gm, i, x), strict=True):
                    if r.is_floating_point():
                        found.append(compare(r, c))
        return combine(found)


def _exactness(rules: Sequence[str]) -> str:
    """The loosest exactness among the rules the patterns name (so that each is planned);
    a pattern that names no rule raises the registry's RuleError."""
    chosen = registry.select(registry.parse_patterns(list(rules)) or None, "lossy", None)
    return max((r.exactness for r in chosen), key=lambda e: EXACTNESS_ORDER[e])


def debug_precision(
    model: nn.Module | None = None,
    example_inputs: Any = None,
    *,
    captured: Captured | None = None,
    rules: Sequence[str] = DEFAULT_RULES,
    tolerance: Tolerance | str | None = None,
    samples: int = 3,
    target: Any = None,
    seed: int = 0,
    name: str = "model",
    progress: Callable[[str], None] | None = None,
) -> MixedPrecision:
    """Find the sites of `rules`' scheme to keep in float32 so that `model`'s outputs meet
    `tolerance` (a Tolerance, an exactness name or a budget string; default the loosest
    exactness of the rules), on `samples` inputs like `example_inputs`. Pass `captured`
    instead of the inputs to reuse a capture (a Run's); `model` is then the reference it
    is compared with (default: the capture's own graph). `target` is where the plans are
    made for (default this machine's CPU)."""
    step = progress or (lambda _: None)
    if model is not None:
        model = private_copy(model)  # the user's module is never called
    if captured is None:
        if model is None or example_inputs is None:
            raise VerificationError(
                "debug_precision needs the model and its example inputs, or a capture of it."
            )
        step("capture")
        captured = capture(model, example_inputs)
    reference: Callable = model if model is not None else captured.gm
    exactness = _exactness(rules)
    tol = as_tolerance(tolerance, default=exactness)
    rules = list(rules)

    def plan(excluded: dict[tuple[str, str], str]) -> Plan:
        return make_plan(
            captured,
            target=target,
            rules=rules,
            exactness=exactness,
            model_name=name,
            exclude_sites=excluded,
            keep_slower=True,  # which layers the scheme can take, whatever the speed model says
        )

    step("plan")
    full = plan({})
    decisions: list[Decision] = list(full.decisions)
    keys = [(d.rule, d.site.key) for d in decisions]
    measure = _Measure(reference, captured, samples, seed)
    layers = []
    for d in decisions:
        step(f"sensitivity {d.site.key}")
        others = {k: "measured alone" for k in keys if k != (d.rule, d.site.key)}
        node = node_by_name(captured.gm, d.site.anchor or d.site.key)
        layers.append(
            LayerSensitivity(
                d.rule,
                d.site.key,
                d.module,
                op_kind(node) if node is not None else "",
                measure(plan(others)),
            )
        )
    step("everywhere")
    everywhere = measure(full) if decisions else Metrics()

    seen: dict[frozenset[tuple[str, str]], Metrics] = {}
    checked: dict[frozenset[tuple[str, str]], Any] = {}

    def verified(kept: set[tuple[str, str]]):
        """The verification the result is judged by (every shape, class-score outputs
        centred and by top-1), of the plan keeping `kept` in float32: the search keeps a
        set only where this passes too, so its answer and the final check agree."""
        key = frozenset(kept)
        if key not in checked:
            step("verify")
            checked[key] = verify(
                reference,
                apply_plan(captured, plan({k: KEPT for k in kept}) if kept else full).gm,
                captured.example_inputs,
                samples=samples,
                tolerance=tol,
                seed=seed + 1000,
                variants=captured.variants(),
            )
        return checked[key]

    def passes(kept: set[tuple[str, str]]) -> tuple[bool, Metrics]:
        key = frozenset(kept)
        if key not in seen:
            seen[key] = measure(plan({k: KEPT for k in kept}))
        ok = tol.check(seen[key])[0] and verified(kept).passed
        return ok, seen[key]

    kept: set[tuple[str, str]] = set()
    result = everywhere
    if decisions and not (tol.check(everywhere)[0] and verified(set()).passed):
        order = sorted(range(len(layers)), key=lambda i: _badness(layers[i].alone), reverse=True)
        ordered = [keys[i] for i in order]
        lo, hi = 0, len(ordered)  # keeping none fails; keeping all is the float32 model
        while hi - lo > 1:
            mid = (lo + hi) // 2
            step(f"bisect: keep {mid} of {len(ordered)}")
            if passes(set(ordered[:mid]))[0]:
                hi = mid
            else:
                lo = mid
        kept = set(ordered[:hi])
        for k in reversed(ordered[:hi]):  # least sensitive first: give it back if it holds
            step(f"try {k[1]} in low precision")
            if len(kept) > 1 and passes(kept - {k})[0]:  # none kept: the scheme, which fails
                kept.discard(k)
        result = passes(kept)[1]
    for s in layers:
        s.kept = (s.rule, s.site) in kept
    final = plan({k: KEPT for k in kept}) if kept else full
    check = verified(kept)
    return MixedPrecision(
        name,
        rules,
        full.settings.target,
        tol,
        samples,
        layers,
        everywhere,
        result,
        final,
        check,
        measure.trials,
        [f"{s.where}: {s.reason}" for s in full.skipped],
    )


def _badness(m: Metrics) -> float:
    """One number to order sites by: their relative L2 alone (a non-finite output first)."""
    if m.nonfinite or not math.isfinite(m.rel_l2):
        return math.inf
    return m.rel_l2
