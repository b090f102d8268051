"""What "the numbers still match" means: thresholds on the metrics, by exactness or budget.

A rule declares its exactness (`exact`, `approx`, `lossy`); the tolerance a plan is
verified against follows the loosest exactness it allows, and a user budget
("cosine>=0.9999,max_abs<=1e-3") overrides single thresholds.

rel_l2 and SQNR carry the same information (sqnr_db = -20 log10(rel_l2)); both
exist so a budget can be stated in whichever unit the user thinks in, and the
defaults below keep them consistent. Cosine is the looser guard (for small,
uncorrelated noise 1 - cosine ~ rel_l2^2 / 2): it catches gross failures when a
user budget sets only a bound on absolute error.

Outputs whose rows are class scores (see `verify.decisions`) are held to more: their
error centred per row (log-probabilities and logits, where a common offset per row
carries no information) meets the same relative bound as the plain error, and the rows
whose top-1 class changes, or leaves the candidate's top 5, stay within a budget per
exactness: none beyond rounding ties for `exact`; 1% (top-5: 0.2%) for `approx`; 5% (1%)
for `lossy`. A class that leaves the top 5 moved far, and should be rarer than a swap of
two close classes at the top, hence the tighter top-5 budget. Budget terms `top1>=X`, `top5>=X` and
`centred_rel_l2<=X` set them; `top1>=0,top5>=0,centred_rel_l2<=inf` judges an output
by the plain metrics only (a regression head read as logits, see `verify.decisions`).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from opswap.errors import VerificationError
from opswap.verify.metrics import Metrics

if TYPE_CHECKING:
    from opswap.verify.decisions import Agreement

#: the relative size of a difference that counts as the reference's own rounding: a top-1
#: class that changes between two scores closer than twice this (relative to the larger) is
#: a tie, not a decision. Four units of float32 roundoff (6e-8) for the approx and lossy
#: levels; at the exact level, what the level lets a rewrite move a value (its rel_l2
#: bound); for a low-precision model, its own rounding (`Tolerance.at_rounding`)
ROUNDING_REL = 5e-7
#: rows judged for an agreement budget: enough to expect `_FLIPS` changed rows at the
#: budget's rate (1000 at 1%), at least `_MIN_ROWS` and at most `_MAX_ROWS`
_FLIPS, _MIN_ROWS, _MAX_ROWS = 10, 1000, 4096

_DEFAULTS: dict[str, dict[str, float]] = {
    # Same math, different rounding (folds, fusions, reordered reductions). float32's unit
    # roundoff is 6e-8 and a reordered sum of K terms typically errs ~sqrt(K) of it; 1e-5
    # (100 dB) leaves two orders of magnitude for depth, while any real change of the
    # function (a weight off by 0.1 %) lands well above it.
    "exact": {
        "cosine_min": 0.99999,
        "rel_l2_max": 1e-5,
        "sqnr_min_db": 100.0,
        "top1_min": 1.0,
        "top5_min": 1.0,
        "rounding_rel": 1e-5,
    },
    # Bounded numerical change: fp16 (unit roundoff 4.9e-4) or bf16 (3.9e-3) somewhere in the
    # model, tanh-GELU, Winograd. A bf16 network output typically sits at rel_l2 ~ 1e-2;
    # 3e-2 (~30 dB) passes that and fails a broken kernel. cosine 0.999 ~ rel_l2 0.045.
    # Class decisions: 1% of top-1 classes may change (int8 classifiers lose well under a
    # point of accuracy on trained models; random-weight ones, with small margins, flip more).
    "approx": {
        "cosine_min": 0.999,
        "rel_l2_max": 3e-2,
        "sqnr_min_db": 30.0,
        "top1_min": 0.99,
        "top5_min": 0.998,
    },
    # Changes the function (pruning, int8 without calibration, MaxPool -> AvgPool): only the
    # direction of the output must survive. cosine 0.99 ~ rel_l2 0.14 ~ 17 dB.
    "lossy": {
        "cosine_min": 0.99,
        "rel_l2_max": 0.15,
        "sqnr_min_db": 16.0,
        "top1_min": 0.95,
        "top5_min": 0.99,
    },
}

# budget name -> (field, comparison the user must write)
_BUDGET_KEYS: dict[str, tuple[str, str]] = {
    "cosine": ("cosine_min", ">="),
    "sqnr_db": ("sqnr_min_db", ">="),
    "sqnr": ("sqnr_min_db", ">="),
    "rel_l2": ("rel_l2_max", "<="),
    "max_abs": ("max_abs", "<="),
    "max_rel": ("max_rel", "<="),
    "centred_rel_l2": ("centred_rel_l2_max", "<="),
    "centered_rel_l2": ("centred_rel_l2_max", "<="),
    "top1": ("top1_min", ">="),
    "top5": ("top5_min", ">="),
}
_ALIASES = ("sqnr", "centered_rel_l2")  # accepted, not written
_BUDGET_FORM = (
    "Write the budget as METRIC>=X or METRIC<=X, comma-separated, with cosine>=, "
    "sqnr_db>=, top1>= or top5>= and rel_l2<=, centred_rel_l2<=, max_abs<= or max_rel<=, "
    "e.g. 'cosine>=0.9999,max_abs<=1e-3' or 'top1>=0.995'."
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
    #: rel_l2 bound on class scores centred per row; None: rel_l2_max (or SQNR's, if stricter)
    centred_rel_l2_max: float | None = None
    #: the fraction of rows whose top-1 class (top-5 set) must stay the same
    top1_min: float | None = None
    top5_min: float | None = None
    #: the relative difference that is rounding (ties of scores; the floor of the centred
    #: error): see ROUNDING_REL and `at_rounding`
    rounding_rel: float = ROUNDING_REL

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
        if self.centred_rel_l2_max is not None and allowed > self.centred_rel_l2_max:
            out = replace(out, centred_rel_l2_max=allowed)
        # a top-1 class the model's own rounding can change is a tie, whatever the level
        return replace(out, rounding_rel=max(self.rounding_rel, allowed))

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

    def centred_limit(self) -> float | None:
        """The rel_l2 bound on outputs centred per row: the budget's own term, else the
        plain rel_l2 bound or the one the SQNR bound implies, whichever is stricter."""
        if self.centred_rel_l2_max is not None:
            return self.centred_rel_l2_max
        bounds = [self.rel_l2_max] if self.rel_l2_max is not None else []
        if self.sqnr_min_db is not None and math.isfinite(self.sqnr_min_db):
            bounds.append(10 ** (-self.sqnr_min_db / 20))
        return min(bounds) if bounds else None

    def check_centred(self, centred: Metrics, plain: Metrics, offset: float) -> list[str]:
        """Reasons `centred` (an output's metrics centred per row) breaks the centred bound.

        `offset` is the largest ratio ||ref|| / ||ref centred|| over the samples: an error
        the plain bound calls rounding is `offset` times larger once centred, and is never
        a failure here (so an exact plan is judged by its plain metrics alone)."""
        limit = self.centred_limit()
        if limit is None or not centred.numel:
            return []
        floor = self.rounding_rel * offset if math.isfinite(offset) else math.inf
        if centred.rel_l2 <= max(limit, floor):
            return []
        return [
            f"centred per row, rel_l2 {centred.rel_l2:.3g} is above {limit:g} (the offset "
            f"common to each row hides it from the plain rel_l2 {plain.rel_l2:.3g})"
        ]

    def check_agreement(self, found: Agreement) -> list[str]:
        """Reasons the rows whose top-k classes changed break the top1/top5 budget."""
        bound = self.top1_min if found.k == 1 else self.top5_min if found.k == 5 else None
        if bound is None or not found.rows or found.agreement >= bound:
            return []
        what = "top-1 class changed" if found.k == 1 else f"top-1 class left the top {found.k}"
        budget = (
            "budget: none beyond rounding ties"
            if bound >= 1.0
            else f"budget {100 * (1 - bound):.3g}%"
        )
        return [
            f"{what} on {100 * found.changed / found.rows:.2g}% of {found.rows} rows ({budget})"
        ]

    def decision_rows(self, settle: bool = False) -> int:
        """Rows to judge class scores on: 0 when the top-1 budget (else the top-5 one)
        allows no changed row (exact: the samples are enough to see one) or any number
        (a bound of 0), else enough to expect 10 changed rows at its rate, 1000 to 4096
        (fewer where `decided` says so first); with `settle`, 4096 (for a rate
        `unsettled` calls too close to the budget to tell)."""
        bound = self.top1_min if self.top1_min is not None else self.top5_min
        if bound is None or not 0 < bound < 1:
            return 0
        return (
            _MAX_ROWS if settle else max(_MIN_ROWS, min(_MAX_ROWS, math.ceil(_FLIPS / (1 - bound))))
        )

    def decided(self, found: Agreement) -> bool:
        """Whether the rows so far settle the top-1 budget either way: none changed on
        enough rows that a rate at the budget would have shown one with 95% probability
        (3 / budget rows: 300 at 1%), or more changed than the budget allows on 4096 rows."""
        if self.top1_min is None or not 0 < self.top1_min < 1:
            return False
        budget = 1 - self.top1_min
        if found.changed == 0:
            return found.rows >= 3 / budget
        return found.changed > budget * _MAX_ROWS

    def unsettled(self, found: Agreement) -> bool:
        """Whether the rate of rows whose top-1 class changed lies within two standard
        errors of the budget (at 1% and 1000 rows: between 0.37% and 1.63%), so that more
        rows are needed to tell which side it is on."""
        bound = self.top1_min if found.k == 1 else None
        if bound is None or bound >= 1 or not found.rows:
            return False
        budget = 1 - bound
        spread = math.sqrt(budget * (1 - budget) / found.rows)
        return abs(found.changed / found.rows - budget) < 2 * spread

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def __str__(self) -> str:
        parts = []
        for key, (fld, op) in _BUDGET_KEYS.items():
            v = getattr(self, fld)
            if v is not None and key not in _ALIASES:
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
        if (
            math.isnan(x)
            or (key == "cosine" and not -1.0 <= x <= 1.0)
            or (key in ("top1", "top5") and not 0.0 <= x <= 1.0)
            or (op == "<=" and x < 0)
        ):
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
