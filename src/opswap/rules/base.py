"""The Rule: pattern -> check -> rewrite, with a prediction of what it saves.

A rule looks at an FX GraphModule (either capture flavour: FX leaves or ATen),
returns the places where it applies (`Site`) and the places where it nearly
applied with the reason it did not (`Miss`), rewrites one site at a time on a
graph it owns, and predicts the FLOPs and bytes a site saves from the cost model.

Sites are identified by a `key` built from node names. Node names are stable for
a given model and capture, so a plan written today re-applies tomorrow: `apply`
re-matches each rule on the current graph and looks the key up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Self

import torch.fx as fx

Exactness = Literal["exact", "approx", "lossy"]
EXACTNESS_ORDER: dict[str, int] = {"exact": 0, "approx": 1, "lossy": 2}
Phase = Literal["early", "main", "late"]
#: a plan runs every rule of one phase before any rule of the next (rules/order.py)
PHASES: tuple[str, ...] = ("early", "main", "late")


@dataclass(frozen=True)
class Site:
    """One place a rule applies.

    `nodes` are the names of the nodes the rewrite consumes or changes; two sites
    that share a node cannot both be applied from the same match (the planner keeps
    the first). `data` is rule-specific and JSON-serialisable.
    """

    rule: str
    key: str
    nodes: tuple[str, ...]
    description: str
    data: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "key": self.key,
            "nodes": list(self.nodes),
            "description": self.description,
            "data": self.data,
        }


OutcomeKind = Literal["miss", "failure", "skipped"]


@dataclass(frozen=True)
class Outcome:
    """A place a rule left as it was, and why, in a user's words: a `Miss` (the rule nearly
    applied), a `Failure` (a decision that could not be carried out) or a `Skipped` (a site
    the plan left out: predicted slower, rolled back, measured slower). `where` is the
    place a miss names, or the site's key. Each kind is a subclass that fixes `kind`, so
    that `Miss(rule, where, reason)` reads as it always did."""

    rule: str
    where: str
    reason: str
    kind: ClassVar[OutcomeKind]

    def to_json(self) -> dict[str, str]:
        """plan.json's and result.json's form: a miss says `where`, the others `key`."""
        return {"rule": self.rule, self._where_field(): self.where, "reason": self.reason}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Self:
        """The record `to_json` wrote (plan.json's form since its first version)."""
        fields = {"rule", cls._where_field(), "reason"}
        if not isinstance(data, dict) or set(data) != fields:
            raise TypeError(f"a {cls.kind} must hold exactly {', '.join(sorted(fields))}; "
                            f"got {data!r}")
        return cls(data["rule"], data[cls._where_field()], data["reason"])

    @classmethod
    def _where_field(cls) -> str:
        return "where" if cls.kind == "miss" else "key"


@dataclass(frozen=True)
class Miss(Outcome):
    """A place where a rule nearly applied, and why it did not."""

    kind: ClassVar[OutcomeKind] = "miss"


@dataclass(frozen=True)
class Failure(Outcome):
    """A decision that could not be carried out at site key `where`, and why."""

    kind: ClassVar[OutcomeKind] = "failure"


@dataclass(frozen=True)
class Skipped(Outcome):
    """A site (key `where`, or a count of sites) the plan left out, and why."""

    kind: ClassVar[OutcomeKind] = "skipped"


@dataclass(frozen=True)
class Estimate:
    """Predicted saving of one site, from the cost model (positive = saved)."""

    flops_saved: float = 0.0
    bytes_saved: float = 0.0
    time_saved_s: float | None = None
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "flops_saved": self.flops_saved,
            "bytes_saved": self.bytes_saved,
            "time_saved_s": self.time_saved_s,
            "note": self.note,
        }


class Rule:
    """Base class of every replacement. Subclasses set the class attributes and
    implement `match` and `rewrite`; `predict` defaults to "no change".

    Rules must be stateless: one instance serves every model. `rewrite` replaces
    tensors and modules (new Parameters, new submodules) and never writes into
    existing ones: that is what lets a failed rewrite be undone without copying the
    model's weights (rules/apply.py).
    """

    name: ClassVar[str]
    family: ClassVar[str]
    chapter: ClassVar[int]
    exactness: ClassVar[Exactness]
    targets: ClassVar[tuple[str, ...]] = ("any",)
    description: ClassVar[str] = ""
    #: where the rule runs in a plan: "late" for a change of the whole model's layout
    #: that must see every other rewrite done, "early" for clean-ups others rely on
    phase: ClassVar[Phase] = "main"
    #: rules (names or globs such as "fusion.*") that must run before this one when
    #: both are in a plan, because this rule matches what they leave behind
    after: ClassVar[tuple[str, ...]] = ()
    #: rules (names or globs) that must run after this one when both are in a plan
    before: ClassVar[tuple[str, ...]] = ()

    def match(self, gm: fx.GraphModule) -> list[Site | Miss]:
        raise NotImplementedError

    def rewrite(self, gm: fx.GraphModule, site: Site) -> None:
        raise NotImplementedError

    def predict(self, gm: fx.GraphModule, site: Site, target) -> Estimate:
        return Estimate(note="no prediction")

    # helpers for subclasses -------------------------------------------------------

    def site(self, key: str, nodes, description: str, **data) -> Site:
        names = tuple(n.name if isinstance(n, fx.Node) else str(n) for n in nodes)
        return Site(self.name, key, names, description, data)

    def scan(self, gm: fx.GraphModule, check, site_of) -> list[Site | Miss]:
        """The usual match loop. At each node `check(gm, node)` returns None (nothing close
        here), a str (why it nearly matched: a Miss at the node) or what it matched, which
        `site_of(node, matched)` turns into a Site."""
        found: list[Site | Miss] = []
        for node in gm.graph.nodes:
            checked = check(gm, node)
            if checked is None:
                continue
            found.append(self.miss(node, checked) if isinstance(checked, str)
                         else site_of(node, checked))
        return found

    def miss(self, where, reason: str) -> Miss:
        w = where.name if isinstance(where, fx.Node) else str(where)
        return Miss(self.name, w, reason)

    def applies_to(self, target_name: str) -> bool:
        return "any" in self.targets or target_name in self.targets

    @classmethod
    def info(cls) -> dict[str, Any]:
        return {
            "name": cls.name,
            "family": cls.family,
            "chapter": cls.chapter,
            "exactness": cls.exactness,
            "targets": list(cls.targets),
            "description": cls.description,
            "phase": cls.phase,
            "after": list(cls.after),
            "before": list(cls.before),
        }

    def __repr__(self) -> str:
        return f"<Rule {self.name} ({self.exactness})>"


def sites_of(found: list[Site | Miss]) -> list[Site]:
    return [f for f in found if isinstance(f, Site)]


def misses_of(found: list[Site | Miss]) -> list[Miss]:
    return [f for f in found if isinstance(f, Miss)]


def node_by_name(gm: fx.GraphModule, name: str) -> fx.Node | None:
    for n in gm.graph.nodes:
        if n.name == name:
            return n
    return None
