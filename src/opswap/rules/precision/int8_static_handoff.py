"""precision.int8_static_handoff: an int8 convolution whose only reader is another int8
convolution requantises its output to uint8, in its epilogue, with the reader's calibrated
input scale; the reader takes the uint8 map as it is (`opswap::int8_static_conv2d` with an
output scale)."""

from __future__ import annotations

import copy

import torch
import torch.fx as fx

from opswap.cost import NodeCost
from opswap.graph.ops import module_of
from opswap.graph.shapes import info
from opswap.kernels import int8_static
from opswap.rules._cost import op_time
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.precision import _timing
from opswap.rules.precision._int8_static_module import NO_ONEDNN, Int8StaticConv2d
from opswap.rules.registry import register


def _int8_conv(node: fx.Node) -> Int8StaticConv2d | None:
    mod = module_of(node)
    return mod if isinstance(mod, Int8StaticConv2d) else None


@register
class StaticInt8Handoff(Rule):
    """Int8StaticConv2d -> Int8StaticConv2d: the first writes uint8 quantised with the
    second's calibrated (scale, zero point) instead of float32, and the second skips its
    quantise pass.

    The second convolution would quantise the first's float32 output with that same scale
    and zero point, so the handoff computes what the two computed before: onednn's
    requantisation in the epilogue rounds the same float value, and only a value that falls
    exactly on a half step may round the other way (one step, of 256). What it saves is the
    float32 map between the two (written, then read by the quantise pass) and the quantise
    pass itself: in a ResNet bottleneck, two of every three convolutions. A convolution with
    another reader (a residual add, a second branch) keeps its float32 output.
    """

    name = "precision.int8_static_handoff"
    family = "precision"
    chapter = 6
    exactness = "approx"
    targets = ("cpu",)
    after = ("precision.int8_static_conv", "fusion.*")
    relieves = ("memory:conv",)
    description = (
        "int8 Conv2d feeding only another int8 Conv2d -> its output requantised to uint8 "
        "with the reader's calibrated scale in the epilogue, the reader's quantise pass gone."
    )

    anchors = ("conv",)

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        first = _int8_conv(node)
        if first is None or first.out_scale > 0:
            return None  # not an int8 convolution, or one that already hands off
        if not int8_static.onednn_available():
            return Refused(NO_ONEDNN)
        users = list(node.users)
        if len(users) != 1:
            return Refused(
                f"{node.name}'s output has {len(users)} readers: it stays float32 for them"
            )
        reader = users[0]
        second = _int8_conv(reader)
        if second is None or reader.args[:1] != (node,) or len(reader.args) != 1:
            return Refused(
                f"{node.name}'s output goes to {reader.name}, which is not an int8 "
                "convolution taking it as its input"
            )
        out = info(node)
        if out is None or out.dtype != torch.float32:
            return Refused(f"{node.name}'s output is not a float32 map of known shape")
        return Found(
            (node,),
            f"{node.name} hands uint8 to {reader.name} (scale {second.x_scale:.3g}, "
            f"zero point {second.x_zp})",
            dict(reader=reader, scale=second.x_scale, zp=second.x_zp),
            record=dict(
                conv=node.name, reader=reader.name, scale=second.x_scale, zero_point=second.x_zp
            ),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        node = found.nodes[0]
        # a shallow copy shares the int8 weights; the plan's modules stay as they were
        mod = copy.copy(_int8_conv(node))
        assert mod is not None
        mod.out_scale, mod.out_zp = float(found["scale"]), int(found["zp"])
        gm.add_submodule(str(node.target), mod)

    def predict(self, gm: fx.GraphModule, found: Found, target) -> Estimate:
        node, reader = found.nodes[0], found["reader"]
        out = info(node)
        assert out is not None  # check made sure
        first, second = _int8_conv(node), _int8_conv(reader)
        assert first is not None and second is not None
        if _timing.is_this_cpu(target) and (xi := info(node.args[0])) is not None:

            def make():
                g = torch.Generator().manual_seed(int(sum(xi.shape)) * 17 + out.numel)
                x = torch.randn(*xi.shape, generator=g).abs_()
                handing = copy.copy(first)
                handing.out_scale, handing.out_zp = float(found["scale"]), int(found["zp"])

                def before():
                    return second(first(x))

                def after():
                    return second(handing(x))

                return before, after

            key = ("static_handoff", tuple(xi.shape), tuple(first.weight_int8.shape),
                   tuple(second.weight_int8.shape), tuple(first.stride), first.groups,
                   tuple(second.stride), second.groups)  # fmt: skip
            t_before, t_after = _timing.timed_pair(key, target.timer, make)
            return Estimate(
                0.0,
                float(8 * out.numel),
                t_before - t_after,
                f"timed at input {list(xi.shape)} on this CPU: the pair through float32 "
                f"{t_before * 1e6:.0f} us, with the uint8 handoff {t_after * 1e6:.0f} us",
            )
        # the float32 map written and read back by the quantise pass (which also writes the
        # uint8 map) against the uint8 map written once
        saved = NodeCost(3 * out.numel, 4 * out.numel + 4 * out.numel + out.numel)
        return Estimate(
            0.0,
            float(saved.bytes),
            op_time(saved, target, "float32"),
            "the float32 map between the two convolutions and the quantise pass, saved",
        )
