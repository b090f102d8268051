"""precision.int8_static_conv: a float32 Conv2d (+ a ReLU it alone feeds) -> int8 weights
and a uint8 input with a calibrated scale, onednn's int8 convolution with the ReLU in its
epilogue (`opswap::int8_static_conv2d`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.fx as fx

from opswap.cost import NodeCost, node_cost
from opswap.graph.ops import arg, copy_meta, module_of, op_kind
from opswap.graph.shapes import info
from opswap.kernels import int8_static
from opswap.rules._cost import op_time
from opswap.rules._edits import drop_dead_attrs, erase, install_module, swap_in_module
from opswap.rules._matching import input_of
from opswap.rules._weights import weighted, zero_padding
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.precision import _timing
from opswap.rules.precision._int8_static_module import NO_ONEDNN, Int8StaticConv2d, calibrated
from opswap.rules.registry import register
from opswap.targets.base import Target, Timer

MIN_CHANNELS = 4


def _relu_after(conv: fx.Node) -> fx.Node | None:
    """The ReLU that is the conv's only reader, if there is one."""
    users = list(conv.users)
    if len(users) == 1 and op_kind(users[0]) == "relu" and input_of(users[0]) is conv:
        return users[0]
    return None


@register
class StaticInt8Conv(Rule):
    """float32 Conv2d -> Int8StaticConv2d: the weight in int8 per output channel (or per
    tensor), the input quantised to uint8 with its calibrated scale and zero point, and
    onednn's int8 convolution (a ReLU that only the conv feeds runs in its epilogue). It
    runs after the BatchNorm folds, so the folded weights are the ones quantised, and
    before fusion.conv_relu, which would otherwise take the ReLU.

    Approximate: about 1-2% relative L2 per layer; the output is channels-last, as onednn
    writes it. On the `cpu` target the prediction is a measurement at the site's shape.
    """

    name = "precision.int8_static_conv"
    family = "precision"
    chapter = 6
    exactness = "approx"
    targets = ("cpu",)
    after = ("fusion.conv_bn", "fusion.linear_bn")
    before = ("fusion.conv_relu",)
    relieves = ("compute:conv", "memory:conv")
    description = (
        "float32 Conv2d (+ ReLU) -> int8 weights and a uint8 input with a calibrated "
        "scale (static post-training quantisation), onednn's int8 convolution."
    )

    anchors = ("conv",)

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        if getattr(module_of(node), "opswap_kind", None) is not None:
            return None
        if not int8_static.onednn_available():
            return Refused(NO_ONEDNN)
        w = weighted(gm, node)
        if isinstance(w, str):
            return Refused(w)
        if w.transposed or w.weight.dim() != 4:
            return Refused(f"{node.name} is not a 2-d convolution; int8 is offered for Conv2d")
        if w.weight.dtype != torch.float32:
            return Refused(f"{node.name}'s weight is not float32")
        padding = zero_padding(w, node)
        if isinstance(padding, str):
            return Refused(padding)
        if w.weight.shape[0] < MIN_CHANNELS:
            return Refused(
                f"{node.name} has {w.weight.shape[0]} output channels: below {MIN_CHANNELS} "
                "the quantise pass costs more than the int8 convolution saves"
            )
        x = input_of(node)
        xi = info(x) if x is not None else None
        if x is None or xi is None or xi.dtype != torch.float32 or len(xi.shape) != 4:
            return Refused(f"the input of {node.name} is not a 4-d float32 tensor of known shape")
        got = calibrated(gm, node, x)
        if isinstance(got, Refused):
            return got
        qp, cal = got
        relu = _relu_after(node)
        nodes = (node, relu) if relu is not None else (node,)
        return Found(
            nodes,
            f"{node.name}{' + ' + relu.name if relu else ''} in int8, input scale "
            f"{qp.scale:.3g} zero point {qp.zero_point} ({cal.method})",
            dict(w=w, qp=qp, per_channel=cal.per_channel, padding=padding, relu=relu),
            record=dict(conv=node.name, relu=relu.name if relu else None, **qp.to_json()),
        )

    def _module(
        self, found: Found, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None
    ) -> Int8StaticConv2d:
        w = found["w"]
        return Int8StaticConv2d(
            w.weight if weight is None else weight,
            w.bias if weight is None else bias,
            found["qp"],
            found["per_channel"],
            tuple(w.stride),
            found["padding"],
            tuple(w.dilation),
            w.groups,
            found["relu"] is not None,
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        conv, relu = found.nodes[0], found["relu"]
        mod = self._module(found)
        if conv.op == "call_module":
            new = install_module(gm, conv, mod, str(conv.target))
            if relu is not None:
                relu.replace_all_uses_with(new)
                copy_meta(new, relu)
                drop_dead_attrs(gm, erase(gm, [relu]))
            return
        out = relu if relu is not None else conv
        removed = [relu, conv] if relu is not None else [conv]
        swap_in_module(
            gm, mod, (input_of(conv),), out, removed, f"{conv.name}_int8",
            home=arg(conv, 1, "weight"),
        )  # fmt: skip

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        conv, relu = found.nodes[0], found["relu"]
        out, xi = info(conv), info(input_of(conv))
        if out is None or xi is None:
            return Estimate(note="shape unknown: no prediction")
        w = found["w"]
        if _timing.is_this_cpu(target):

            def make() -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]:
                g = torch.Generator().manual_seed(int(sum(xi.shape)) * 31 + w.weight.numel())
                x = torch.randn(*xi.shape, generator=g).abs_()
                wt = torch.randn(*w.weight.shape, generator=g) * 0.1
                b = torch.randn(w.weight.shape[0], generator=g)
                q = self._module(found, wt, b)
                conv_args = (w.stride, found["padding"], w.dilation, w.groups)

                def before() -> torch.Tensor:
                    y = torch.nn.functional.conv2d(x, wt, b, *conv_args)
                    return torch.relu_(y) if relu is not None else y

                return before, (lambda: q(x))

            key = ("static_conv", tuple(xi.shape), tuple(w.weight.shape), tuple(w.stride),
                   found["padding"], w.groups, relu is not None)  # fmt: skip
            t32, t8 = _timing.timed_pair(
                key, cast(Timer, target.timer), make
            )  # is_this_cpu: it is set
            return Estimate(
                0.0,
                float(3 * w.weight.numel()),
                t32 - t8,
                f"timed at input {list(xi.shape)} on this CPU: float32 {t32 * 1e6:.0f} us, "
                f"int8 {t8 * 1e6:.0f} us",
            )
        before = node_cost(conv)
        flops = before.flops
        after = NodeCost(flops, xi.numel + w.weight.numel() + 4 * out.numel)
        quant = NodeCost(3 * xi.numel, 5 * xi.numel)
        t_before = op_time(before, target, "float32") + (
            op_time(node_cost(relu), target, "float32") if relu is not None else 0.0
        )
        t_after = op_time(after, target, "int8") + op_time(quant, target, "float32")
        return Estimate(
            0.0,
            float(before.bytes - after.bytes - quant.bytes),
            t_before - t_after,
            "int8 convolution at the target's int8 rate plus one quantise pass",
        )
