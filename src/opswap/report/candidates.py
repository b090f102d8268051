"""Each variant's accuracy, and a candidate kept by request, in words: shared by the
report (report.optimize_report) and the CLI's summary (cli.run), from result.json's data
(a variant row's `accuracy`, bench.accuracy.judged_by; the run's `save`)."""

from __future__ import annotations

import math
from typing import Any

from opswap.bench.stats import describe_speedup


def _num(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    if isinstance(x, float) and 0.99 <= x < 1.0:
        return f"{x:.6f}".rstrip("0")  # a cosine: 0.999996, not 1
    return f"{x:.3g}"


def task_text(task: dict[str, Any] | None) -> str:
    """A row's task metric: 'task top1 0.9861', or why it could not be taken."""
    if not task:
        return ""
    if task.get("error"):
        return f"task {task['metric']}: not measured ({task['error']})"
    return f"task {task['metric']} {task['value']:.4f}"


def accuracy_cell(acc: dict[str, Any] | None) -> str:
    """A variant's accuracy in one cell: the metric that decided its verdict with its
    value and bound, top-1 agreement where outputs are class scores, the task's metric."""
    if acc is None:
        return "-"
    if acc.get("reference"):
        parts = ["the reference"]
    elif acc.get("metric") is None:
        reason = acc.get("reason") or "no metric"
        parts = [("failed: " if acc.get("passed") is False else "") + reason]
    elif acc.get("passed") and (acc.get("max_abs") == 0.0 or acc.get("budget_used") == 0.0):
        # nothing measurable at the output dtype's resolution (bench.accuracy's shares)
        parts = [f"the same outputs (max_abs {_num(acc.get('max_abs'))})"]
    else:
        verdict = "" if acc.get("passed") else "failed: "
        rows = acc.get("decision_rows")
        shown = {
            "top1": f"{100 * (acc['value'] or 0):.4g}% of {rows} rows the same top-1",
            "top5": f"{100 * (acc['value'] or 0):.4g}% of {rows} rows in the top 5",
        }.get(acc["metric"], f"{acc['metric']} {_num(acc['value'])}")
        parts = [f"{verdict}{shown} (budget {acc['budget']})"]
        if acc.get("top1_agreement") is not None and acc["metric"] not in ("top1", "top5"):
            parts.append(
                f"top-1 {100 * acc['top1_agreement']:.4g}% of {acc.get('decision_rows')} rows"
            )
    said = task_text(acc.get("task"))
    if said:
        parts.append(said)
    return "; ".join(parts)


def kept_text(data: dict[str, Any]) -> str | None:
    """The sentence for a run that kept opswap's candidate by request (result.json's
    `save`), with its measured speed and accuracy beside the race's winner's; None for a
    run that saved the race's own choice."""
    save = data.get("save") or {}
    if not save.get("kept_by_request"):
        return None
    mine, won = save.get("saved") or {}, save.get("winner") or {}

    def speed(row: dict[str, Any]) -> str:
        if row.get("variant") == "input":
            return "1.00x (your model itself)"
        if row.get("speedup_vs_input") is None:
            return "not timed"
        return describe_speedup(row["speedup_vs_input"], row.get("speedup_ci"), row.get("settled"))

    return (
        f"Kept by request (--save candidate): `{mine.get('variant')}`, opswap's model, "
        f"speed-up over your model {speed(mine)}, accuracy "
        f"{accuracy_cell(mine.get('accuracy'))}. The race's winner was "
        f"`{won.get('variant')}`, speed-up {speed(won)}, accuracy "
        f"{accuracy_cell(won.get('accuracy'))}; it is not what was saved."
    )


def saved_mark(name: str, data: dict[str, Any]) -> str:
    """' (saved)' after the saved row, ' (saved, by request)' for a kept candidate, and
    ' (the race's winner)' for the row a kept candidate displaced."""
    save = data.get("save") or {}
    if name == data["best"]:
        return " (saved, by request)" if save.get("kept_by_request") else " (saved)"
    if save.get("kept_by_request") and name == save.get("race_winner"):
        return " (the race's winner)"
    return ""


def random_check_text(data: dict[str, Any]) -> str | None:
    """result.json's `verification_random` (a run verified on the user's data) in one
    sentence: the check on random samples like the example, reported and not judged."""
    r = data.get("verification_random")
    if not r:
        return None
    reasons = list(r.get("reasons") or [])
    more = f", and {len(reasons) - 1} more" if len(reasons) > 1 else ""
    verdict = "passed" if r["passed"] else f"failed ({reasons[0][:200] if reasons else '?'}{more})"
    return (
        f"On random samples like the example, reported and not judged (they can sit outside "
        f"the ranges static int8 was calibrated for): {verdict}, cosine {_num(r['cosine'])}, "
        f"rel_l2 {_num(r['rel_l2'])}."
    )
