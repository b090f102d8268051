"""Layer by layer: where, inside the graph, does the candidate start to differ?

Both graphs run once on the same inputs under an fx.Interpreter that keeps every
node's output. Reference nodes are then paired with candidate nodes, first match
wins:

1. by name: rewrites leave the nodes they do not touch under their old names;
2. by consumer: a node that vanished (folded BatchNorm, fused activation) is
   paired with whatever the candidate feeds, at the same argument position, into
   a downstream node both graphs still share -- the value that replaced it;
3. by module path: the last node a module produced (call_module target for FX
   graphs, innermost `nn_module_stack` entry for torch.export graphs).

Nodes listed as `rewritten` (the nodes of applied sites) are never paired by name,
since a fused node may keep a name while computing something else: only their
consumer pairing, which compares the value the rest of the graph sees, is used.

Rows come in the reference's topological order, so the first row that breaks the
tolerance, or whose error jumps tenfold past everything before it, points at the
replacement that introduced the error.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from opswap.graph.capture import as_inputs
from opswap.graph.copies import preserved_state
from opswap.graph.inputs import fresh
from opswap.graph.ops import is_compute, op_kind
from opswap.verify.metrics import (
    RESOLUTION_NOTE,
    Metrics,
    combine,
    compare,
    shown,
    within_resolution,
)
from opswap.verify.outputs import full_precision, same_random
from opswap.verify.tolerance import Tolerance, as_tolerance

#: below this rel_l2 an error is float32 rounding (the `exact` tolerance), never a "jump"
JUMP_FLOOR = 1e-5


@dataclass
class LayerRow:
    """One reference node, the candidate node it was paired with, and their distance."""

    name: str
    module: str
    op: str
    metrics: Metrics | None
    candidate: str = ""
    paired_by: str = ""  # "name" | "consumer" | "module" | "" (unpaired)
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "module": self.module,
            "op": self.op,
            "candidate": self.candidate,
            "paired_by": self.paired_by,
            "note": self.note,
            "metrics": self.metrics.to_json() if self.metrics is not None else None,
        }


@dataclass
class Divergence:
    """The first row that breaks the tolerance ("tolerance") or jumps tenfold ("jump")."""

    index: int
    row: LayerRow
    kind: str
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "name": self.row.name,
            "module": self.row.module,
            "op": self.row.op,
            "kind": self.kind,
            "reason": self.reason,
        }

    def __str__(self) -> str:
        where = f" in module {self.row.module}" if self.row.module else ""
        return f"{self.row.name} ({self.row.op}{where}): {self.reason} [{self.kind}]"


@dataclass
class LayerReport:
    rows: list[LayerRow]
    only_in_reference: list[str] = field(default_factory=list)
    only_in_candidate: list[str] = field(default_factory=list)

    def first_divergence(
        self,
        tolerance: Tolerance | str | None = None,
        *,
        jump: float = 10.0,
        floor: float = JUMP_FLOOR,
    ) -> Divergence | None:
        """The first compared row that fails `tolerance` (default: exact), or whose rel_l2
        is above `floor` and at least `jump` times the largest rel_l2 of the rows before it."""
        tol = as_tolerance(tolerance)
        worst = 0.0
        for i, row in enumerate(self.rows):
            m = row.metrics
            if m is None:
                continue
            ok, why = tol.check(m)
            if not ok:
                return Divergence(i, row, "tolerance", "; ".join(why))
            if m.rel_l2 > floor and m.rel_l2 >= jump * worst:
                before = (
                    f"{m.rel_l2 / worst:.0f}x the largest before it ({worst:.3g})"
                    if worst > 0
                    else "the first error above rounding level"
                )
                return Divergence(i, row, "jump", f"rel_l2 {m.rel_l2:.3g} is {before}")
            worst = max(worst, m.rel_l2)
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "rows": [r.to_json() for r in self.rows],
            "only_in_reference": self.only_in_reference,
            "only_in_candidate": self.only_in_candidate,
        }

    def table(
        self, *, max_rows: int | None = None, mark: Divergence | None = None, unpaired: bool = True
    ) -> str:
        """A plain-text table of the compared rows (with `unpaired`, the unpaired rows are
        summarised below it)."""
        head = (
            f"{'#':>3}  {'node':<24} {'op':<14} {'module':<20} {'by':<8} "
            f"{'max_abs':>9} {'cosine':>12} {'sqnr_db':>8} {'rel_l2':>9}"
        )
        lines = [head, "-" * len(head)]
        shown_rows = [(i, r) for i, r in enumerate(self.rows) if r.metrics is not None]
        if max_rows is not None and len(shown_rows) > max_rows:
            shown_rows = shown_rows[:max_rows]
        for i, r in shown_rows:
            m = r.metrics
            assert m is not None  # shown holds only rows with metrics
            flag = " <--" if mark is not None and mark.index == i else ""
            lines.append(
                f"{i:>3}  {r.name[:24]:<24} {r.op[:14]:<14} {r.module[:20]:<20} "
                f"{r.paired_by:<8} {m.max_abs:>9.2e} {m.cosine:>12.9f} "
                f"{shown(m, 'sqnr_db', '.1f'):>8} {shown(m, 'rel_l2', '.2e'):>9}{flag}"
            )
        if any(within_resolution(r.metrics) for _, r in shown_rows if r.metrics is not None):
            lines.append(RESOLUTION_NOTE)
        if unpaired and self.only_in_reference:
            lines.append(f"only in the reference: {', '.join(self.only_in_reference)}")
        if unpaired and self.only_in_candidate:
            lines.append(f"only in the candidate: {', '.join(self.only_in_candidate)}")
        return "\n".join(lines)


# --------------------------------------------------------------------------- pairing

_PATH_NOISE = [
    (re.compile(r"^L\['self'\]\.?"), ""),
    (re.compile(r"^L__self__\.?"), ""),
    (re.compile(r"\._modules\['([^']+)'\]"), r".\1"),
    (re.compile(r"\[(\d+)\]"), r".\1"),
    (re.compile(r"^\.+"), ""),
]


def module_path(node: fx.Node) -> str:
    """The module a node belongs to ('' for the root module or none)."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    entry = list(stack.values())[-1]
    path = entry[0] if isinstance(entry, tuple) else str(entry)
    for pattern, repl in _PATH_NOISE:
        path = pattern.sub(repl, path)
    return path


def compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if is_compute(n)]


def _pair(ref: fx.GraphModule, cand: fx.GraphModule, rewritten: set[str]):
    """The reference compute nodes, and {ref node name: (cand node name, how paired)}."""
    ref_nodes = compute_nodes(ref)
    cand_by_name = {n.name: n for n in compute_nodes(cand)}
    last_ref: dict[str, str] = {}
    for n in ref_nodes:
        last_ref[module_path(n)] = n.name
    last_cand: dict[str, str] = {}
    for n in cand_by_name.values():
        last_cand[module_path(n)] = n.name
    last_ref.pop("", None)
    last_cand.pop("", None)

    pairs: dict[str, tuple[str, str]] = {}
    for n in ref_nodes:
        if n.name not in rewritten and n.name in cand_by_name:
            pairs[n.name] = (n.name, "name")
            continue
        found = None
        # untouched consumers first; then rewritten ones that still do the same kind of op
        # (a fused conv keeps reading the previous site's output as its input)
        users = sorted(n.users, key=lambda u: u.name in rewritten)
        for user in users:
            c_user = cand_by_name.get(user.name)
            if c_user is None or not is_compute(c_user):
                continue
            if user.name in rewritten and op_kind(c_user) != op_kind(user):
                continue
            r_in, c_in = user.all_input_nodes, c_user.all_input_nodes
            if len(r_in) == len(c_in) and n in r_in and c_in[r_in.index(n)].op != "get_attr":
                found = c_in[r_in.index(n)].name
                break
        if found is not None:
            pairs[n.name] = (found, "consumer")
            continue
        path = module_path(n)
        if n.name not in rewritten and path and last_ref.get(path) == n.name and path in last_cand:
            pairs[n.name] = (last_cand[path], "module")
    return ref_nodes, pairs


# --------------------------------------------------------------------------- running


def _tensors(value) -> list[torch.Tensor] | None:
    leaves = pytree.tree_leaves(value)
    if not leaves or not all(isinstance(x, torch.Tensor) for x in leaves):
        ts = [x for x in leaves if isinstance(x, torch.Tensor)]
        return ts or None
    return leaves


class Recorder(fx.Interpreter):
    """Runs a graph and hands selected nodes' outputs to `sink(name, tensors)`."""

    def __init__(self, gm: fx.GraphModule, wanted: set[str], sink):
        super().__init__(gm, garbage_collect_values=True)
        self.wanted, self.sink = wanted, sink

    def run_node(self, n: fx.Node):
        out = super().run_node(n)
        if n.name in self.wanted:
            ts = _tensors(out)
            if ts is not None:
                self.sink(n.name, ts)
        return out


def flat_args(gm: fx.GraphModule, inputs: tuple) -> tuple:
    codegen = gm.graph._codegen
    if isinstance(codegen, fx.graph._PyTreeCodeGen):  # torch.export graphs take flat inputs
        return tuple(codegen.process_inputs(*inputs))
    return tuple(inputs)


def compare_layers(
    reference, candidate, example_inputs, *, rewritten: Iterable[str] | None = None
) -> LayerReport:
    """Pair the nodes of two captures of one model and measure each pair on
    `example_inputs`; see the module docstring for the pairing.

    `reference` is a GraphModule or Captured; `candidate` a GraphModule, Captured or
    the Applied that `apply_plan` returned. `rewritten`: names of the reference nodes
    that applied sites consumed or changed, compared only through the value their
    consumers see; taken from `candidate.applied` when the candidate is an Applied.
    """
    ref_gm: fx.GraphModule = getattr(reference, "gm", reference)
    cand_gm: fx.GraphModule = getattr(candidate, "gm", candidate)
    if rewritten is None:
        rewritten = [n for site in getattr(candidate, "applied", ()) for n in site.nodes]
    inputs = as_inputs(example_inputs)
    rewritten = set(rewritten)
    ref_nodes, pairs = _pair(ref_gm, cand_gm, rewritten)

    wanted_cand: dict[str, list[str]] = {}
    for r, (c, _) in pairs.items():
        wanted_cand.setdefault(c, []).append(r)
    ref_values: dict[str, list[torch.Tensor]] = {}
    results: dict[str, Metrics | str] = {}

    def keep(name, ts):
        ref_values[name] = [t.detach().clone() for t in ts]  # later in-place ops must not reach it

    def measure(name, ts):
        for r in wanted_cand[name]:
            rv = ref_values.pop(r, None)
            if rv is None:
                continue
            if len(rv) != len(ts) or any(a.shape != b.shape for a, b in zip(rv, ts, strict=False)):
                results[r] = "shapes differ: " + ", ".join(str(tuple(t.shape)) for t in ts)
            else:
                results[r] = combine(compare(a, b) for a, b in zip(rv, ts, strict=True))

    with torch.no_grad(), full_precision(), preserved_state(ref_gm, cand_gm):
        with same_random(0):
            Recorder(ref_gm, set(pairs), keep).run(*flat_args(ref_gm, fresh(inputs)))
        with same_random(0):
            Recorder(cand_gm, set(wanted_cand), measure).run(*flat_args(cand_gm, fresh(inputs)))

    rows: list[LayerRow] = []
    only_ref: list[str] = []
    for n in ref_nodes:
        path, kind = module_path(n), op_kind(n)
        if n.name not in pairs:
            note = "rewritten; no counterpart" if n.name in rewritten else "only in the reference"
            rows.append(LayerRow(n.name, path, kind, None, note=note))
            if n.name not in rewritten:
                only_ref.append(n.name)
            continue
        c, how = pairs[n.name]
        res = results.get(n.name)
        if isinstance(res, Metrics):
            rows.append(LayerRow(n.name, path, kind, res, c, how))
        else:  # no tensor output, or a shape change
            rows.append(LayerRow(n.name, path, kind, None, c, how, res or "no tensor output"))
    paired_cand = {c for c, _ in pairs.values()}
    only_cand = [n.name for n in compute_nodes(cand_gm) if n.name not in paired_cand]
    return LayerReport(rows, only_ref, only_cand)
