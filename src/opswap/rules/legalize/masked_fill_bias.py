"""legalize.masked_fill_bias: scores.masked_fill(mask, -inf) with a constant mask (a causal
mask buffer, sliced to the sequence) -> scores + a constant bias of 0 and -inf, sliced the
same way: an add, which XNNPACK delegates (it has no where)."""

from __future__ import annotations

import torch
import torch.fx as fx

from opswap.graph.ops import arg, attr_tensor, op_kind, raw_name
from opswap.graph.shapes import info
from opswap.rules._edits import new_const, replace_with
from opswap.rules.base import Estimate, Found, Refused
from opswap.rules.legalize._base import Legalize
from opswap.rules.registry import register
from opswap.targets.base import Target

#: ops a constant mask may pass through on its way to masked_fill (they read no input data)
_CHAIN = ("slice", "view", "unsqueeze", "expand", "transpose", "permute")


def _chain(gm: fx.GraphModule, mask: object) -> tuple[list[fx.Node], fx.Node] | str:
    """The layout ops from a constant boolean buffer to `mask` (in graph order) and the
    buffer's get_attr node, or why the mask is not such a constant."""
    chain: list[fx.Node] = []
    node = mask
    while isinstance(node, fx.Node) and node.op != "get_attr":
        if op_kind(node) not in _CHAIN or not node.args:
            return f"the mask is made by {node.name} ({op_kind(node)}), not a constant sliced"
        chain.append(node)
        node = node.args[0]
    if not isinstance(node, fx.Node):
        return "the mask is not a tensor of the model"
    t = attr_tensor(gm, node)
    if t is None or t.dtype != torch.bool:
        return f"the mask {node.target} is not a boolean constant"
    return chain[::-1], node


@register
class MaskedFillBias(Legalize):
    """x.masked_fill(mask, -inf) -> x + bias, bias = 0 where mask is False and -inf where it
    is True, built once from the mask buffer and read through the same slices.

    Exact for finite x: x + 0 is x and x + (-inf) is -inf, bit for bit. Only a fill of -inf
    is taken (x + c is not c for another c). masked_fill decomposes to where, which XNNPACK
    does not delegate; the add it takes, so the softmax and both attention matmuls stay in
    one delegate."""

    name = "legalize.masked_fill_bias"
    relieves = ("delegation:where",)
    anchors = ("where",)
    description = (
        "x.masked_fill(constant mask, -inf) -> x + a constant 0/-inf bias, an add XNNPACK "
        "delegates (it has no where)."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        name = raw_name(node)
        if name not in ("masked_fill", "masked_fill_"):
            return None
        if name.endswith("_"):
            return Refused(f"{node.name} fills in place; only masked_fill is rewritten")
        x, mask, value = arg(node, 0, "input"), arg(node, 1, "mask"), arg(node, 2, "value")
        if not isinstance(x, fx.Node):
            return None
        if not (isinstance(value, float) and value == float("-inf")):
            return Refused(f"{node.name} fills with {value!r}; only -inf is exact as an added bias")
        xi = info(x)
        if xi is None or not xi.dtype.is_floating_point:
            return Refused(f"{x.name} is not a floating-point tensor of known type")
        got = _chain(gm, mask)
        if isinstance(got, str):
            return Refused(got)
        chain, buffer = got
        return Found(
            (node,),
            f"{node.name}: masked_fill of {x.name} with -inf under {buffer.target} -> add of "
            "a 0/-inf bias",
            dict(x=x, chain=chain, buffer=buffer, dtype=xi.dtype),
            record=dict(x=x.name, mask=str(buffer.target)),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        node, buffer = found.nodes[0], found["buffer"]
        mask = attr_tensor(gm, buffer)
        assert mask is not None  # checked
        bias = torch.zeros(mask.shape, dtype=found["dtype"]).masked_fill(mask, float("-inf"))
        first = found["chain"][0] if found["chain"] else node
        at = new_const(gm, first, f"{str(buffer.target).replace('.', '_')}_bias", bias, False)
        copies: dict[fx.Node, fx.Node] = {buffer: at}
        with gm.graph.inserting_before(node):
            for n in found["chain"]:
                copies[n] = gm.graph.node_copy(n, lambda a: copies.get(a, a))
        end = copies[found["chain"][-1]] if found["chain"] else at
        replace_with(gm, node, "add.Tensor", (found["x"], end))

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        return Estimate(note="legalisation: the mask's where becomes an add the delegate takes")
