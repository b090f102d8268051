"""The order a plan runs its rules in, from what each rule declares.

A rule says which rules must run before it (`after`) and which after it (`before`),
by name or by glob ("fusion.*"), and which phase it belongs to ("early", "main",
"late"). Constraints name rules, not positions: one that names a rule left out of
the plan is ignored. Every rule of a phase runs before any rule of a later phase.
Among the orders that satisfy all that, the one chosen puts the rule with the
lowest (phase, chapter, name) first at every step, so adding a rule that declares
nothing never moves the others.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import Protocol, TypeVar

from opswap.errors import RuleError
from opswap.rules.base import PHASES
from opswap.rules.registry import matches


class Declares(Protocol):
    """What the order is made from: the PyTorch rules (rules.base.Rule) and the ONNX
    rules (onnx.rule.OnnxRule) both declare it."""

    @property
    def name(self) -> str: ...
    @property
    def chapter(self) -> int: ...
    @property
    def phase(self) -> str: ...
    @property
    def after(self) -> tuple[str, ...]: ...
    @property
    def before(self) -> tuple[str, ...]: ...


R = TypeVar("R", bound=Declares)


def _named(patterns: Iterable[str], rules: list[R], me: R) -> list[R]:
    """The rules `patterns` name (by name or glob, old names of renamed rules included)."""
    return [r for r in rules if r is not me and any(matches(r.name, p) for p in patterns)]


def _edges(rules: list[R]) -> dict[str, dict[str, str]]:
    """{first: {then: why}}: `first` must run before `then`, with the declaration that
    says so (for the error message of a cycle)."""
    edges: dict[str, dict[str, str]] = {r.name: {} for r in rules}
    rank = {r.name: PHASES.index(r.phase) for r in rules}
    for r in rules:
        for a in _named(r.after, rules, r):
            edges[a.name].setdefault(r.name, f"{r.name} declares after={list(r.after)}")
        for b in _named(r.before, rules, r):
            edges[r.name].setdefault(b.name, f"{r.name} declares before={list(r.before)}")
        for other in rules:
            if rank[other.name] > rank[r.name]:
                edges[r.name].setdefault(
                    other.name,
                    f"{r.name} is in phase {r.phase!r}, {other.name} in phase {other.phase!r}",
                )
    return edges


def _cycle(edges: dict[str, dict[str, str]], left: set[str]) -> list[str]:
    """One cycle among the rules `left` (each still waits on another of them)."""
    preds = {n: [m for m in left if n in edges[m]] for n in left}
    path, seen = [min(left)], {}
    while path[-1] not in seen:
        seen[path[-1]] = len(path) - 1
        path.append(min(preds[path[-1]]))
    loop = path[seen[path[-1]] : -1]
    return loop[::-1]  # in run order: each must run before the next


def ordered(rules: Iterable[R]) -> list[R]:
    """`rules` in the order a plan runs them; RuleError when the declarations conflict."""
    rules = list({r.name: r for r in rules}.values())
    for r in rules:
        if r.phase not in PHASES:
            raise RuleError(f"Rule {r.name} has phase {r.phase!r}; use one of {', '.join(PHASES)}.")
    by_name = {r.name: r for r in rules}
    edges = _edges(rules)
    waiting = {r.name: 0 for r in rules}
    for first in edges:
        for then in edges[first]:
            waiting[then] += 1

    def key(name: str) -> tuple[int, int, str]:
        r = by_name[name]
        return (PHASES.index(r.phase), r.chapter, r.name)

    ready = [key(n) for n, k in waiting.items() if k == 0]
    heapq.heapify(ready)
    out: list[R] = []
    while ready:
        name = heapq.heappop(ready)[2]
        out.append(by_name[name])
        for then in edges[name]:
            waiting[then] -= 1
            if waiting[then] == 0:
                heapq.heappush(ready, key(then))
    if len(out) < len(rules):
        loop = _cycle(edges, {n for n, k in waiting.items() if k > 0})
        steps = "; ".join(
            f"{a} before {b} ({edges[a][b]})"
            for a, b in zip(loop, loop[1:] + loop[:1], strict=True)
        )
        raise RuleError(
            f"The rules' ordering declarations form a cycle: {steps}. "
            "Drop one of these after/before declarations."
        )
    return out
