"""The accuracy of each variant of the race, as its row in result.json, the report and the
CLI carries it: the verification the variant was judged by, summed up.

`judged_by(check)` reads a verify.outputs.Verification: the verdict, the metric that
decided it (the one a failing check broke, else the one nearest its bound) with its
value and its bound, the usual metrics, top-1 (top-5) agreement where outputs are class
scores, and what it was checked on. "Nearest its bound" compares thresholds of different
units by the share of its budget each one uses: rel_l2 / bound for an error, (1 - cosine)
/ (1 - bound) for cosine, the rel_l2 an SQNR stands for, and the share of changed rows
the top-1 (top-5) budget allows; a bound of "none at all" is used up by any change.

`task_scores` adds the user's task metric (models.task) for every variant that could be
run, where the run was given a task.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opswap.models.task import Task
    from opswap.verify.outputs import OutputCheck, Verification


def _share(value: float, bound: float) -> float:
    """How much of an upper bound `value` uses (1.0: at the bound)."""
    if math.isnan(value):
        return math.inf
    if bound <= 0:
        return 0.0 if value <= 0 else math.inf
    return value / bound


def _terms(o: OutputCheck, tol: Any) -> list[tuple[float, str, float, str]]:
    """(share of the budget used, metric, value, budget term) of one output's thresholds."""
    m = o.metrics
    out: list[tuple[float, str, float, str]] = []
    if m.nonfinite:
        out.append((math.inf, "nonfinite", float(m.nonfinite), "nonfinite==0"))
    if tol.cosine_min is not None:
        out.append(
            (
                _share(1 - m.cosine, 1 - tol.cosine_min),
                "cosine",
                m.cosine,
                f"cosine>={tol.cosine_min:g}",
            )
        )
    if tol.rel_l2_max is not None:
        out.append(
            (_share(m.rel_l2, tol.rel_l2_max), "rel_l2", m.rel_l2, f"rel_l2<={tol.rel_l2_max:g}")
        )
    if tol.sqnr_min_db is not None and math.isfinite(tol.sqnr_min_db):
        used = 0.0 if m.sqnr_db == math.inf else 10 ** ((tol.sqnr_min_db - m.sqnr_db) / 20)
        out.append((used, "sqnr_db", m.sqnr_db, f"sqnr_db>={tol.sqnr_min_db:g}"))
    for name, bound in (("max_abs", tol.max_abs), ("max_rel", tol.max_rel)):
        if bound is not None:
            out.append(
                (_share(getattr(m, name), bound), name, getattr(m, name), f"{name}<={bound:g}")
            )
    d = o.decisions
    if d is None:
        return out
    limit = tol.centred_limit()
    mc = d.centred_metrics
    if limit is not None and mc is not None and mc.numel:
        floor = tol.rounding_rel * d.offset if math.isfinite(d.offset) else math.inf
        out.append(
            (
                _share(mc.rel_l2, max(limit, floor)),
                "centred_rel_l2",
                mc.rel_l2,
                f"centred_rel_l2<={limit:g}",
            )
        )
    for found, bound, name in ((d.top1, tol.top1_min, "top1"), (d.top5, tol.top5_min, "top5")):
        if found is None or bound is None or not found.rows:
            continue
        out.append(
            (_share(1 - found.agreement, 1 - bound), name, found.agreement, f"{name}>={bound:g}")
        )
    return out


def judged_by(check: Verification) -> dict[str, Any]:
    """A variant's verification summed up for its row (see the module docstring)."""
    # a failing output's terms first (the verdict is what it broke), then the largest share
    terms = [
        (not o.passed, used, metric, value, budget)
        for o in check.outputs
        for used, metric, value, budget in _terms(o, check.tolerance)
    ]
    # shares equal to 6 digits (rel_l2 and the SQNR it stands for) go to the first listed
    worst = max(terms, key=lambda t: (t[0], float(f"{t[1]:.6g}")), default=None)
    out: dict[str, Any] = {
        "passed": check.passed,
        "metric": worst[2] if worst is not None else None,
        "value": worst[3] if worst is not None else None,
        "budget": worst[4] if worst is not None else None,
        "budget_used": worst[1] if worst is not None else None,
        "reason": check.reasons[0] if check.reasons else None,
        "cosine": check.cosine,
        "rel_l2": check.rel_l2,
        "sqnr_db": check.sqnr_db,
        "max_abs": check.max_abs,
        "top1_agreement": check.top1_agreement,
        "top5_agreement": check.top5_agreement,
        "decision_rows": check.decision_rows,
        "samples": check.samples,
        "shapes": list(check.shapes),
        "task": None,
    }
    return out


#: the input's row: it is the reference every other row is judged against
REFERENCE: dict[str, Any] = {"passed": True, "reference": True, "metric": None, "task": None}


def task_scores(
    task: Task, runs: dict[str, Callable[..., Any]], device: str
) -> dict[str, dict[str, Any]]:
    """`task`'s metric for each callable of `runs` (variant name -> the callable the race
    timed), inputs moved to `device`: {"metric", "value"}, or {"metric", "error"} where
    the variant raised on the task's inputs."""

    def on(fn: Callable[..., Any]) -> Callable[..., Any]:
        return lambda *xs: fn(*(x.to(device) for x in xs))

    out: dict[str, dict[str, Any]] = {}
    for name, fn in runs.items():
        try:
            out[name] = {"metric": task.metric, "value": float(task.evaluate(on(fn)))}
        except Exception as e:  # a file that takes only the example's batch size, say
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            out[name] = {"metric": task.metric, "error": f"{type(e).__name__}: {first}"}
    return out
