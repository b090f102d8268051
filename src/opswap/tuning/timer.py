"""Site timings through the tuning database: look up first, time on a miss, write back.

The planner opens a `site_scope` around each rule's prediction at a site; a rule times
candidates with its target's timer, and the timer `tuned` made looks the timing up under
the site's key (its signature, the candidates' names, the device and the versions)
before timing anything. Outside a scope (a race of the whole model's variants, a
benchmark) the timer times as it always did: those measurements are the user's
evidence and are never reused.

With a cost model and `top_k`, a site with more than `top_k` candidates besides the
first (the baseline every rule names first: PyTorch's conv, cuBLAS, "before") times only
the baseline and the `top_k` the model predicts fastest; the others read as infinitely
slow, so no rule picks a candidate nobody timed.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from opswap.targets.base import Target
from opswap.tuning.db import Key, TuningDB, TuningDBWarning
from opswap.tuning.features import site_features
from opswap.tuning.keys import Signature, device_name, signature, versions

Fns = dict[str, Callable[[], object]]


@dataclass(frozen=True)
class Measured:
    """Seconds per call of each function, how many timed rounds, and their spread (the
    largest interquartile range over the median of any function), None unknown."""

    times: dict[str, float]
    samples: int = 1
    noise: float | None = None


#: how a site's timing was found: "hit", "near" (another size's record), "miss" (timed)
@dataclass
class SiteTuning:
    """What the tuning database gave one site: its outcome and, for a near hit, the
    shapes of the record used; `pruned` names the candidates the cost model left untimed."""

    rule: str
    key: str
    outcome: str = ""
    near_shapes: list[list[int]] = field(default_factory=list)
    pruned: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rule": self.rule, "key": self.key, "outcome": self.outcome}
        if self.near_shapes:
            out["near_shapes"] = self.near_shapes
        if self.pruned:
            out["pruned"] = self.pruned
        return out


@dataclass
class Scope:
    """One site being predicted, its signature and features (worked out when first asked
    for: most rules time nothing), and what timing it needed."""

    site: SiteTuning
    gm: fx.GraphModule
    nodes: Sequence[fx.Node]
    target: Target
    calls: Counter[tuple[str, ...]] = field(default_factory=Counter)
    _sig: Signature | None = None
    _features: dict[str, Any] | None = None
    _tried: bool = False

    @property
    def sig(self) -> Signature:
        if self._sig is None:
            self._sig = signature(self.gm, self.nodes)
        return self._sig

    @property
    def features(self) -> dict[str, Any] | None:
        """The site's features, None when the cost model cannot read this site (an op
        whose FLOPs or bytes opswap.cost cannot count): its timing is kept without them."""
        if not self._tried:
            self._tried = True
            s = self.sig
            try:
                self._features = site_features(self.gm, self.nodes, s.shapes, s.dtype, self.target)
            except (RuntimeError, TypeError, ValueError, AttributeError, KeyError):
                self._features = None
        return self._features

    def note(self, outcome: str) -> None:
        """A site's outcome is its worst call's: a miss over a near over a hit."""
        order = ("", "hit", "near", "miss")
        if order.index(outcome) > order.index(self.site.outcome):
            self.site.outcome = outcome


_SCOPE: contextvars.ContextVar[Scope | None] = contextvars.ContextVar("tuning_scope", default=None)


@contextlib.contextmanager
def site_scope(
    rule: str, key: str, gm: fx.GraphModule, nodes: Sequence[fx.Node], target: Target
) -> Iterator[SiteTuning]:
    """Time the site made of `nodes` through the database while in this block; the
    SiteTuning yielded says afterwards what the timer found (outcome "" when nothing was
    timed)."""
    site = SiteTuning(rule, key)
    token = _SCOPE.set(Scope(site, gm, nodes, target))
    try:
        yield site
    finally:
        _SCOPE.reset(token)


class _Counter:
    """Timings made in this process by timers `tuned` made (misses and untuned calls)."""

    made = 0


def timings_made() -> int:
    """How many times a tuned timer has timed functions in this process."""
    return _Counter.made


Ranker = Callable[[dict[str, Any], list[str]], list[str] | None]


class TunedTimer:
    """A Timer that times with `measure`, through `db` inside a site scope, and logs what
    each site's timing was (`sites`, by (rule, site key)). `kind` is the device kind the
    measure runs on ("cpu" or "cuda"). With `top_k` and `ranker` (site features and
    candidate names -> the names fastest first, or None when it cannot rank), a site with
    more than `top_k` candidates besides the first times only the most promising."""

    def __init__(
        self,
        measure: Callable[[Fns], Measured],
        db: TuningDB | None,
        kind: str,
        top_k: int | None = None,
        ranker: Ranker | None = None,
    ):
        self.measure = measure
        self.db = db
        self.kind = kind
        self.top_k = top_k
        self.ranker = ranker
        self.sites: dict[tuple[str, str], SiteTuning] = {}
        self.made = 0

    def _measured(self, fns: Fns) -> Measured:
        _Counter.made += 1
        self.made += 1
        return self.measure(fns)

    def __call__(self, fns: Fns) -> dict[str, float]:
        scope = _SCOPE.get()
        if scope is None or self.db is None:
            return self._measured(fns).times
        self.sites.setdefault((scope.site.rule, scope.site.key), scope.site)
        names = tuple(fns)
        nth = scope.calls[names]
        scope.calls[names] += 1
        try:
            sig = scope.sig
        except (RuntimeError, TypeError, ValueError, AttributeError, KeyError):
            return self._measured(fns).times  # a site no key describes: timed, not kept
        op = f"{scope.site.rule} | {sig.op} | {','.join(names)}" + (f" #{nth}" if nth else "")
        device, soft = device_name(self.kind), versions(self.kind)
        key = Key("site-time", op, sig.shapes, sig.dtype, sig.layout, device, soft)
        rec = self.db.get(key)
        if rec is not None and isinstance(rec.value, dict):
            times, pruned = rec.value.get("times", {}), rec.value.get("pruned", [])
            # a record the cost model pruned serves only runs that prune too
            if set(times) | set(pruned) == set(names) and (not pruned or self.top_k):
                scope.note("hit" if rec.near is None else "near")
                if rec.near is not None:
                    scope.site.near_shapes = [list(s) for s in rec.key.shapes]
                scope.site.pruned = list(pruned)
                return {n: float(times[n]) if n in times else math.inf for n in names}
        keep = self._promising(names, scope.features)
        got = self._measured({n: fns[n] for n in keep})
        pruned = [n for n in names if n not in keep]
        value = {"times": got.times, "pruned": pruned, "features": scope.features}
        self.db.put(key, value, got.samples, got.noise)
        scope.note("miss")
        scope.site.pruned = pruned
        return {n: float(got.times[n]) if n in got.times else math.inf for n in names}

    def _promising(
        self, names: tuple[str, ...], features: dict[str, Any] | None
    ) -> tuple[str, ...]:
        k = self.top_k
        if k is None or self.ranker is None or features is None or len(names) <= k + 1:
            return names
        order = self.ranker(features, list(names[1:]))
        if order is None:
            return names
        chosen = set(order[:k])
        return (names[0], *(n for n in names[1:] if n in chosen))

    def summary(self) -> dict[str, Any]:
        """result.json's `tuning`: the file, the timings made, and each timed site's outcome."""
        sites = [s for s in self.sites.values() if s.outcome]
        count = Counter(s.outcome for s in sites)
        return {
            "db": str(self.db.path) if self.db is not None else None,
            "timings_made": self.made,
            "hits": count["hit"],
            "near": count["near"],
            "misses": count["miss"],
            "sites": [s.to_json() for s in sites],
        }


def tuned(
    measure: Callable[[Fns], Measured],
    db: TuningDB | None,
    kind: str,
    top_k: int | None = None,
    ranker: Ranker | None = None,
) -> TunedTimer:
    """A TunedTimer (see there)."""
    return TunedTimer(measure, db, kind, top_k, ranker)


def warn_once(message: str) -> None:
    """One warning per message per process (a cost model that cannot rank, say)."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, TuningDBWarning, stacklevel=3)


_WARNED: set[str] = set()
