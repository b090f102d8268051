"""layout.channels_last: run a CNN's convolutions in NHWC memory format."""

from __future__ import annotations

import torch.fx as fx

from opswap.cost.units import human_unit
from opswap.rules._cost import bytes_estimate
from opswap.rules._matching import by_name
from opswap.rules.base import Estimate, Miss, Site
from opswap.rules.layout import _nhwc as nhwc
from opswap.rules.layout._base import LayoutRule
from opswap.rules.registry import register


def _nhwc_plan(site: Site) -> nhwc.NhwcPlan:
    d = site.data
    return nhwc.NhwcPlan(d["convs"], d["entries"], d["outputs"], d["views"])


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

    def match(self, gm: fx.GraphModule) -> list[Site | Miss]:
        plan = nhwc.plan_nhwc(gm)
        if not plan.convs:
            return []  # nothing for the rule to do: not a near miss
        if nhwc.already_nhwc(gm, plan):
            return [self.miss("model", "every convolution already runs channels_last")]
        desc = (f"{len(plan.convs)} conv(s) in NHWC; {', '.join(plan.entries)} converted in"
                + (f", {', '.join(plan.outputs)} back" if plan.outputs else ""))
        nodes = dict.fromkeys(plan.convs + plan.entries + plan.outputs + plan.views)
        return [self.site("model", list(nodes), desc, convs=plan.convs, entries=plan.entries,
                          outputs=plan.outputs, views=plan.views)]

    def rewrite(self, gm: fx.GraphModule, site: Site) -> None:
        nhwc.rewrite_nhwc(gm, by_name(gm), _nhwc_plan(site))
        nhwc.check_runs(gm)

    def _predict(self, gm, site, target) -> Estimate:
        plan = _nhwc_plan(site)
        saved, paid = nhwc.traffic(plan, by_name(gm))
        layout = getattr(target, "layout", None) or getattr(target, "preferred_layout", None)
        if layout != "channels_last":
            bw = getattr(target, "mem_bandwidth", None)
            return Estimate(bytes_saved=-float(paid),
                            time_saved_s=-max(paid, 1) / bw if bw else -1e-9,
                            note=f"{getattr(target, 'name', target)} prefers {layout or 'NCHW'} "
                                 "layout: the conversions would be paid and nothing saved")
        n_conv = len(plan.entries + plan.outputs + plan.views)
        return bytes_estimate(saved - paid, target, f"{len(plan.convs)} conv(s) stop reordering "
                              f"activations ({human_unit(saved, 'B')}) for {n_conv} "
                              f"conversion(s) ({human_unit(paid, 'B')})", kernels_saved=-n_conv)
