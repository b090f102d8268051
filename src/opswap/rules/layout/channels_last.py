"""layout.channels_last: run a CNN's convolutions in NHWC memory format."""

from __future__ import annotations

import torch.fx as fx

from opswap.cost.units import human_unit
from opswap.rules._cost import bytes_estimate
from opswap.rules.base import Estimate, Found, Refused, Verdict
from opswap.rules.layout import _nhwc as nhwc
from opswap.rules.layout._base import LayoutRule
from opswap.rules.registry import register
from opswap.targets.base import Target


@register
class ChannelsLast(LayoutRule):
    name = "layout.channels_last"
    targets = ("cpu", "cuda")
    # converts the whole graph: it must see every other rewrite's final convolutions
    phase = "late"
    relieves = ("memory:conv",)
    description = (
        "Runs a CNN in channels-last (NHWC) memory format: conv weights stored NHWC, the 4-D "
        "inputs of the first convs converted once, 4-D outputs converted back. On backends "
        "whose fast conv kernels are NHWC (oneDNN, cuDNN tensor cores) an NCHW conv "
        "reorders its input and output every call. Pays only on a target that prefers "
        "channels_last; elsewhere the conversions are pure cost and the planner skips it."
    )
    # one match for the whole graph, found at its first 4-D convolution
    anchors = ("conv", "conv_transpose")

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Verdict:
        if next((n for n in gm.graph.nodes if nhwc.is_conv4d(n)), None) is not node:
            return None
        plan = nhwc.plan_nhwc(gm)
        if nhwc.already_nhwc(plan):
            return Refused("every convolution already runs channels_last", "model")
        names = plan.names()
        desc = f"{len(plan.convs)} conv(s) in NHWC; {', '.join(names['entries'])} converted in" + (
            f", {', '.join(names['outputs'])} back" if plan.outputs else ""
        )
        nodes = tuple(dict.fromkeys(plan.convs + plan.entries + plan.outputs + plan.views))
        # nothing is consumed: every node stays, with other strides or a conversion beside it
        return Found(nodes, desc, dict(plan=plan), key="model", kept=nodes, record=names)

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        nhwc.rewrite_nhwc(gm, found["plan"])
        nhwc.check_runs(gm)

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        plan = found["plan"]
        saved, paid = nhwc.traffic(plan)
        layout = getattr(target, "layout", None) or getattr(target, "preferred_layout", None)
        if layout != "channels_last":
            bw = getattr(target, "mem_bandwidth", None)
            return Estimate(
                bytes_saved=-float(paid),
                time_saved_s=-max(paid, 1) / bw if bw else -1e-9,
                note=f"{getattr(target, 'name', target)} prefers {layout or 'NCHW'} "
                "layout: the conversions would be paid and nothing saved",
            )
        n_conv = len(plan.entries + plan.outputs + plan.views)
        return bytes_estimate(
            saved - paid,
            target,
            f"{len(plan.convs)} conv(s) stop reordering "
            f"activations ({human_unit(saved, 'B')}) for {n_conv} "
            f"conversion(s) ({human_unit(paid, 'B')})",
            kernels_saved=-n_conv,
        )
