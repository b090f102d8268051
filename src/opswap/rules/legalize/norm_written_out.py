"""legalize.norm_written_out: LayerNorm and RMSNorm over the last dim (nn.LayerNorm,
nn.RMSNorm, F.layer_norm, F.rms_norm) of a 2-D to 4-D tensor written out with the 4-D means, subtractions,
products and rsqrt XNNPACK delegates (it has no layer_norm or rms_norm)."""

from __future__ import annotations

import torch
import torch.fx as fx

from opswap.graph.ops import arg, copy_meta, module_of, op_kind, raw_name
from opswap.graph.shapes import dynamic_dims, info
from opswap.rules._edits import call, replace_with
from opswap.rules._matching import describe_source, setting
from opswap.rules.base import Estimate, Found, Refused
from opswap.rules.legalize._base import Legalize
from opswap.rules.legalize._mean import mean_last
from opswap.rules.registry import register
from opswap.targets.base import Target


def _param(gm: fx.GraphModule, node: fx.Node, name: str) -> fx.Node | None:
    """A get_attr node for the norm module's parameter `name`, or None if it has none."""
    if getattr(module_of(node), name, None) is None:
        return None
    with gm.graph.inserting_before(node):
        return gm.graph.get_attr(f"{node.target}.{name}")


@register
class NormWrittenOut(Legalize):
    """LayerNorm: d = x - mean(x); y = d * rsqrt(mean(d * d) + eps) * w + b.
    RMSNorm:   y = x * rsqrt(mean(x * x) + eps) * w.

    Exact in math (the kernel's fp32 sums in another order, and rsqrt where ATen divides
    by sqrt). ExecuTorch's XNNPACK partitioner has no layer_norm or rms_norm config, so a
    norm op stays on the portable kernels and splits the delegate twice per transformer
    layer; written out with the 4-D mean (legalize.mean_4d's form) every op is XNNPACK's.
    Runs after fusion.layer_norm, which gathers a written-out LayerNorm into one op."""

    name = "legalize.norm_written_out"
    relieves = ("delegation:normalization",)
    anchors = ("layer_norm", "rms_norm")
    after = ("fusion.layer_norm",)
    description = (
        "LayerNorm/RMSNorm over the last dim -> written out with the 4-D mean, sub, mul and "
        "rsqrt XNNPACK delegates (it has no layer_norm or rms_norm)."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        if raw_name(node) in ("native_layer_norm", "_fused_rms_norm"):
            return None  # a tuple of outputs: a training graph's
        kind = op_kind(node)
        x = arg(node, 0, "input")
        if not isinstance(x, fx.Node):
            return None
        mod = module_of(node)
        if mod is not None:
            shape = tuple(getattr(mod, "normalized_shape", ()))
            eps = getattr(mod, "eps", None)
        else:
            shape = tuple(arg(node, 1, "normalized_shape", ()) or ())
            eps = setting(node, "eps", 1e-5 if kind == "layer_norm" else None)
            names = ((2, "weight"), (3, "bias")) if kind == "layer_norm" else ((2, "weight"),)
            for i, pname in names:
                v = arg(node, i, pname)
                if v is not None and not (isinstance(v, fx.Node) and v.op == "get_attr"):
                    return Refused(f"the {pname} is {describe_source(v)}, not a constant")
        xi = info(x)
        if xi is None or not xi.dtype.is_floating_point:
            return Refused(f"{x.name} is not a floating-point tensor of known shape")
        if len(shape) != 1:
            return Refused(f"{node.name} normalises over {list(shape)}; only the last dim is")
        if len(xi.shape) not in (2, 3, 4):
            return Refused(
                f"{x.name} has rank {len(xi.shape)}; the 4-D mean is written for rank 2 to 4"
            )
        if len(xi.shape) == 4 and 1 in dynamic_dims(x):
            return Refused(f"dim 1 of {x.name} varies; a rank-4 norm writes its size")
        if isinstance(eps, fx.Node):
            return Refused(f"eps is {describe_source(eps)}, not a constant")
        eps_f = float(torch.finfo(xi.dtype).eps) if eps is None else float(eps)
        return Found(
            (node,),
            f"{node.name}: {kind} of {x.name} over {xi.shape[-1]} written out for the delegate",
            dict(
                x=x,
                eps=eps_f,
                rank=len(xi.shape),
                rows=int(xi.shape[1]) if len(xi.shape) == 4 else None,
                kind=kind,
                hidden=int(xi.shape[-1]),
            ),
            record=dict(x=x.name, eps=eps_f, kind=kind),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        node, x, rank, g = found.nodes[0], found["x"], found["rank"], gm.graph
        rows = found["rows"]
        layer = found["kind"] == "layer_norm"
        if node.op == "call_module":
            w = _param(gm, node, "weight")
            b = _param(gm, node, "bias") if layer else None
        else:
            w = arg(node, 2, "weight")
            b = arg(node, 3, "bias") if layer else None
        with g.inserting_before(node):
            d = call(g, node, "sub.Tensor", (x, mean_last(g, node, x, rank, rows))) if layer else x
            sq = call(g, node, "mul.Tensor", (d, d))
            var = call(g, node, "add.Tensor", (mean_last(g, node, sq, rank, rows), found["eps"]))
            y = call(g, node, "mul.Tensor", (d, call(g, node, "rsqrt", (var,))))
            if w is not None:
                y = call(g, node, "mul.Tensor", (y, w))
        if b is not None:
            replace_with(gm, node, "add.Tensor", (y, b))
        else:
            _take(gm, node, y)

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        return Estimate(note="legalisation: the norm's ops move into the delegate")


def _take(gm: fx.GraphModule, node: fx.Node, new: fx.Node) -> None:
    """`new` takes over `node`'s readers and metadata; `node` goes."""
    copy_meta(new, node)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
