"""What the layout rules share: the family's base class, and the chain walk of the rules
that merge runs of view-like ops."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch.fx as fx
from torch.fx.node import Argument

from opswap.graph.ops import copy_meta
from opswap.rules._edits import call, erase
from opswap.rules.base import Found, Refused, Rule, Verdict

#: the op kinds of a transpose-like node (those perm_of reads: transpose, t, x.T, x.mT, permute)
TRANSPOSE_KINDS = ("transpose", "permute")


class LayoutRule(Rule):
    family = "layout"
    chapter = 14
    exactness = "exact"


def fewer(n: int) -> str:
    return f"{n} op dispatch{'es' if n != 1 else ''} fewer"


def chain_from(
    node: fx.Node, is_link: Callable[[fx.Node], bool]
) -> tuple[list[fx.Node] | None, Refused | None]:
    """The longest chain of links starting at `node` whose intermediates have no other
    reader, and a refusal at the next link when it stops early because one has;
    (None, None) when `node` is not a link or is inside a chain that starts earlier."""
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
        return chain, Refused(
            f"{cur.name}'s output is also read by {others}, so "
            f"{cur.name} and {nxt[0].name} cannot be merged",
            nxt[0],
        )


def chain_check(
    node: fx.Node,
    is_link: Callable[[fx.Node], bool],
    describe: Callable[[list[fx.Node]], Verdict],
) -> list[Found | Refused] | None:
    """The verdicts on the maximal single-reader chain of links starting at `node`: where
    it stopped early, if it did, and `describe(chain)`'s verdict on the chain itself.
    None when `node` does not start a chain."""
    chain, stop = chain_from(node, is_link)
    if chain is None:
        return None
    out: list[Found | Refused] = [stop] if stop is not None else []
    if not chain[-1].users:
        return out  # dead code: removed by the next clean-up anyway
    verdict = describe(chain)
    if verdict is not None:
        out.append(verdict)
    return out


def chain_found(chain: list[fx.Node], what: str, record: dict[str, Any], **data: Any) -> Found:
    """The match of a whole chain: `what` says what it becomes; the rewrite reads `record`
    (JSON values, which the plan keeps) and `data`."""
    return Found(
        chain, f"{' -> '.join(n.name for n in chain)} {what}", {**record, **data}, record=record
    )


def replace_chain(
    gm: fx.GraphModule, chain: Sequence[fx.Node], op: str | None, arg: Argument
) -> None:
    """Make the chain's readers read `op(chain input, arg)`, or the input itself (op None)."""
    src, last = cast(fx.Node, chain[0].args[0]), chain[-1]
    if op is None:
        last.replace_all_uses_with(src)
    else:
        with gm.graph.inserting_after(last):
            new = call(gm.graph, last, op, (src, arg))
        copy_meta(new, last)
        last.replace_all_uses_with(new)
    erase(gm, chain)
