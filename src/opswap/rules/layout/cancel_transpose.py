"""layout.cancel_transpose: a chain of transposes becomes one permute, or nothing."""

from __future__ import annotations

import torch.fx as fx

from opswap.rules._cost import bytes_estimate
from opswap.rules._matching import compose, perm_of
from opswap.rules.base import Estimate, Miss, Site
from opswap.rules.layout._base import Check, LayoutRule, chain_sites, fewer, replace_chain
from opswap.rules.registry import register


def _is_perm(node: fx.Node) -> bool:
    return perm_of(node) is not None


def _composed(chain: list[fx.Node]) -> Check | None:
    total = perm_of(chain[0])
    for n in chain[1:]:
        total = compose(total, perm_of(n))
    identity = total == sorted(total)
    if len(chain) == 1 and not identity:
        return None
    what = "cancel out" if identity else f"compose to permute{tuple(total)}"
    return Check(what, data={"perm": total, "identity": identity})


@register
class CancelTranspose(LayoutRule):
    name = "layout.cancel_transpose"
    relieves = ("memory:data-movement",)
    description = (
        "Transpose/permute chains: one that composes to the identity is removed, any other "
        "becomes a single permute. Transposes are views, so this saves op dispatches, and a "
        "later copy no longer gathers a tensor that was only turned back."
    )

    def match(self, gm: fx.GraphModule) -> list[Site | Miss]:
        return chain_sites(self, gm, _is_perm, _composed)

    def rewrite(self, gm: fx.GraphModule, site: Site) -> None:
        identity = site.data["identity"]
        replace_chain(gm, self._nodes(gm, site), None if identity else "permute",
                       list(site.data["perm"]))

    def _predict(self, gm, site, target) -> Estimate:
        saved = len(site.nodes) - (0 if site.data["identity"] else 1)
        return bytes_estimate(0, target, f"transposes are views: no data moves; {fewer(saved)}",
                              views_saved=saved)
