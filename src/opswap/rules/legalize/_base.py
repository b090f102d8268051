"""What the legalisation rules share: their family, chapter, exactness and target (see the
package's docstring), and the first step of matching a reduction."""

from __future__ import annotations

import torch.fx as fx

from opswap.graph.ops import arg
from opswap.graph.shapes import TensorInfo, info
from opswap.rules.base import Refused, Rule


class Legalize(Rule):
    """A legalisation rule: exact, offered for the edge targets only."""

    family = "legalize"
    chapter = 28
    exactness = "exact"
    targets = ("edge",)


def reduced(node: fx.Node, dims: object, what: str) -> tuple[fx.Node, TensorInfo] | Refused | None:
    """(x, its tensor info) for a reduction `node` of x over `dims` (read from the node by
    the caller, None where not a constant): None where x is not a node, Refused where its
    shape or the dims (`what` names them: "dim", "dims") are unknown."""
    x = arg(node, 0, "input")
    if not isinstance(x, fx.Node):
        return None
    xi = info(x)
    if xi is None or dims is None:
        verb = "are" if what.endswith("s") else "is"
        return Refused(f"the shape of {x.name} or the {what} of {node.name} {verb} unknown")
    return x, xi
