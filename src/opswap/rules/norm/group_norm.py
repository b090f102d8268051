"""norm.group_norm: GroupNorm (nn.GroupNorm, F.group_norm, aten.group_norm) and
InstanceNorm from the input's own statistics (nn.InstanceNorm*d without running stats,
F.instance_norm, aten.instance_norm) -> `opswap::group_norm`, one Triton kernel forward
and one backward; InstanceNorm is its G = C case."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from opswap.cost import NodeCost, node_cost
from opswap.graph.ops import arg, module_of, raw_name
from opswap.graph.shapes import dynamic_dims, info
from opswap.kernels import crossover
from opswap.rules import _triton
from opswap.rules._edits import replace_with
from opswap.rules._matching import describe_source, setting
from opswap.rules.base import Estimate, Found, Refused
from opswap.rules.registry import register
from opswap.targets.base import Target


def _param(gm: fx.GraphModule, node: fx.Node, name: str, before: fx.Node) -> fx.Node | None:
    """A get_attr node for the norm module's parameter `name` (None if it has none)."""
    if getattr(module_of(node), name, None) is None:
        return None
    with gm.graph.inserting_before(before):
        return gm.graph.get_attr(f"{node.target}.{name}")


def _aten(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload)


def _settings(node: fx.Node) -> tuple[int | None, object, object, object] | str:
    """(num_groups or None for InstanceNorm's C, weight, bias, eps) of a GroupNorm or
    InstanceNorm call or module, or why it is not one the kernel computes."""
    mod = module_of(node)
    if isinstance(mod, nn.GroupNorm):
        return mod.num_groups, mod.weight, mod.bias, mod.eps
    if isinstance(mod, nn.modules.instancenorm._InstanceNorm):
        if mod.track_running_stats and not mod.training:
            return "it normalises with its running statistics; the kernel uses the input's"
        if mod.track_running_stats:
            return "it updates its running statistics (training mode)"
        return None, mod.weight, mod.bias, mod.eps
    if mod is not None:
        return f"it is a {type(mod).__name__}"
    if raw_name(node) == "group_norm":
        return (
            arg(node, 1, "num_groups"),
            arg(node, 2, "weight"),
            arg(node, 3, "bias"),
            setting(node, "eps", 1e-5),
        )
    # F.instance_norm(x, running_mean, running_var, weight, bias, use_input_stats, momentum,
    # eps) and aten.instance_norm(x, weight, bias, running_mean, running_var, ...): by name
    w, b = setting(node, "weight", None), setting(node, "bias", None)
    rm, rv = setting(node, "running_mean", None), setting(node, "running_var", None)
    use_input = setting(node, "use_input_stats", True)
    eps = setting(node, "eps", 1e-5)
    if rm is not None or rv is not None:
        return "it reads or updates running statistics"
    if use_input is not True:
        return "it does not normalise with the input's statistics"
    return None, w, b, eps


@register
class GroupNormTriton(_triton.TritonRule):
    """GroupNorm and InstanceNorm (from the input's statistics) as one Triton kernel with
    fp32 math inside, as ATen's; exact (the group's sums run in another order). Not
    measured on a GPU yet: on a CUDA target it is taken only where the crossover table
    says the kernel beats ATen's."""

    name = "norm.group_norm"
    family = "norm"
    chapter = 10
    relieves = ("memory:normalization",)
    anchors = ("group_norm", "instance_norm")
    description = (
        "GroupNorm and InstanceNorm without running stats -> opswap::group_norm: one Triton "
        "kernel forward, one for dx, dw and db backward (CUDA; only where measured faster)."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        if raw_name(node) == "native_group_norm":
            return None  # returns (y, mean, rstd): a training graph's, not ours to take
        if node.op == "call_function" and not (
            _aten(node) or node.target in (F.group_norm, F.instance_norm)
        ):
            return None
        x = arg(node, 0, "input")
        if not isinstance(x, fx.Node):
            return None
        got = _settings(node)
        if isinstance(got, str):
            return Refused(got)
        groups, w, b, eps = got
        if module_of(node) is None:
            for name, v in (("weight", w), ("bias", b)):
                if v is not None and not (isinstance(v, fx.Node) and v.op == "get_attr"):
                    return Refused(f"the {name} is {describe_source(v)}, not a constant")
        if isinstance(eps, fx.Node):
            return Refused(f"eps is {describe_source(eps)}, not a constant")
        if not isinstance(groups, (int, type(None))):
            return Refused(f"the group count is {describe_source(groups)}, not a constant")
        xi = info(x)
        if xi is None or len(xi.shape) < 2:
            return Refused(f"{x.name} has no channel dim [N, C, ...] (or its shape is unknown)")
        if not xi.dtype.is_floating_point or xi.dtype == torch.float64:
            return Refused(f"{x.name} is {xi.dtype}; the kernel takes bfloat16, float16 or float32")
        mod = module_of(node)
        if isinstance(mod, nn.modules.instancenorm._InstanceNorm) and (
            len(xi.shape) == mod._get_no_batch_dim()
        ):
            return Refused(f"{x.name} has no batch dim (the module adds one for it)")
        if 1 in dynamic_dims(x):
            return Refused(f"the channel count of {x.name} varies between calls")
        c = int(xi.shape[1])
        g = c if groups is None else int(groups)
        if g <= 0 or c % g:
            return Refused(f"{c} channels do not split into {g} groups")
        per_group = (c // g) * (xi.numel // max(xi.shape[0] * c, 1))
        what = "InstanceNorm" if groups is None else f"GroupNorm ({g} groups)"
        eps_f = float(eps)  # type: ignore[arg-type]  # a number: checked above
        return Found(
            (node,),
            f"{node.name}: {what} of {x.name} -> opswap::group_norm",
            dict(
                x=x,
                groups=g,
                eps=eps_f,
                weight=w,
                bias=b,
                group_size=int(per_group),
                groups_total=int(xi.shape[0]) * g,
                dtype=xi.dtype,
            ),
            record=dict(x=x.name, groups=g, eps=eps_f),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        node = found.nodes[0]
        if node.op == "call_module":
            w = _param(gm, node, "weight", node)
            b = _param(gm, node, "bias", node)
        else:
            w, b = found["weight"], found["bias"]
        args = (found["x"], found["groups"], w, b, found["eps"])
        replace_with(gm, node, torch.ops.opswap.group_norm.default, args)

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        n, m, dtype = found["group_size"], found["groups_total"], found["dtype"]
        note = f"GroupNorm at {m} groups x {n}"
        if getattr(target, "kind", "cpu") == "cuda":
            dev = crossover.device_class(target)
            if crossover.lookup("group_norm", dev, dtype, n, m) is None:
                # like attention.flash: an unmeasured kernel does not replace ATen's
                return Estimate(
                    0.0,
                    0.0,
                    -1e-9,
                    f"no measured crossover for group_norm at "
                    f"{crossover.shape_class(n, m)} on {dev} (none yet): ATen's GroupNorm is "
                    "kept until the kernel is measured faster",
                )
        own = node_cost(found.nodes[0])
        return _triton.predict(
            target, "group_norm", found.nodes, NodeCost(own.flops, own.bytes), dtype, n, m, note
        )
