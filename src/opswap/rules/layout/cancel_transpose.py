"""layout.cancel_transpose: a chain of transposes becomes one permute, or nothing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch.fx as fx

from opswap.rules._cost import bytes_estimate
from opswap.rules._matching import compose, perm_of
from opswap.rules.base import Estimate, Found, Refused, Verdict
from opswap.rules.layout._base import (
    TRANSPOSE_KINDS,
    LayoutRule,
    chain_check,
    chain_found,
    fewer,
    replace_chain,
)
from opswap.rules.registry import register
from opswap.targets.base import Target


def _is_perm(node: fx.Node) -> bool:
    return perm_of(node) is not None


def _composed(chain: list[fx.Node]) -> Found | None:
    # every node of the chain passed _is_perm, so each has a permutation
    total = cast("list[int]", perm_of(chain[0]))
    for n in chain[1:]:
        total = compose(total, cast("list[int]", perm_of(n)))
    identity = total == sorted(total)
    if len(chain) == 1 and not identity:
        return None
    what = "cancel out" if identity else f"compose to permute{tuple(total)}"
    return chain_found(chain, what, {"perm": total, "identity": identity})


@register
class CancelTranspose(LayoutRule):
    name = "layout.cancel_transpose"
    training = True
    relieves = ("memory:data-movement",)
    description = (
        "Transpose/permute chains: one that composes to the identity is removed, any other "
        "becomes a single permute. Transposes are views, so this saves op dispatches, and a "
        "later copy no longer gathers a tensor that was only turned back."
    )
    anchors = TRANSPOSE_KINDS

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Verdict | Sequence[Found | Refused]:
        return chain_check(node, _is_perm, _composed)

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        identity = found["identity"]
        replace_chain(gm, found.nodes, None if identity else "permute", list(found["perm"]))

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        saved = len(found.nodes) - (0 if found["identity"] else 1)
        return bytes_estimate(
            0, target, f"transposes are views: no data moves; {fewer(saved)}", views_saved=saved
        )
