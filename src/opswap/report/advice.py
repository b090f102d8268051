"""The rules half of a bottleneck sentence: which installed rules relieve an op's bottleneck.

cost.analyze says what bounds an op and what would help in general; each rule declares
the bottlenecks it relieves (`Rule.relieves`, "bound:category" keys such as
"memory:elementwise"). This module joins the two, so that a new rule is suggested by
`opswap analyze` from its own declaration, with nothing else to edit.
"""

from __future__ import annotations

import dataclasses
from typing import cast

import torch.fx as fx

from opswap.cost.analyze import Analysis, OpRow, bottleneck
from opswap.rules import registry
from opswap.rules.base import Miss, Rule, Site
from opswap.targets import Target


class RuleAdvice:
    """Names the rules that relieve a row's bottleneck on a target.

    With the costed graph `gm`, a rule is named only when one of its sites takes the
    row's node, and a miss at the node says why the rule does not take it (PReLU is an
    activation, but conv_relu takes only a ReLU). Without it, the rules are named by the
    op's bound and category alone. Each rule is matched once on the graph.
    """

    def __init__(self, gm: fx.GraphModule | None = None):
        self.gm = gm
        self._found: dict[str, list] = {}

    def _matches(self, rule: Rule) -> list:
        if rule.name not in self._found:
            # called only with a graph (__call__)
            self._found[rule.name] = rule.match(cast(fx.GraphModule, self.gm))
        return self._found[rule.name]

    def __call__(self, r: OpRow, target: Target) -> str:
        key = bottleneck(r)
        declared = [x for x in registry.all_rules() if key in x.relieves]
        have = [x for x in declared if x.applies_to(target.name) or x.applies_to(target.kind)]
        if not have:
            return f"no opswap rule does this{' on ' + target.name if declared else ''} yet"
        why_not: list[str] = []
        if self.gm is not None:
            taking = []
            for rule in have:
                found = self._matches(rule)
                if any(isinstance(f, Site) and r.name in f.nodes for f in found):
                    taking.append(rule)
                    continue
                why_not += [
                    f"{rule.name} does not take it ({f.reason.rstrip('.')})"
                    for f in found
                    if isinstance(f, Miss) and f.where == r.name
                ][:1]
            have = taking
        if have:
            names = [
                x.name
                + (
                    f" ({x.exactness}: plan it with --exactness {x.exactness})"
                    if x.exactness != "exact"
                    else ""
                )
                for x in have
            ]
            return f"opswap rules that do this where they match: {', '.join(names)}"
        if why_not:
            return f"no opswap rule does this here: {'; '.join(why_not)}"
        return f"no opswap rule does this for {r.op} yet"


def advised(analysis: Analysis) -> Analysis:
    """`analysis` whose bottleneck sentences also name the rules that would relieve each
    op where they match on its graph."""
    return dataclasses.replace(analysis, advice=RuleAdvice(analysis.gm))
