"""What "the numbers still match" means: thresholds on the metrics, by exactness or budget.

A rule declares its exactness (`exact`, `approx`, `lossy`); the tolerance a plan is
verified against follows the loosest exactness it allows, and a user budget
("cosine>=0.9999,max_abs<=1e-3") overrides single thresholds.

rel_l2 and SQNR carry the same information (sqnr_db = -20 log10(rel_l2)); both
exist so a budget can be stated in whichever unit the user thinks in, and the
defaults below keep them consistent. Cosine is the looser guard (for small,
uncorrelated noise 1 - cosine ~ rel_l2^2 / 2): it catches gross failures when a
user budget sets only a bound on absolute error.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, replace
from typing import Any

from opswap.errors import VerificationError
from opswap.verify.metrics import Metrics

_DEFAULTS: dict[str, dict[str, float]] = {
    # Same math, different rounding (folds, fusions, reordered reductions). float32's unit
    # roundoff is 6e-8 and a reordered sum of K terms typically errs ~sqrt(K) of it; 1e-5
    # (100 dB) leaves two orders of magnitude for depth, while any real change of the
    # function (a weight off by 0.1 %) lands well above it.
    "exact": {"cosine_min": 0.99999, "rel_l2_max": 1e-5, "sqnr_min_db": 100.0},
    # Bounded numerical change: fp16 (unit roundoff 4.9e-4) or bf16 (3.9e-3) somewhere in the
    # model, tanh-GELU, Winograd. A bf16 network output typically sits at rel_l2 ~ 1e-2;
    # 3e-2 (~30 dB) passes that and fails a broken kernel. cosine 0.999 ~ rel_l2 0.045.
    "approx": {"cosine_min": 0.999, "rel_l2_max": 3e-2, "sqnr_min_db": 30.0},
    # Changes the function (pruning, int8 without calibration, MaxPool -> AvgPool): only the
    # direction of the output must survive. cosine 0.99 ~ rel_l2 0.14 ~ 17 dB.
    "lossy": {"cosine_min": 0.99, "rel_l2_max": 0.15, "sqnr_min_db": 16.0},
}

# budget name -> (field, comparison the user must write)
_BUDGET_KEYS: dict[str, tuple[str, str]] = {
    "cosine": ("cosine_min", ">="),
    "sqnr_db": ("sqnr_min_db", ">="),
    "sqnr": ("sqnr_min_db", ">="),
    "rel_l2": ("rel_l2_max", "<="),
    "max_abs": ("max_abs", "<="),
    "max_rel": ("max_rel", "<="),
}
_BUDGET_FORM = (
    "Write the budget as METRIC>=X or METRIC<=X, comma-separated, with cosine>= or "
    "sqnr_db>= and rel_l2<=, max_abs<= or max_rel<=, "
    "e.g. 'cosine>=0.9999,max_abs<=1e-3'."
)
_TERM = re.compile(r"^\s*([a-z_0-9]+)\s*(>=|<=|=>|=<|>|<|==|=)\s*([^\s]+)\s*$")


@dataclass(frozen=True)
class Tolerance:
    """Thresholds a candidate must meet; a None threshold is not checked.

    Non-finite values where the reference is finite always fail.
    """

    cosine_min: float | None = None
    rel_l2_max: float | None = None
    sqnr_min_db: float | None = None
    max_abs: float | None = None
    max_rel: float | None = None

    @classmethod
    def for_exactness(cls, exactness: str) -> Tolerance:
        """The default thresholds for rules of this exactness (exact, approx, lossy)."""
        try:
            return cls(**_DEFAULTS[exactness])
        except KeyError:
            raise VerificationError(
                f"Unknown exactness {exactness!r}; use exact, approx or lossy."
            ) from None

    def at_rounding(self, own_rel_l2: float | None, margin: float = 4.0) -> Tolerance:
        """These thresholds, loosened to what the model's own rounding allows.

        A float16/bfloat16 model run twice with the same math in another order (a folded
        BatchNorm, a fused kernel) differs by about its own rounding error, which in
        bfloat16 is 10^3 times float32's. `own_rel_l2` is the model's distance from its
        float32 self on the example (see `verify.rounding`); a candidate may differ from
        the reference by `margin` times that. None (a float32 model) changes nothing.
        """
        if own_rel_l2 is None or not own_rel_l2 > 0 or not math.isfinite(own_rel_l2):
            return self
        allowed = margin * own_rel_l2
        out = self
        if self.rel_l2_max is not None and allowed > self.rel_l2_max:
            out = replace(out, rel_l2_max=allowed)
        if self.sqnr_min_db is not None:
            out = replace(out, sqnr_min_db=min(self.sqnr_min_db, -20 * math.log10(allowed)))
        if self.cosine_min is not None:
            # 1 - cosine ~ rel_l2^2 / 2 for small uncorrelated noise; a factor 4 of slack
            out = replace(out, cosine_min=min(self.cosine_min, 1 - 2 * allowed * allowed))
        return out

    def with_budget(self, budget: str) -> Tolerance:
        """These thresholds with the ones `budget` names replaced."""
        return parse_budget(budget, base=self)

    def check(self, m: Metrics) -> tuple[bool, list[str]]:
        """(passed, reasons): one sentence per threshold `m` breaks."""
        reasons: list[str] = []
        if m.nonfinite:
            reasons.append(
                f"{m.nonfinite} NaN/Inf values in the candidate where the reference is finite"
            )
        if self.cosine_min is not None and not m.cosine >= self.cosine_min:
            reasons.append(f"cosine {m.cosine:.8f} is below {self.cosine_min}")
        if self.rel_l2_max is not None and not m.rel_l2 <= self.rel_l2_max:
            reasons.append(f"rel_l2 {m.rel_l2:.3g} is above {self.rel_l2_max:g}")
        if self.sqnr_min_db is not None and not m.sqnr_db >= self.sqnr_min_db:
            reasons.append(f"SQNR {m.sqnr_db:.1f} dB is below {self.sqnr_min_db:g} dB")
        if self.max_abs is not None and not m.max_abs <= self.max_abs:
            reasons.append(f"max_abs {m.max_abs:.3g} is above {self.max_abs:g}")
        if self.max_rel is not None and not m.max_rel <= self.max_rel:
            reasons.append(f"max_rel {m.max_rel:.3g} is above {self.max_rel:g}")
        return not reasons, reasons

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def __str__(self) -> str:
        parts = []
        for key, (fld, op) in _BUDGET_KEYS.items():
            v = getattr(self, fld)
            if v is not None and key != "sqnr":
                parts.append(f"{key}{op}{v:g}")
        return ",".join(parts) or "(no threshold)"


def parse_budget(budget: str, base: Tolerance | None = None) -> Tolerance:
    """'cosine>=0.9999,max_abs<=1e-4' -> `base` with those thresholds replaced.

    Without `base` only the named thresholds are checked. Raises VerificationError
    naming the accepted form for anything else.
    """
    if not isinstance(budget, str) or not budget.strip():
        raise VerificationError(f"Empty accuracy budget {budget!r}. {_BUDGET_FORM}")
    changes: dict[str, float] = {}
    for term in budget.split(","):
        if not term.strip():
            continue
        m = _TERM.match(term.lower())
        if not m:
            raise VerificationError(f"Cannot read the budget term {term.strip()!r}. {_BUDGET_FORM}")
        key, op, value = m.groups()
        if key not in _BUDGET_KEYS:
            raise VerificationError(f"Unknown metric {key!r} in the budget. {_BUDGET_FORM}")
        fld, want = _BUDGET_KEYS[key]
        op = {"=>": ">=", "=<": "<="}.get(op, op)
        if op != want:
            raise VerificationError(
                f"The budget term {term.strip()!r} bounds {key} from the wrong side or with "
                f"{op!r}; write {key}{want}X. {_BUDGET_FORM}"
            )
        try:
            x = float(value)
        except ValueError:
            raise VerificationError(
                f"{value!r} in the budget term {term.strip()!r} is not a number. {_BUDGET_FORM}"
            ) from None
        if math.isnan(x) or (key == "cosine" and not -1.0 <= x <= 1.0) or (op == "<=" and x < 0):
            raise VerificationError(
                f"The bound in {term.strip()!r} is out of range. {_BUDGET_FORM}"
            )
        changes[fld] = x
    if not changes:
        raise VerificationError(f"Empty accuracy budget {budget!r}. {_BUDGET_FORM}")
    return replace(base or Tolerance(), **changes)


def tolerance_for(
    exactness: str, budget: str | None = None, rounding: float | None = None
) -> Tolerance:
    """The tolerance a run verifies against: the exactness's thresholds, loosened to a
    low-precision model's own `rounding` (see `Tolerance.at_rounding`), with the user's
    `budget` on top (its thresholds are never loosened). Raises VerificationError for an
    unknown exactness or a budget it cannot read."""
    tol = Tolerance.for_exactness(exactness).at_rounding(rounding)
    return parse_budget(budget, base=tol) if budget else tol


def as_tolerance(spec: Tolerance | str | None, default: str = "exact") -> Tolerance:
    """A Tolerance from a Tolerance, an exactness name, a budget string or None (`default`)."""
    if spec is None:
        return Tolerance.for_exactness(default)
    if isinstance(spec, Tolerance):
        return spec
    if isinstance(spec, str) and spec in _DEFAULTS:
        return Tolerance.for_exactness(spec)
    if isinstance(spec, str):
        return parse_budget(spec)
    raise VerificationError(f"Expected a Tolerance, an exactness or a budget string, got {spec!r}.")
