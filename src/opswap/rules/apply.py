"""Apply rules to a captured graph, one site at a time, rolling back a site that raises.

The captured graph module is already a private copy of the user's model
(`graph.capture` deep-copies), and `apply_plan` works on a further copy, so
neither the user's model nor the caller's capture is ever changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch.fx as fx

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


def rewrite_site(gm: fx.GraphModule, rule: Rule, found: Found) -> tuple[fx.GraphModule, str | None]:
    """Rewrite one match on gm. Returns (gm, None) on success; on failure gm is restored to
    what it was and the reason is returned."""
    snapshot = _Snapshot(gm)
    try:
        rule.rewrite(gm, found)
        eliminate_dead_code(gm)
        gm.graph.lint()
        gm.recompile()
        gm.delete_all_unused_submodules()
        return gm, None
    except Exception as e:  # a rule bug must not take the user's run down with it
        snapshot.restore(gm)
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return gm, f"{rule.name} raised {type(e).__name__}: {msg[:200]}".rstrip(": ")


def apply_sites(
    captured: Captured, decisions: list[tuple[Rule, Site]], *, progress=None
) -> Applied:
    """Carry out `(rule, site)` decisions in order on a copy of `captured`.

    Each site's anchor is checked again on the current graph (`Rule.replay`), so a
    decision whose site no longer exists (an earlier rewrite removed it, or the
    model changed since the plan was written) is reported, not guessed at.
    """
    gm = cast(fx.GraphModule, copy_module(captured.gm))
    out = Applied(captured.derived(gm))
    dirty = False
    last_rule = None
    for rule, site in decisions:
        if dirty and rule is not last_rule:
            # shapes of nodes created by the previous rule's rewrites, for this rule's checks
            captured.propagate(gm)
            dirty = False
        last_rule = rule
        found = rule.replay(gm, site)
        if isinstance(found, str):
            out.failed.append(Failure(rule.name, site.key, found))
        else:
            gm, err = rewrite_site(gm, rule, found)
            if err:
                out.failed.append(Failure(rule.name, site.key, err))
            else:
                out.applied.append(rule._site(found).kept())
                dirty = True
        if progress is not None:
            progress()
    if dirty:
        captured.propagate(gm)
    out.captured.gm = gm
    return out
