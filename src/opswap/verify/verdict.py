"""The verdict of an end-to-end check (`verify.outputs.verify`): per output leaf its metrics
over all samples, and for outputs of class scores what decides them (`verify.decisions`);
for the whole model the worst case, the reasons it failed, and what it was checked on."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from opswap.verify.decisions import Judged
from opswap.verify.metrics import Metrics
from opswap.verify.tolerance import Tolerance


@dataclass
class OutputCheck:
    """One output leaf (e.g. `output[0]`, `output['logits']`) over all samples."""

    name: str
    metrics: Metrics
    passed: bool
    reasons: list[str] = field(default_factory=list)
    #: for an output of class scores: its reading, centred metrics and top-k agreement
    decisions: Judged | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "passed": self.passed,
            "reasons": self.reasons,
            **self.metrics.to_json(),
            "class_scores": self.decisions.to_json() if self.decisions is not None else None,
        }


@dataclass
class Verification:
    """The verdict, the worst-case metrics over all outputs and samples, and the detail."""

    metrics: Metrics
    passed: bool
    reasons: list[str]
    outputs: list[OutputCheck]
    samples: int
    tolerance: Tolerance
    shapes: list[str] = field(default_factory=list)  # the input shapes verified at

    # the metrics under their own names, as result.json carries them
    @property
    def max_abs(self) -> float:
        return self.metrics.max_abs

    @property
    def max_rel(self) -> float:
        return self.metrics.max_rel

    @property
    def cosine(self) -> float:
        return self.metrics.cosine

    @property
    def sqnr_db(self) -> float:
        return self.metrics.sqnr_db

    @property
    def rel_l2(self) -> float:
        return self.metrics.rel_l2

    # what decides class scores (verify.decisions), worst over such outputs; None without
    @property
    def centred_rel_l2(self) -> float | None:
        found = [d.centred_metrics for d in self._decisions()]
        return max((m.rel_l2 for m in found if m is not None), default=None)

    @property
    def top1_agreement(self) -> float | None:
        return min((d.top1.agreement for d in self._decisions()), default=None)

    @property
    def top5_agreement(self) -> float | None:
        return min((d.top5.agreement for d in self._decisions() if d.top5), default=None)

    @property
    def decision_rows(self) -> int | None:
        """The fewest rows any class-score output was judged on."""
        return min((d.top1.rows for d in self._decisions()), default=None)

    def _decisions(self) -> list[Judged]:
        return [o.decisions for o in self.outputs if o.decisions is not None]

    def decisions_text(self) -> str:
        """'centred rel_l2 0.049, top-1 agreement 0.916 on 1056 rows', or '' without
        class-score outputs."""
        if not self._decisions():
            return ""
        parts = []
        if self.centred_rel_l2 is not None:
            parts.append(f"centred rel_l2 {self.centred_rel_l2:.3g}")
        parts.append(f"top-1 agreement {self.top1_agreement:.4g}")
        if self.top5_agreement is not None:
            parts.append(f"top-5 {self.top5_agreement:.4g}")
        return ", ".join(parts) + f" on {self.decision_rows} rows"

    def to_json(self) -> dict[str, Any]:
        return {
            **self.metrics.to_json(),
            "centred_rel_l2": self.centred_rel_l2,
            "top1_agreement": self.top1_agreement,
            "top5_agreement": self.top5_agreement,
            "decision_rows": self.decision_rows,
            "passed": self.passed,
            "reasons": list(self.reasons),
            "samples": self.samples,
            "shapes": list(self.shapes),
            "tolerance": self.tolerance.to_json(),
            "outputs": [o.to_json() for o in self.outputs],
        }

    def __str__(self) -> str:
        verdict = "PASSED" if self.passed else "FAILED: " + "; ".join(self.reasons)
        extra = self.decisions_text()
        return f"{verdict} ({self.metrics}, {self.samples} samples" + (
            f"; {extra})" if extra else ")"
        )
