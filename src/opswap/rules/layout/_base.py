"""What the layout rules share: the base class (prediction that survives an earlier
rewrite, sites from checks), the check result, and the chain walk used by the rules
that merge runs of view-like ops."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch.fx as fx

from opswap.graph.ops import copy_meta
from opswap.rules._edits import call, erase
from opswap.rules._matching import by_name
from opswap.rules.base import Estimate, Miss, Rule, Site


@dataclass
class Check:
    """The verdict on one candidate node: `ok` (the site's description) when it
    qualifies, else `why` (the miss reason); `data` goes into the site."""

    ok: str | None = None
    why: str | None = None
    data: dict = field(default_factory=dict)


def fewer(n: int) -> str:
    return f"{n} op dispatch{'es' if n != 1 else ''} fewer"


def chain_from(
    node: fx.Node, is_link: Callable[[fx.Node], bool]
) -> tuple[list[fx.Node] | None, tuple[fx.Node, str] | None]:
    """The longest chain of links starting at `node` whose intermediates have no other
    reader, and (next node, reason) when it stops early because one has; (None, None)
    when `node` is not a link or is inside a chain that starts earlier."""
    if not is_link(node):
        return None, None
    src = node.args[0]
    if isinstance(src, fx.Node) and is_link(src) and len(src.users) == 1:
        return None, None
    chain = [node]
    while True:
        cur = chain[-1]
        nxt = [u for u in cur.users if is_link(u) and u.args and u.args[0] is cur]
        if not nxt:
            return chain, None
        if len(cur.users) == 1:
            chain.append(nxt[0])
            continue
        others = ", ".join(u.name for u in cur.users if u is not nxt[0])
        return chain, (nxt[0], f"{cur.name}'s output is also read by {others}, so "
                               f"{cur.name} and {nxt[0].name} cannot be merged")


class LayoutRule(Rule):
    family = "layout"
    chapter = 14
    exactness = "exact"

    def _nodes(self, gm: fx.GraphModule, site: Site) -> list[fx.Node]:
        names = by_name(gm)
        missing = [n for n in site.nodes if n not in names]
        if missing:
            raise KeyError(f"{', '.join(missing)} no longer in the graph")
        return [names[n] for n in site.nodes]

    def predict(self, gm: fx.GraphModule, site: Site, target) -> Estimate:
        try:
            return self._predict(gm, site, target)
        except KeyError as e:  # an earlier rewrite of this pass removed the site's nodes
            return Estimate(note=f"not predicted: {e.args[0] if e.args else e}")

    def _predict(self, gm: fx.GraphModule, site: Site, target) -> Estimate:
        raise NotImplementedError

    def _verdicts(self, checks) -> list[Site | Miss]:
        """Sites and misses from (node, Check) pairs. A site covers the node and the node
        names in data["also"], keyed by data["key"] (default: the node's name)."""
        found: list[Site | Miss] = []
        for node, check in checks:
            if check is None:
                continue
            if check.ok:
                nodes = [node, *check.data.pop("also", [])]
                key = check.data.pop("key", node.name)
                found.append(self.site(key, nodes, check.ok, **check.data))
            else:
                found.append(self.miss(node, check.why))
        return found


def chain_sites(rule: LayoutRule, gm: fx.GraphModule, is_link, describe) -> list[Site | Miss]:
    """Sites for maximal single-reader chains of `is_link` nodes; `describe(chain)` returns
    a Check whose data says what the chain becomes."""
    found: list[Site | Miss] = []
    for node in gm.graph.nodes:
        chain, stop = chain_from(node, is_link)
        if chain is None:
            continue
        if stop:
            found.append(rule.miss(*stop))
        if not chain[-1].users:
            continue  # dead code: removed by the next clean-up anyway
        check = describe(chain)
        if check is None:
            continue
        if check.why:
            found.append(rule.miss(chain[-1], check.why))
        else:
            found.append(rule.site("+".join(n.name for n in chain), chain,
                                   f"{' -> '.join(n.name for n in chain)} {check.ok}",
                                   **check.data))
    return found


def replace_chain(gm: fx.GraphModule, chain: list[fx.Node], op: str | None, arg) -> None:
    """Make the chain's readers read `op(chain input, arg)`, or the input itself (op None)."""
    src, last = chain[0].args[0], chain[-1]
    if op is None:
        last.replace_all_uses_with(src)
    else:
        with gm.graph.inserting_after(last):
            new = call(gm.graph, last, op, (src, arg))
        copy_meta(new, last)
        last.replace_all_uses_with(new)
    erase(gm, chain)
