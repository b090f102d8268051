"""The learned cost model: gradient-boosted trees over roofline and shape features.

Every site timing in the tuning database keeps its site's features (features.py) beside
each candidate's seconds; `CostModel.train` fits LightGBM's gradient-boosted regression
trees to the log of those seconds, a row per (site, candidate), with the op kind, the
dtype and the candidate's name as categorical features. `rank` orders a new site's
candidates by predicted time, so that the planner times only the promising ones
(`OptimizeConfig.tuning_top_k`, `--tuning-top-k`).

LightGBM is an optional dependency (`pip install 'opswap[search]'`); without it the
model says so in one sentence and every candidate is timed, as without a model.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from opswap.errors import OpswapError
from opswap.tuning.db import TuningDB
from opswap.tuning.features import CATEGORICAL, NUMERIC
from opswap.tuning.timer import Ranker, warn_once

#: fewer (site, candidate) rows than this train no model: every candidate is timed
MIN_ROWS = 40
NO_LIGHTGBM = (
    "The learned cost model needs LightGBM (pip install 'opswap[search]'); "
    "every candidate is timed."
)
#: the trees' settings: small, because the database holds hundreds of rows, not millions
PARAMS: dict[str, Any] = {
    "objective": "regression",
    "learning_rate": 0.05,
    "num_leaves": 15,
    "min_data_in_leaf": 3,
    "min_data_per_group": 3,
    "cat_smooth": 1.0,
    "feature_fraction": 0.9,
    "deterministic": True,
    "num_threads": 1,
    "seed": 0,
    "verbose": -1,
}
ROUNDS = 300


def lightgbm_missing() -> str | None:
    """NO_LIGHTGBM when LightGBM is not installed, else None."""
    return NO_LIGHTGBM if importlib.util.find_spec("lightgbm") is None else None


@dataclass(frozen=True)
class Row:
    """One candidate's measured seconds at one site, with the site's features."""

    features: dict[str, Any]
    candidate: str
    seconds: float


def rows_of(db: TuningDB) -> list[Row]:
    """Every (site, candidate) timing in `db` that kept its site's features."""
    out = []
    for rec in db.records("site-time"):
        value = rec.value
        if not isinstance(value, dict) or not isinstance(value.get("features"), dict):
            continue
        for name, secs in value.get("times", {}).items():
            if isinstance(secs, int | float) and math.isfinite(secs) and secs > 0:
                out.append(Row(value["features"], name, float(secs)))
    return out


@dataclass
class CostModel:
    """Gradient-boosted trees predicting log seconds of a candidate at a site."""

    booster: Any
    #: each categorical feature's words, by the code the trees saw
    vocab: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def train(cls, rows: Sequence[Row]) -> CostModel:
        """Fit the trees to `rows`; an OpswapError when LightGBM is missing or too few rows."""
        missing = lightgbm_missing()
        if missing is not None:
            raise OpswapError(missing)
        if len(rows) < MIN_ROWS:
            raise OpswapError(
                f"The cost model needs at least {MIN_ROWS} timed candidates to train on; "
                f"the tuning database holds {len(rows)}."
            )
        import lightgbm as lgb
        import numpy as np

        vocab = {c: sorted({str(_cat(r, c)) for r in rows}) for c in CATEGORICAL}
        model = cls(None, vocab)
        x = np.array([model._vector(r.features, r.candidate) for r in rows], dtype=np.float64)
        y = np.log(np.array([r.seconds for r in rows], dtype=np.float64))
        cats = list(range(len(NUMERIC), len(NUMERIC) + len(CATEGORICAL)))
        data = lgb.Dataset(x, y, categorical_feature=cats, free_raw_data=False)
        model.booster = lgb.train(PARAMS, data, num_boost_round=ROUNDS)
        return model

    def _vector(self, features: dict[str, Any], candidate: str) -> list[float]:
        nums = [float(features.get(n, 0.0)) for n in NUMERIC]
        codes = []
        for c in CATEGORICAL:
            word = candidate if c == "candidate" else str(features.get(c, ""))
            words = self.vocab.get(c, [])
            codes.append(float(words.index(word)) if word in words else -1.0)  # unseen: NaN-like
        return nums + codes

    def predict(self, features: dict[str, Any], candidates: Iterable[str]) -> list[float]:
        """Predicted seconds of each candidate at the site with `features`."""
        import numpy as np

        names = list(candidates)
        x = np.array([self._vector(features, n) for n in names], dtype=np.float64)
        return [float(math.exp(v)) for v in self.booster.predict(x)]

    def rank(self, features: dict[str, Any], candidates: Iterable[str]) -> list[str]:
        """The candidates, predicted fastest first."""
        names = list(candidates)
        times = self.predict(features, names)
        return [n for _, n in sorted(zip(times, names, strict=True))]


def _cat(row: Row, name: str) -> Any:
    return row.candidate if name == "candidate" else row.features.get(name, "")


def ranker(db: TuningDB) -> Ranker:
    """A ranker for TunedTimer: trains a CostModel from `db` on first use (once per run);
    answers None (time every candidate) when LightGBM is missing, with its one sentence, or
    when the database holds too few timings yet."""
    state: dict[str, CostModel | None] = {}

    def rank(features: dict[str, Any], candidates: list[str]) -> list[str] | None:
        if "model" not in state:
            missing = lightgbm_missing()
            if missing is not None:
                warn_once(missing)
                state["model"] = None
            else:
                rows = rows_of(db)
                state["model"] = CostModel.train(rows) if len(rows) >= MIN_ROWS else None
        model = state["model"]
        return model.rank(features, candidates) if model is not None else None

    return rank


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation of two equally long sequences (ties share their mean
    rank); nan for fewer than two values or a constant sequence."""
    if len(a) != len(b):
        raise OpswapError(f"spearman needs sequences of one length; got {len(a)} and {len(b)}.")
    if len(a) < 2:
        return math.nan
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va = sum((x - ma) ** 2 for x in ra)
    vb = sum((y - mb) ** 2 for y in rb)
    return cov / math.sqrt(va * vb) if va > 0 and vb > 0 else math.nan


def _ranks(values: Sequence[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks
