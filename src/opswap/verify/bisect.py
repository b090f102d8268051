"""Which decision of a plan broke the numbers? Bisection over plan prefixes, and rollback.

A plan is an ordered list of decisions. If applying the first j decisions passes
and the first k fails, the culprit lies in (j, k]: halving that interval finds the
first failing decision in about log2(n) apply+verify runs instead of n. This
assumes errors only grow as decisions are added (a later decision does not cancel
an earlier one's error), which holds for the independent rewrites a plan holds.

`rollback` repeats: apply and verify the plan; if it fails, bisect, drop the first
failing decision, and go on from there -- decisions before the culprit are already
known to pass, so the next search starts at the culprit's position. k culprits in
a plan of n cost about (k + 1) * (1 + log2 n) runs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, overload

from opswap.errors import VerificationError
from opswap.graph.capture import Captured
from opswap.planner import Decision, Plan, apply_plan
from opswap.verify.metrics import Metrics
from opswap.verify.outputs import Verification, verify
from opswap.verify.tolerance import Tolerance, as_tolerance


def _prefix(plan: Plan, k: int) -> Plan:
    p = copy.copy(plan)
    p.decisions = list(plan.decisions[:k])
    return p


@overload
def find_culprit(
    plan: Plan, check: Callable[[Plan], bool], *, passing: int = 0, failing: int
) -> int: ...


@overload
def find_culprit(
    plan: Plan, check: Callable[[Plan], bool], *, passing: int = 0, failing: None = None
) -> int | None: ...


def find_culprit(
    plan: Plan, check: Callable[[Plan], bool], *, passing: int = 0, failing: int | None = None
) -> int | None:
    """Index of the first decision whose prefix fails `check(prefix_plan) -> passes`.

    `passing` is a prefix length known to pass (0: the untouched model), `failing`
    one known to fail (None: the whole plan is checked first, and None is returned
    if it passes). Calls `check` at most 1 + ceil(log2(failing - passing)) times.
    """
    n = len(plan.decisions)
    lo = passing
    if failing is None:
        if check(_prefix(plan, n)):
            return None
        failing = n
    hi = failing
    if not 0 <= lo < hi <= n:
        raise ValueError(f"need 0 <= passing < failing <= {n}; got {lo} and {hi}")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if check(_prefix(plan, mid)):
            lo = mid
        else:
            hi = mid
    return hi - 1


@dataclass
class Rollback:
    """A decision taken out of the plan, and the verification of the prefix it broke."""

    index: int  # position in the plan rollback() was given
    decision: Decision
    metrics: Metrics
    reasons: list[str] = field(default_factory=list)

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "rule": self.decision.rule,
            "site": self.decision.site.key,
            "description": self.decision.site.description,
            "reason": self.reason,
            "metrics": self.metrics.to_json(),
        }

    def __str__(self) -> str:
        return f"rolled back {self.decision.rule} at {self.decision.site.key}: {self.reason}"


def rollback(
    captured: Captured,
    plan: Plan,
    reference_fn: Callable,
    tolerance: Tolerance | str | None = None,
    *,
    inputs=None,
    samples: int = 3,
    seed: int = 0,
    max_rollbacks: int | None = None,
    verifier: Callable[[Any], Verification] | None = None,
) -> tuple[Plan, list[Rollback]]:
    """Drop decisions from `plan` until `reference_fn` and the applied plan agree within
    `tolerance` on `inputs` (default: the capture's example inputs, and then at the other
    shapes the capture claims too).

    `verifier(candidate)`, where given, is the check instead (the run's own, on the user's
    data when it has some).

    Returns the plan that was kept and one Rollback per decision removed, in order.
    Raises VerificationError if the untouched capture already disagrees with
    `reference_fn` (nothing a rollback could fix).
    """
    tol = as_tolerance(tolerance)
    inputs = captured.example_inputs if inputs is None else inputs
    cache: dict[tuple[int, ...], Verification] = {}
    original = {id(d): i for i, d in enumerate(plan.decisions)}

    def run(p: Plan) -> Verification:
        key = tuple(id(d) for d in p.decisions)
        if key not in cache:
            gm = apply_plan(captured, p, shapes=False).gm
            cache[key] = check(gm)
        return cache[key]

    own = inputs is captured.example_inputs  # at the capture's other shapes too

    def check(candidate) -> Verification:
        if verifier is not None:
            return verifier(candidate)
        return verify(
            reference_fn,
            candidate,
            inputs,
            samples=samples,
            tolerance=tol,
            seed=seed,
            variants=captured.variants() if own else (),
            graph=captured.gm,
            dynamic=captured.dynamic if own else None,
        )

    base = check(captured.gm)
    if not base.passed:
        raise VerificationError(
            "The captured graph already differs from the reference before any replacement ("
            + "; ".join(base.reasons)
            + "); nothing to roll back -- is the model deterministic "
            "and in eval mode?"
        )
    removed: list[Rollback] = []
    start = 0  # every prefix up to here is known to pass
    while plan.decisions:
        if max_rollbacks is not None and len(removed) >= max_rollbacks:
            break
        if run(plan).passed:
            break
        culprit = find_culprit(
            plan, lambda p: run(p).passed, passing=start, failing=len(plan.decisions)
        )
        broken = run(_prefix(plan, culprit + 1))
        d = plan.decisions[culprit]
        removed.append(Rollback(original[id(d)], d, broken.metrics, list(broken.reasons)))
        plan = plan.without(culprit)
        start = culprit
    return plan, removed
