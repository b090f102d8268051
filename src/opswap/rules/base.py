"""The Rule: anchors -> check -> rewrite, with a prediction of what it saves.

A rule names the op kinds its pattern starts from (`anchors`, in `op_kind`'s words, so
one rule serves both capture flavours: FX leaves and ATen) and answers one question
at each such node, `check(gm, node)`:

- `Found(nodes, description, **data)`: it applies here; `nodes` are what the rewrite
  consumes or changes, `data` everything the rewrite needs (nodes, tensors, numbers);
- `Refused(reason)`: it nearly applied, and the reason says why not in a user's words
  (falsy, like Inductor's `FailedMatch`);
- None: this node is not a candidate.

The base class owns the loop (`match`), and before a `Found` becomes a `Site` it
refuses, for every rule, what no rule may do: consume a value that something outside
the pattern also reads, drop an in-place write someone reads afterwards, or merge ops
across an in-place write into what they read. `rewrite(gm, found)` receives the match;
it neither looks nodes up again nor re-checks.

Sites are identified by a `key` built from node names, and remember their anchor's
name. Node names are stable for a given model and capture, so a plan written today
re-applies tomorrow: `replay` checks the site's anchor once on the current graph and
hands that `Found` to `rewrite`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Self

import torch.fx as fx

from opswap.graph.ops import op_kind
from opswap.graph.purity import writes_in_place
from opswap.rules._matching import Refused, may_alias_input, storage_root
from opswap.rules.pattern import Op

if TYPE_CHECKING:
    from opswap.targets.base import Target

Exactness = Literal["exact", "approx", "lossy"]
EXACTNESS_ORDER: dict[str, int] = {"exact": 0, "approx": 1, "lossy": 2}
Phase = Literal["early", "main", "late"]
#: a plan runs every rule of one phase before any rule of the next (rules/order.py)
PHASES: tuple[str, ...] = ("early", "main", "late")


class Found:
    """What a rule's check found at one anchor: the rewrite's input.

    `nodes` are the nodes the rewrite consumes or changes. The last of them (or every
    node in `outputs`) is what the pattern hands on; the others must have no reader
    outside `nodes`. Nodes in `kept` stay in the graph as they are (a change of layout
    around them, a softmax kept for its other readers): they may have other readers and
    may write in place. `key` defaults to the node names joined by "+". The keyword
    arguments, or the `data` dict, hold what the rewrite needs, by name (`found["conv"]`);
    `record` the JSON facts a plan keeps with the site.
    """

    def __init__(
        self,
        nodes: Iterable[fx.Node],
        description: str,
        data: dict[str, Any] | None = None,
        *,
        key: str = "",
        outputs: Iterable[fx.Node] = (),
        kept: Iterable[fx.Node] = (),
        record: dict[str, Any] | None = None,
        **more: Any,
    ):
        self.nodes = tuple(nodes)
        self.description = description
        self.data = {**(data or {}), **more}
        self.key = key or "+".join(n.name for n in self.nodes)
        self.outputs = tuple(outputs) or self.nodes[-1:]
        self.kept = tuple(kept)
        self.record = dict(record or {})
        self.anchor: fx.Node | None = None  # set by the rule's loop

    def __getitem__(self, name: str) -> Any:
        return self.data[name]

    def __repr__(self) -> str:
        return f"<Found {self.key}: {self.description}>"


#: what a check answers at one node
Verdict = Found | Refused | None


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
    #: the node the match starts from; "" in plans written before sites remembered it
    anchor: str = ""
    #: the match itself, while the graph it was found on is unchanged (never saved)
    found: Found | None = field(default=None, compare=False, hash=False, repr=False)

    def kept(self) -> Site:
        """This site without its match, as plans and results hold it (a match holds the
        graph it was found on)."""
        return dataclasses.replace(self, found=None)

    def to_json(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "key": self.key,
            "nodes": list(self.nodes),
            "description": self.description,
            "data": self.data,
            **({"anchor": self.anchor} if self.anchor else {}),  # plans from before have none
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
            raise TypeError(
                f"a {cls.kind} must hold exactly {', '.join(sorted(fields))}; got {data!r}"
            )
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
    #: for a rule that races candidates at the site (conv.algorithm): seconds per call of
    #: each, measured on the target and predicted by the roofline, by candidate name
    measured_s: dict[str, float] = field(default_factory=dict)
    predicted_s: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "flops_saved": self.flops_saved,
            "bytes_saved": self.bytes_saved,
            "time_saved_s": self.time_saved_s,
            "note": self.note,
            # only a raced site has them, so other plans read as they always did
            **({"measured_s": dict(self.measured_s)} if self.measured_s else {}),
            **({"predicted_s": dict(self.predicted_s)} if self.predicted_s else {}),
        }


class Rule:
    """Base class of every replacement. Subclasses set the class attributes, name the op
    kinds their pattern starts from in `anchors`, and implement `check` and `rewrite`;
    `predict` defaults to "no change".

    Rules must be stateless: one instance serves every model. `rewrite` replaces
    tensors and modules (new Parameters, new submodules) and never writes into
    existing ones: that is what lets a failed rewrite be undone without copying the
    model's weights (rules/apply.py).
    """

    name: ClassVar[str]
    #: the op the rule rewrites (norm, attention, activation, softmax, reduce, ...), the
    #: subpackage its file lives in; fusion, layout and precision are the cross-cutting
    #: families, for rewrites that span ops or change how every op runs
    family: ClassVar[str]
    chapter: ClassVar[int]
    exactness: ClassVar[Exactness]
    #: what the rewritten graph runs: "torch" (PyTorch's own ops), or the kind of kernel
    #: opswap installs ("triton"); an attribute, not a suffix of the name
    implementation: ClassVar[str] = "torch"
    targets: ClassVar[tuple[str, ...]] = ("any",)
    description: ClassVar[str] = ""
    #: the op kinds (`op_kind`) a match starts from; () checks every node
    anchors: ClassVar[tuple[str, ...]] = ()
    #: a fixed pattern (rules/pattern.py) for `check` to match; its root's kinds are
    #: the anchors unless the rule names its own
    pattern: ClassVar[Op | None] = None
    #: the bottlenecks a site relieves, as "bound:category" ("memory:elementwise"), which
    #: `opswap analyze` joins with the ops that spend the time (report/advice.py)
    relieves: ClassVar[tuple[str, ...]] = ()
    #: where the rule runs in a plan: "late" for a change of the whole model's layout
    #: that must see every other rewrite done, "early" for clean-ups others rely on
    phase: ClassVar[Phase] = "main"
    #: rules (names or globs such as "fusion.*") that must run before this one when
    #: both are in a plan, because this rule matches what they leave behind
    after: ClassVar[tuple[str, ...]] = ()
    #: rules (names or globs) that must run after this one when both are in a plan
    before: ClassVar[tuple[str, ...]] = ()
    #: whether the rewrite is valid in a model that trains (opswap.train.prepare plans
    #: only these): its ops have a backward that is exact to the function replaced, it
    #: keeps the model's Parameters as the parameters the graph reads (no folding into
    #: new tensors, no concatenating into new Parameters) and it keeps train-mode
    #: behaviour (dropout, BatchNorm's batch statistics). Opt-in: False unless a rule says
    training: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.pattern is not None and "anchors" not in cls.__dict__:
            cls.anchors = cls.pattern.kinds

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Verdict | Sequence[Found | Refused]:
        """Found, Refused or None at one anchor (a rule that finds several things at one
        node, such as a chain and where it stopped, may return a sequence of them)."""
        raise NotImplementedError

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        raise NotImplementedError

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        return Estimate(note="no prediction")

    # the loop, written once ---------------------------------------------------------

    def match(self, gm: fx.GraphModule) -> list[Site | Miss]:
        """Every Site and Miss of this rule on `gm`, in graph order."""
        writers = _Writers(gm)
        out: list[Site | Miss] = []
        for node in list(gm.graph.nodes):
            for verdict in self._verdicts(gm, node, writers):
                out.append(
                    self._site(verdict)
                    if isinstance(verdict, Found)
                    else self.miss(verdict.where or node, verdict.reason)
                )
        return out

    def replay(self, gm: fx.GraphModule, site: Site) -> Found | str:
        """The match for `site` on `gm` (its anchor checked once), or why there is none."""
        if (
            site.found is not None
            and site.found.anchor is not None
            and site.found.anchor.graph is gm.graph
        ):
            return site.found  # matched on this graph, which nothing has changed since
        if site.anchor:
            anchor = node_by_name(gm, site.anchor)
            verdicts = self._verdicts(gm, anchor, _Writers(gm)) if anchor is not None else []
        else:  # a plan from before sites kept their anchor: look the key up in a full match
            writers = _Writers(gm)
            verdicts = [
                v
                for node in list(gm.graph.nodes)
                for v in self._verdicts(gm, node, writers)
                if isinstance(v, Found)
            ]
        for v in verdicts:
            if isinstance(v, Found) and v.key == site.key:
                return v
        refused = [v.reason for v in verdicts if isinstance(v, Refused)]
        return f"no longer applies: {refused[0]}" if refused else "site not found in this model"

    def _verdicts(
        self, gm: fx.GraphModule, node: fx.Node, writers: _Writers
    ) -> list[Found | Refused]:
        if node.op not in ("call_function", "call_method", "call_module"):
            return []
        if self.anchors and op_kind(node) not in self.anchors:
            return []
        answer = self.check(gm, node)
        if answer is None or isinstance(answer, (Found, Refused)):
            answers: Iterable[Found | Refused | None] = [answer]
        else:
            answers = answer
        out: list[Found | Refused] = []
        for a in answers:
            if isinstance(a, Found):
                a.anchor = node
                why = unsafe(a, writers)
                out.append(Refused(why, node) if why else a)
            elif isinstance(a, Refused):
                out.append(a)
        return out

    # helpers for subclasses -------------------------------------------------------

    def _site(self, found: Found) -> Site:
        anchor = found.anchor.name if found.anchor is not None else ""
        return Site(
            self.name,
            found.key,
            tuple(n.name for n in found.nodes),
            found.description,
            dict(found.record),
            anchor,
            found,
        )

    def miss(self, where: fx.Node | str, reason: str) -> Miss:
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
            "implementation": cls.implementation,
            "targets": list(cls.targets),
            "description": cls.description,
            "anchors": list(cls.anchors),
            "phase": cls.phase,
            "after": list(cls.after),
            "before": list(cls.before),
            "training": cls.training,
        }

    def __repr__(self) -> str:
        return f"<Rule {self.name} ({self.exactness})>"


# --------------------------------------------------------------------------- the shared checks


class _Writers:
    """The graph's in-place writers and node order, computed once per match and only
    when the graph writes in place at all (an exported graph never does)."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.nodes = [n for n in gm.graph.nodes if writes_in_place(n)]
        self._order: dict[fx.Node, int] | None = None

    def order(self, node: fx.Node) -> int:
        if self._order is None:
            self._order = {n: i for i, n in enumerate(self.gm.graph.nodes)}
        return self._order.get(node, -1)


def _written(node: fx.Node) -> fx.Node | None:
    """The value an in-place node writes into (the storage behind its first argument)."""
    target = node.args[0] if node.args else node.kwargs.get("input")
    return storage_root(target) if isinstance(target, fx.Node) else None


def _readers(root: fx.Node) -> list[fx.Node]:
    """Nodes reading `root` or a view of it."""
    out, todo, seen = [], [root], set()
    while todo:
        cur = todo.pop()
        if cur in seen:
            continue
        seen.add(cur)
        for user in cur.users:
            out.append(user)
            if may_alias_input(user) and user.args and user.args[0] is cur:
                todo.append(user)
    return out


def unsafe(found: Found, writers: _Writers) -> str | None:
    """Why `found` may not be rewritten whatever the rule: it would drop an in-place write
    into an input or one read afterwards, a value it consumes is read outside the pattern,
    or an in-place write falls between its ops into a value they read. None when safe."""
    inside = set(found.nodes)
    merged = [n for n in found.nodes if n not in found.kept]
    for n in merged if writers.nodes else ():
        if not writes_in_place(n):
            continue
        root = _written(n)
        if root is None or root.op in ("placeholder", "get_attr"):
            what = "a model input" if root is None or root.op == "placeholder" else "a weight"
            return f"{n.name} writes into {what} in place, which a rewrite would not do"
        later = [u for u in _readers(root) if u is not n and writers.order(u) > writers.order(n)]
        if later:
            return (
                f"{n.name} writes into {root.name} in place, and {later[0].name} reads "
                f"{root.name} afterwards"
            )
    for n in found.nodes:
        if n in found.outputs or n in found.kept:
            continue
        others = [u for u in n.users if u not in inside]
        if others:
            names = ", ".join(u.name for u in others[:3])
            return (
                f"{n.name}'s output is also read by {names}, outside the ops this rewrite replaces"
            )
    if not writers.nodes:
        return None
    # a write between the pattern's ops into what they read: into anything they read when
    # ops merge, into the values they take from outside when every op is kept as it is
    first = min(writers.order(n) for n in found.nodes)
    last = max(writers.order(n) for n in found.nodes)
    outside = {storage_root(a) for n in found.nodes for a in n.all_input_nodes} - inside
    read = outside | (
        {storage_root(a) for n in merged for a in n.all_input_nodes} | set(merged)
        if len(merged) > 1
        else set()
    )
    for w in writers.nodes:
        if w in inside or not first < writers.order(w) < last:
            continue
        root = _written(w)
        if root in read:
            return (
                f"{w.name} writes into {root.name} in place between the ops this "
                "rewrite would merge"
            )
    return None


def sites_of(found: list[Site | Miss]) -> list[Site]:
    return [f for f in found if isinstance(f, Site)]


def misses_of(found: list[Site | Miss]) -> list[Miss]:
    return [f for f in found if isinstance(f, Miss)]


def node_by_name(gm: fx.GraphModule, name: str) -> fx.Node | None:
    node: fx.Node
    for node in gm.graph.nodes:
        if node.name == name:
            return node
    return None
