"""norm.layer_norm: LayerNorm over the last dim (nn.LayerNorm, F.layer_norm,
aten.layer_norm, and what fusion.layer_norm makes of a written-out one) ->
`opswap::layer_norm`, one Triton kernel forward and one backward."""

from __future__ import annotations

import torch
import torch.fx as fx

from opswap.cost import NodeCost, node_cost
from opswap.graph.ops import arg, module_of, raw_name
from opswap.graph.shapes import info
from opswap.rules import _triton
from opswap.rules._edits import replace_with
from opswap.rules._matching import describe_source, setting
from opswap.rules.base import Estimate, Found, Refused
from opswap.rules.registry import register
from opswap.targets.base import Target


def _param(gm: fx.GraphModule, node: fx.Node, name: str, before: fx.Node) -> fx.Node | None:
    """A get_attr node for the LayerNorm module's parameter `name` (None if it has none)."""
    if getattr(module_of(node), name, None) is None:
        return None
    with gm.graph.inserting_before(before):
        return gm.graph.get_attr(f"{node.target}.{name}")


@register
class LayerNormTriton(_triton.TritonRule):
    """LayerNorm as one Triton kernel with fp32 math inside, as ATen's; exact (the row's
    sums run in another order). The gain over ATen's own kernel is mostly the backward
    (one kernel for dx, dw and db, mean and rstd recomputed from the row), which the
    crossover table measures."""

    name = "norm.layer_norm"
    family = "norm"
    chapter = 10
    relieves = ("memory:normalization",)
    anchors = ("layer_norm",)
    description = (
        "LayerNorm over the last dim -> opswap::layer_norm: one Triton kernel forward, one "
        "for dx, dw and db backward (CUDA)."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        if raw_name(node) == "native_layer_norm":
            return None  # returns (y, mean, rstd): a training graph's, not ours to take
        x = arg(node, 0, "input")
        if not isinstance(x, fx.Node):
            return None
        mod = module_of(node)
        eps = setting(node, "eps", 1e-5)
        if mod is not None:
            shape = tuple(getattr(mod, "normalized_shape", ()))
        else:
            shape = tuple(arg(node, 1, "normalized_shape", ()) or ())
            for i, name in ((2, "weight"), (3, "bias")):
                v = arg(node, i, name)
                if v is not None and not (isinstance(v, fx.Node) and v.op == "get_attr"):
                    return Refused(f"the {name} is {describe_source(v)}, not a constant")
        xi = info(x)
        if xi is None or not xi.shape:
            return Refused(f"the shape of {x.name} is unknown")
        if not xi.dtype.is_floating_point or xi.dtype == torch.float64:
            return Refused(f"{x.name} is {xi.dtype}; the kernel takes bfloat16, float16 or float32")
        if len(shape) != 1:
            return Refused(
                f"it normalises over the last {len(shape)} dims {list(shape)}; the kernel "
                "normalises the last one"
            )
        if isinstance(eps, fx.Node):
            return Refused(f"eps is {describe_source(eps)}, not a constant")
        rows = xi.numel // max(xi.shape[-1], 1)
        eps_f = float(eps)  # type: ignore[arg-type]  # a number: checked above
        return Found(
            (node,),
            f"{node.name}: LayerNorm of {x.name} over {xi.shape[-1]} -> opswap::layer_norm",
            dict(x=x, eps=eps_f, hidden=int(xi.shape[-1]), rows=int(rows), dtype=xi.dtype),
            record=dict(x=x.name, eps=eps_f),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        node = found.nodes[0]
        if node.op == "call_module":
            w = _param(gm, node, "weight", node)
            b = _param(gm, node, "bias", node)
        else:
            w, b = arg(node, 2, "weight"), arg(node, 3, "bias")
        op = torch.ops.opswap.layer_norm.default
        replace_with(gm, node, op, (found["x"], w, b, found["eps"]))

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        n, m, dtype = found["hidden"], found["rows"], found["dtype"]
        # one kernel for one: the forward moves what ATen's does (x in, y out), so the
        # roofline says parity; the measured table says more where it has an entry
        own = node_cost(found.nodes[0])
        return _triton.predict(
            target,
            "layer_norm",
            found.nodes,
            NodeCost(own.flops, own.bytes),
            dtype,
            n,
            m,
            f"LayerNorm at {m} x {n}, forward at parity with ATen's",
        )
