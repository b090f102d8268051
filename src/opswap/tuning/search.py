"""The joint search: which (rule, site, variant) choices, together, make the fastest model
within the accuracy budget (chapter 25).

The greedy planner takes every site a rule predicts to pay, one rule after another, in
the rules' declared order: a fusion that takes a node first keeps a later rule from a
better rewrite of it, and a site's prediction never sees the other sites. The search
starts from greedy's plan and moves in the space of the planner's own choices:

- a `Candidate` is a set of (rule, site key) pairs planning leaves out and a set it
  forces (tried first, taken even when predicted slower: a conv algorithm or a layer's
  precision the site race did not pick); planning again with them matches the sites
  that depend on a choice afresh, as rollback does;
- a candidate is judged on the whole model: `measure(plan)` applies it to a copy, times
  it and verifies it against the model (`Measurement`: seconds, an error figure, within
  the budget or not); plans that come out the same are measured once;
- local search flips one choice at a time (leave a decision out, force a skipped site,
  undo either) and moves when a neighbour is faster beyond the noise and within the
  budget; a decision that held a node another rule missed at is left out first, and
  when that rule's race then skips the freed site as predicted slower, the pair (left
  out, the freed site forced) is tried next, since neither flip alone shows the gain;
  then an evolutionary step crosses the choice sets of the best few and flips one
  more, until the evaluation budget is spent.

Every measured point is kept; the Pareto front of (latency, error) is reported, and the
budget picks its fastest point within it. Greedy is the first point, and it stays the
choice unless a point beats it by more than the noise, so the search never hands back
a slower plan than greedy's (within that noise).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from opswap.errors import OpswapError

Choice = tuple[str, str]  # (rule, site key)


class Plan(Protocol):
    """What the search reads of a plan: planner.Plan's decisions (`.rule`, `.site.key`,
    `.site.nodes`), skipped sites (`.rule`, `.where`, `.reason`) and misses (`.rule`,
    `.where`); tuning sits below the planner, so it names the fields, not the class."""

    @property
    def decisions(self) -> list[Any]: ...
    @property
    def skipped(self) -> list[Any]: ...
    @property
    def misses(self) -> list[Any]: ...


class SearchError(OpswapError):
    """The joint search was asked for something it cannot do."""


@dataclass(frozen=True)
class Candidate:
    """The choices planning is told: sites left out and sites forced."""

    excluded: frozenset[Choice] = frozenset()
    forced: frozenset[Choice] = frozenset()

    def flipped(self, choice: Choice, where: str) -> Candidate:
        """This candidate with `choice` toggled in `where` ("excluded" or "forced")."""
        mine = getattr(self, where)
        other = "forced" if where == "excluded" else "excluded"
        theirs = getattr(self, other) - {choice}  # a choice is either left out or forced
        new = mine - {choice} if choice in mine else mine | {choice}
        return Candidate(**{where: new, other: theirs})

    def describe(self) -> str:
        parts = [f"-{r}@{k}" for r, k in sorted(self.excluded)]
        parts += [f"+{r}@{k}" for r, k in sorted(self.forced)]
        return " ".join(parts) or "greedy"


@dataclass(frozen=True)
class Measurement:
    """A plan measured on the whole model: seconds per call, its error against the model
    (the verification's relative L2, worst over outputs and samples), within the budget."""

    latency_s: float
    error: float
    passed: bool
    noise: float = 0.0  # the timing's relative spread, when the timer knows it


@dataclass
class Point:
    """One evaluated plan."""

    candidate: Candidate
    decisions: tuple[Choice, ...]
    measurement: Measurement
    plan: Plan
    how: str  # greedy, local, evolve

    @property
    def latency_s(self) -> float:
        return self.measurement.latency_s

    @property
    def error(self) -> float:
        return self.measurement.error

    @property
    def passed(self) -> bool:
        return self.measurement.passed

    def to_json(self) -> dict[str, Any]:
        return {
            "choices": self.candidate.describe(),
            "decisions": len(self.decisions),
            "latency_ms": self.latency_s * 1e3,
            "error": self.error,
            "within_budget": self.passed,
            "how": self.how,
        }


@dataclass
class SearchResult:
    """Every point measured, the front, greedy's point and the one the budget picked."""

    greedy: Point
    chosen: Point
    points: list[Point]
    evaluations: int
    seconds: float
    noise: float
    notes: list[str] = field(default_factory=list)

    @property
    def front(self) -> list[Point]:
        return pareto_front(self.points)

    @property
    def kept_greedy(self) -> bool:
        return self.chosen is self.greedy

    @property
    def speedup(self) -> float:
        return self.greedy.latency_s / max(self.chosen.latency_s, 1e-30)

    def to_json(self) -> dict[str, Any]:
        front = self.front
        return {
            "evaluations": self.evaluations,
            "seconds": self.seconds,
            "noise": self.noise,
            "greedy": self.greedy.to_json(),
            "chosen": self.chosen.to_json(),
            "kept_greedy": self.kept_greedy,
            "speedup_over_greedy": self.speedup,
            "points": [
                {**p.to_json(), "on_front": p in front, "chosen": p is self.chosen, "index": i}
                for i, p in enumerate(self.points)
            ],
            "notes": self.notes,
        }


def pareto_front(points: Iterable[Point]) -> list[Point]:
    """The points no other point beats in both latency and error (ties kept once), by
    latency."""
    pts = sorted(points, key=lambda p: (p.latency_s, p.error))
    front: list[Point] = []
    best_error = float("inf")
    for p in pts:
        if p.error < best_error:
            front.append(p)
            best_error = p.error
    return front


def decision_set(plan: Plan) -> tuple[Choice, ...]:
    """What makes two plans the same model: their (rule, site key) decisions, in order."""
    return tuple((d.rule, d.site.key) for d in plan.decisions)


def _missed_at(plan: Plan, decision: Any) -> set[str]:
    """The other rules that missed at a node `decision` holds (a fusion that took a conv
    keeps the conv-algorithm race from it)."""
    return {
        m.rule for m in plan.misses if m.where in decision.site.nodes and m.rule != decision.rule
    }


def _blockers(plan: Plan) -> list[Choice]:
    """The decisions holding a node that another rule missed at: leaving one out is the
    move most likely to open a better rewrite."""
    return [(d.rule, d.site.key) for d in plan.decisions if _missed_at(plan, d)]


def _freed(before: Plan, after: Plan, blocker: Choice) -> list[Choice]:
    """The sites `after` (planned with `blocker` left out) skipped as predicted slower
    that `before` did not reach: those of the rules that missed at the blocker's nodes."""
    decision = next(d for d in before.decisions if (d.rule, d.site.key) == blocker)
    missed = _missed_at(before, decision)
    seen = {(s.rule, s.where) for s in before.skipped}
    return [
        (s.rule, s.where)
        for s in after.skipped
        if s.rule in missed
        and s.reason.startswith("predicted slower")
        and (s.rule, s.where) not in seen
    ]


def _neighbours(point: Point) -> list[tuple[Choice, str]]:
    """One-choice moves from `point`: leave out one of its decisions (first those that
    hold a node another rule missed at), force one of the sites its planning skipped as
    predicted slower, or undo one earlier choice."""
    moves: list[tuple[Choice, str]] = [(c, "excluded") for c in _blockers(point.plan)]
    moves += [(c, "excluded") for c in point.decisions]
    moves += [
        ((s.rule, s.where), "forced")
        for s in point.plan.skipped
        if s.reason.startswith("predicted slower")
    ]
    moves += [(c, "excluded") for c in sorted(point.candidate.excluded)]
    moves += [(c, "forced") for c in sorted(point.candidate.forced)]
    return list(dict.fromkeys(moves))


class _Search:
    def __init__(
        self,
        plan_for: Callable[[Candidate], Plan],
        measure: Callable[[Any], Measurement],
        evaluations: int,
        time_limit_s: float | None,
        seed: int,
    ) -> None:
        self.plan_for, self.measure = plan_for, measure
        self.evaluations, self.time_limit_s = evaluations, time_limit_s
        self.rng = random.Random(seed)
        self.start = time.perf_counter()
        self.points: list[Point] = []
        self.by_decisions: dict[tuple[Choice, ...], Point] = {}
        self.tried: set[Candidate] = set()

    def spent(self) -> bool:
        if len(self.points) >= self.evaluations:
            return True
        return (
            self.time_limit_s is not None and time.perf_counter() - self.start > self.time_limit_s
        )

    def evaluate(self, cand: Candidate, how: str) -> Point | None:
        """The point of `cand`: measured when its plan is new, else the earlier point."""
        if cand in self.tried or self.spent():
            return None
        self.tried.add(cand)
        plan = self.plan_for(cand)
        key = decision_set(plan)
        if key in self.by_decisions:
            return self.by_decisions[key]
        point = Point(cand, key, self.measure(plan), plan, how)
        self.points.append(point)
        self.by_decisions[key] = point
        return point


def _better(a: Point, b: Point, noise: float) -> bool:
    """`a` is within the budget, and `b` is not or is slower than `a` beyond the noise."""
    return a.passed and (not b.passed or a.latency_s < b.latency_s * (1.0 - noise))


def joint_search(
    plan_for: Callable[[Candidate], Plan],
    measure: Callable[[Any], Measurement],
    *,
    evaluations: int = 12,
    time_limit_s: float | None = None,
    noise: float = 0.03,
    population: int = 4,
    seed: int = 0,
    confirm: Callable[[Any, Any], float] | None = None,
) -> SearchResult:
    """Search the planner's choices for the fastest plan within the budget.

    `plan_for(candidate)` plans with the candidate's sites left out and forced;
    `measure(plan)` applies a plan to a copy of the model, times it and verifies it.
    At most `evaluations` plans are measured (greedy's included), and no new one after
    `time_limit_s`. A point replaces greedy only when it is faster by more than `noise`
    (a fraction of greedy's time), and, with `confirm(chosen plan, greedy plan)` (their
    time ratio from a longer side-by-side timing, the upper end of its interval where it
    has one), when that timing agrees."""
    if isinstance(evaluations, bool) or not isinstance(evaluations, int) or evaluations < 1:
        raise SearchError(
            f"The search budget must be a whole number of evaluations, at least 1; got "
            f"{evaluations!r}."
        )
    s = _Search(plan_for, measure, evaluations, time_limit_s, seed)
    greedy = s.evaluate(Candidate(), "greedy")
    assert greedy is not None  # the first evaluation always runs
    best = greedy
    # local search: first improvement, one choice at a time
    improved = True
    while improved and not s.spent():
        improved = False
        blockers = set(_blockers(best.plan))
        for choice, where in _neighbours(best):
            p = s.evaluate(best.candidate.flipped(choice, where), "local")
            if p is not None and _better(p, best, noise):
                best, improved = p, True
                break
            if p is None or choice not in blockers or where != "excluded":
                continue
            # a blocker left out frees its node for the rule that missed there; where that
            # rule's race then predicts its site slower, only forcing it tells
            for freed in _freed(best.plan, p.plan, choice):
                q = s.evaluate(p.candidate.flipped(freed, "forced"), "local")
                if q is not None and _better(q, best, noise):
                    best, improved = q, True
                    break
            if improved:
                break
    # evolution: cross the choice sets of the best few, then flip one more choice
    stale = 0
    while not s.spent() and stale < 20:
        parents = sorted((p for p in s.points if p.passed), key=lambda p: p.latency_s)
        parents = parents[:population] or [greedy]
        a, b = s.rng.choice(parents), s.rng.choice(parents)
        child = _cross(a.candidate, b.candidate, s.rng)
        moves = _neighbours(a if s.rng.random() < 0.5 else b)
        if moves:
            child = child.flipped(*s.rng.choice(moves))
        before = len(s.points)
        p = s.evaluate(child, "evolve")
        stale = stale + 1 if len(s.points) == before else 0
        if p is not None and _better(p, best, noise):
            best = p
    notes = []
    if best is not greedy and greedy.passed and confirm is not None:
        ratio = confirm(best.plan, greedy.plan)
        if not ratio < 1.0 - noise:
            notes.append(
                f"The search's best plan ({best.candidate.describe()}) timed up to "
                f"{ratio:.3f}x greedy's side by side (the interval's upper end), not faster "
                "beyond the noise: greedy's plan is kept."
            )
            best = greedy
    elif best is greedy:
        notes.append(
            f"No plan of the {len(s.points)} measured beat greedy's by more than "
            f"{noise:.0%} within the budget: greedy's plan is kept."
        )
    return SearchResult(
        greedy, best, s.points, len(s.points), time.perf_counter() - s.start, noise, notes
    )


def _cross(a: Candidate, b: Candidate, rng: random.Random) -> Candidate:
    """Each choice either parent made, taken from one parent or the other at random."""
    excluded = {
        c for c in a.excluded | b.excluded if rng.random() < 0.5 or a.excluded == b.excluded
    }
    forced = {c for c in a.forced | b.forced if rng.random() < 0.5 or a.forced == b.forced}
    return Candidate(frozenset(excluded), frozenset(forced - excluded))


def record_plan_time(
    db: Any,
    graph: Any,
    plan: Plan,
    inputs: tuple[Any, ...],
    device: str,
    seconds: float,
    noise: float,
) -> bool:
    """Write a whole plan's measured seconds to the tuning database `db` (a TuningDB), as
    a `plan-time` record keyed by the model's graph (planner.graph_fingerprint's hash of
    its ops and weight shapes, `graph` the capture), the plan's decision set, the inputs'
    shapes and dtype, the device and the versions. False when the database is off."""
    import hashlib
    import json

    import torch

    from opswap.tuning.db import Key
    from opswap.tuning.keys import device_name, versions

    h = hashlib.sha1()
    for n in graph.graph.nodes:  # a function by its name: its repr holds an address
        target = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
        h.update(f"{n.op}:{target or n.target};".encode())
    for name, t in list(graph.named_parameters()) + list(graph.named_buffers()):
        h.update(f"{name}:{tuple(t.shape)};".encode())
    decisions = json.dumps(decision_set(plan), separators=(",", ":"))
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    kind = "cuda" if device.startswith("cuda") else "cpu"
    key = Key(
        "plan-time",
        f"graph {h.hexdigest()[:16]}; plan {hashlib.sha1(decisions.encode()).hexdigest()[:16]}",
        tuple(tuple(int(d) for d in x.shape) for x in tensors),
        str(tensors[0].dtype).removeprefix("torch.") if tensors else "none",
        "",
        device_name(kind),
        versions(kind),
    )
    value = {"seconds": seconds, "decisions": [list(c) for c in decision_set(plan)]}
    return bool(db.put(key, value, samples=1, noise=noise))
