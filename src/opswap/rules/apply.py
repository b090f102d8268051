"""Apply rules to a captured graph, one site at a time, rolling back a site that raises.

The captured graph module is already a private copy of the user's model
(`graph.capture` deep-copies), and `apply_plan` works on a further copy, so
neither the user's model nor the caller's capture is ever changed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from opswap.graph.capture import Captured, copy_module, quiet_deepcopy
from opswap.graph.purity import eliminate_dead_code
from opswap.rules.base import Failure, Found, Rule, Site


@dataclass
class Applied:
    """The result of applying decisions: a new capture, and what happened to each one."""

    captured: Captured
    applied: list[Site] = field(default_factory=list)
    failed: list[Failure] = field(default_factory=list)

    @property
    def gm(self) -> fx.GraphModule:
        return self.captured.gm


class _Snapshot:
    """What a rewrite may change, kept without copying a single weight.

    Rules replace tensors and modules (a new Parameter, a new submodule) and never
    write into existing ones, so restoring the graph plus every module's parameter,
    buffer and child tables undoes any rewrite, at the cost of a graph copy instead of
    a copy of the model's weights (which made planning a 1B-parameter model impossible).
    """

    def __init__(self, gm: fx.GraphModule):
        self.graph = quiet_deepcopy(gm.graph)
        self.tables = [
            (m, dict(m._parameters), dict(m._buffers), dict(m._modules), set(m.__dict__))
            for m in gm.modules()
        ]

    def restore(self, gm: fx.GraphModule) -> None:
        for m, params, buffers, children, attrs in self.tables:
            for table, saved in (
                (m._parameters, params),
                (m._buffers, buffers),
                (m._modules, children),
            ):
                table.clear()
                table.update(cast("dict[str, Any]", saved))  # each saved copy of its table
            for extra in set(m.__dict__) - attrs:  # plain attributes a rewrite added
                delattr(m, extra)
        gm.graph = self.graph  # the setter re-links the graph to gm and recompiles


def rewrite_site(
    gm: fx.GraphModule, rule: Rule, found: Found, *, recompile: bool = True
) -> tuple[fx.GraphModule, str | None]:
    """Rewrite one match on gm. Returns (gm, None) on success; on failure gm is restored to
    what it was and the reason is returned. `recompile=False` rewrites and checks the graph
    but leaves gm's Python code to the caller (written once, after all its sites)."""
    snapshot = _Snapshot(gm)
    try:
        _rewrite(gm, rule, found, recompile)
        return gm, None
    except Exception as e:  # a rule bug must not take the user's run down with it
        snapshot.restore(gm)
        return gm, _why(rule, e)


def _rewrite(gm: fx.GraphModule, rule: Rule, found: Found, recompile: bool = False) -> None:
    rule.rewrite(gm, found)
    eliminate_dead_code(gm)
    gm.graph.lint()
    if recompile:
        gm.recompile()
    gm.delete_all_unused_submodules()


def _why(rule: Rule, e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{rule.name} raised {type(e).__name__}: {msg[:200]}".rstrip(": ")


class Redo(Exception):
    """A rewrite failed in a run of sites that shared one snapshot: the run's graph is back
    as it was before the run, and the run is to be made again site by site."""


class Run:
    """Rewrites of one rule's sites, one after another, on `gm`.

    Undoing a failed rewrite needs a copy of the graph from before it (`_Snapshot`), and
    for a large graph a copy costs tens of milliseconds. Rewrites rarely fail (a rule's
    bug, or a layout conversion that breaks a stride-sensitive op and refuses), so a run
    copies the graph once, before its first rewrite, and a failing rewrite puts the whole
    run back and raises Redo; the caller then makes the run again with `careful=True`,
    where each site has its own copy and a failure costs only that site.
    """

    def __init__(self, gm: fx.GraphModule, *, careful: bool = False, recompile: bool = False):
        self.gm = gm
        self.careful = careful
        self.recompile = recompile  # the code written after each site (careful runs only)
        self._snapshot: _Snapshot | None = None

    def rewrite(self, rule: Rule, found: Found) -> str | None:
        """None when the site is rewritten; why not, when careful; raises Redo otherwise."""
        if self.careful:
            self.gm, err = rewrite_site(self.gm, rule, found, recompile=self.recompile)
            return err
        if self._snapshot is None:
            self._snapshot = _Snapshot(self.gm)
        try:
            _rewrite(self.gm, rule, found)
        except Exception as e:
            self._snapshot.restore(self.gm)
            raise Redo(_why(rule, e)) from e
        return None


def _writes_code(gm: fx.GraphModule) -> bool:
    """Write gm's Python code from its graph, after rewrites made without it; False when
    the code could not be written."""
    try:
        gm.recompile()
        return True
    except Exception:
        return False


def apply_sites(
    captured: Captured,
    decisions: list[tuple[Rule, Site]],
    *,
    progress: Callable[[], None] | None = None,
    shapes: bool = True,
) -> Applied:
    """Carry out `(rule, site)` decisions in order on a copy of `captured`.

    Each site's anchor is checked again on the current graph (`Rule.replay`), so a
    decision whose site no longer exists (an earlier rewrite removed it, or the
    model changed since the plan was written) is reported, not guessed at. A site whose
    rewrite raises is reported and left as it was; the others are applied.

    The graph's code is written once, at the end; should that fail (a rewrite whose
    graph lints but whose code does not write), the sites are applied again with the code
    written after each, so that the failure is the site's that caused it.

    After each rule's run of sites the graph's shapes are propagated again (running it at
    the example and the probes), so that the next rule's checks read the new nodes';
    `shapes=False` skips that after the last run, for a caller that only runs the result
    (verification: on a large model each propagation is a few forward passes).
    """
    out = _apply_sites(captured, decisions, progress, each=False, shapes=shapes)
    if _writes_code(out.gm):
        return out
    return _apply_sites(captured, decisions, None, each=True, shapes=shapes)


def _runs(decisions: list[tuple[Rule, Site]]) -> list[tuple[Rule, list[Site]]]:
    """The decisions as runs of consecutive sites of one rule."""
    runs: list[tuple[Rule, list[Site]]] = []
    for rule, site in decisions:
        if runs and runs[-1][0] is rule:
            runs[-1][1].append(site)
        else:
            runs.append((rule, [site]))
    return runs


def _apply_sites(
    captured: Captured,
    decisions: list[tuple[Rule, Site]],
    progress: Callable[[], None] | None,
    *,
    each: bool,
    shapes: bool,
) -> Applied:
    """`each`: every site rewritten carefully and the code written after it."""
    gm = cast(fx.GraphModule, copy_module(captured.gm))
    out = Applied(captured.derived(gm))
    runs = _runs(decisions)
    for i, (rule, sites) in enumerate(runs):
        marks = (len(out.applied), len(out.failed))
        try:
            gm = _apply_run(rule, sites, out, Run(gm, careful=each, recompile=each))
        except Redo:
            del out.applied[marks[0] :], out.failed[marks[1] :]
            gm = _apply_run(rule, sites, out, Run(gm, careful=True, recompile=each))
        if len(out.applied) > marks[0] and (shapes or i < len(runs) - 1):
            # shapes of nodes the run's rewrites made, for the next rule's checks
            captured.propagate(gm)
        if progress is not None:
            for _ in sites:
                progress()
    if out.applied:
        keep_output_layouts(captured.gm, gm, propagated=shapes)
    out.captured.gm = gm
    return out


def _format(node: fx.Node) -> torch.memory_format | None:
    """The memory format a captured output is laid out in (its shape propagation's
    `tensor_meta`, or a traced `val`), when it is one of the two a caller relies on
    (contiguous, or channels-last for a 4-D one); None otherwise."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        if val.dim() < 3:
            return None
        if val.is_contiguous():
            return torch.contiguous_format
        if val.dim() == 4 and val.is_contiguous(memory_format=torch.channels_last):
            return torch.channels_last
        return None
    meta = node.meta.get("tensor_meta")
    fmt = getattr(meta, "memory_format", None)
    if meta is None or len(getattr(meta, "shape", ())) < 3:
        return None
    return fmt if fmt in (torch.contiguous_format, torch.channels_last) else None


def _same_producer(before: fx.GraphModule, b: fx.Node, after: fx.GraphModule, a: fx.Node) -> bool:
    """Whether `a` is still the capture's node `b`: same name, op and target, and for a
    module call the same kind of module (a swap keeps the name and puts another in)."""
    if (a.name, a.op, a.target) != (b.name, b.op, b.target):
        return False
    if a.op != "call_module":
        return True
    target = str(a.target)
    return type(before.get_submodule(target)) is type(after.get_submodule(target))


def keep_output_layouts(
    before: fx.GraphModule, after: fx.GraphModule, *, propagated: bool = False
) -> None:
    """Each output of `after` that a rewrite made returns in the memory format the capture's
    output (`before`) had: a rule whose kernel writes channels-last (int8 conv through
    oneDNN, a conv with a fused epilogue) at the model's last op would otherwise hand the
    caller strides its `.view()` refuses. `.contiguous(memory_format=...)` is a no-op for
    an output already so laid out; outputs the rewrites left alone are not touched, and with
    `propagated` (the shapes of `after` were propagated after its last rewrite) neither are
    those whose propagated layout is already the capture's."""
    outs = (
        [n for n in before.graph.nodes if n.op == "output"],
        [n for n in after.graph.nodes if n.op == "output"],
    )
    if len(outs[0]) != 1 or len(outs[1]) != 1:
        return
    old, new = (pytree.tree_leaves(o[0].args[0]) for o in outs)
    if len(old) != len(new):
        return
    output = outs[1][0]
    for b, a in zip(old, new, strict=True):
        if not isinstance(a, fx.Node) or not isinstance(b, fx.Node):
            continue
        if _same_producer(before, b, after, a):
            continue  # the capture's own node: its layout is the capture's
        fmt = _format(b)
        if fmt is None or (propagated and _format(a) == fmt):
            continue
        with after.graph.inserting_before(output):
            laid = after.graph.call_method("contiguous", (a,), {"memory_format": fmt})
        laid.meta.update({k: v for k, v in b.meta.items() if k in ("val", "tensor_meta")})
        output.replace_input_with(a, laid)


def _apply_run(rule: Rule, sites: list[Site], out: Applied, run: Run) -> fx.GraphModule:
    """Replay and rewrite `sites` in `run`, recording each in `out`."""
    for site in sites:
        found = rule.replay(run.gm, site)
        if isinstance(found, str):
            out.failed.append(Failure(rule.name, site.key, found))
        else:
            err = run.rewrite(rule, found)
            if err:
                out.failed.append(Failure(rule.name, site.key, err))
            else:
                out.applied.append(rule._site(found).kept())
    return run.gm
