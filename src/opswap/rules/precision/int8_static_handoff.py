"""precision.int8_static_handoff: an int8 convolution whose only reader is another int8
convolution, or an int8 Linear whose only reader is another int8 Linear (directly or
through a ReLU or GELU only it feeds), requantises its output to uint8, in its epilogue
(the activation there too), with the reader's calibrated input scale; the reader takes the
uint8 map as it is (`opswap::int8_static_conv2d` / `int8_static_linear` with an output
scale)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import cast

import torch
import torch.fx as fx

from opswap.cost import NodeCost
from opswap.graph.ops import module_of, op_kind
from opswap.graph.shapes import info
from opswap.kernels import int8_static
from opswap.rules._cost import op_time
from opswap.rules._edits import erase
from opswap.rules._matching import input_of, setting
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.precision import _timing
from opswap.rules.precision._int8_static_module import (
    NO_ONEDNN,
    Int8StaticConv2d,
    Int8StaticLinear,
    _Static,
)
from opswap.rules.registry import register
from opswap.targets.base import Target, Timer


def _int8(node: fx.Node) -> _Static | None:
    mod = module_of(node)
    return mod if isinstance(mod, Int8StaticConv2d | Int8StaticLinear) else None


def _activation(node: fx.Node) -> str | None:
    """The epilogue name of a ReLU or GELU node ("relu", "gelu", "gelu_tanh"), else None."""
    kind = op_kind(node)
    if kind == "relu":
        return "relu"
    if kind != "gelu":
        return None
    approx = setting(node, "approximate")
    return "gelu_tanh" if approx == "tanh" else "gelu" if approx == "none" else None


def _reader(node: fx.Node) -> tuple[fx.Node | None, fx.Node | None, str]:
    """(activation node or None, the node that reads the value, why not) past `node`'s one
    reader, stepping over one ReLU or GELU that only `node` feeds."""
    users = list(node.users)
    if len(users) != 1:
        return (
            None,
            None,
            f"{node.name}'s output has {len(users)} readers: it stays float32 for them",
        )
    act = users[0]
    if _activation(act) is not None and input_of(act) is node:
        after = list(act.users)
        if len(after) != 1:
            return act, None, f"{act.name} has {len(after)} readers: it stays float32 for them"
        return act, after[0], ""
    return None, act, ""


@register
class StaticInt8Handoff(Rule):
    """Int8StaticConv2d -> Int8StaticConv2d, or Int8StaticLinear (-> ReLU or GELU) ->
    Int8StaticLinear: the first writes uint8 quantised with the second's calibrated (scale,
    zero point) instead of float32, with the activation between them in its epilogue, and
    the second skips its quantise pass.

    The second layer would quantise the first's float32 output (after the activation) with
    that same scale and zero point, so the handoff computes what the two computed before:
    onednn's requantisation in the epilogue rounds the same float value, and only a value
    that falls exactly on a half step may round the other way (one step, of 256); a GELU in
    the epilogue is onednn's, within float32 rounding of PyTorch's. What it saves is the
    float32 tensor between the two (written, then read by the quantise pass), the
    activation's pass and the quantise pass: in a ResNet bottleneck, two of every three
    convolutions; in a transformer block, the feed-forward's up projection and its GELU. A
    layer with another reader (a residual add, a second branch) keeps its float32 output.
    """

    name = "precision.int8_static_handoff"
    family = "precision"
    chapter = 6
    exactness = "approx"
    targets = ("cpu",)
    after = ("precision.int8_static_conv", "precision.int8_static_linear", "fusion.*")
    relieves = ("memory:conv", "memory:matmul")
    description = (
        "int8 Conv2d / Linear feeding only another (a Linear through a ReLU or GELU) -> its "
        "output requantised to uint8 with the reader's calibrated scale in the epilogue, "
        "the activation there too, the reader's quantise pass gone."
    )

    anchors = ("conv", "linear")

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        first = _int8(node)
        if first is None or first.out_scale > 0:
            return None  # not an int8 layer, or one that already hands off
        if not int8_static.onednn_available():
            return Refused(NO_ONEDNN)
        act, reader, why = _reader(node)
        if reader is None:
            return Refused(why)
        second = _int8(reader)
        src = act if act is not None else node
        if second is None or type(second) is not type(first) or reader.args[:1] != (src,):
            kind = "convolution" if isinstance(first, Int8StaticConv2d) else "Linear"
            return Refused(
                f"{src.name}'s output goes to {reader.name}, which is not an int8 {kind} "
                "taking it as its input"
            )
        if act is not None and (isinstance(first, Int8StaticConv2d) or first.post != "none"):
            return Refused(
                f"{act.name} between {node.name} and {reader.name} cannot join "
                f"{node.name}'s epilogue"
            )
        out = info(src)
        if out is None or out.dtype != torch.float32:
            return Refused(f"{src.name}'s output is not a float32 tensor of known shape")
        post = _activation(act) if act is not None else first.post
        return Found(
            (node, act) if act is not None else (node,),
            f"{node.name}{' + ' + act.name if act is not None else ''} hands uint8 to "
            f"{reader.name} (scale {second.x_scale:.3g}, zero point {second.x_zp})",
            dict(reader=reader, act=act, post=post, scale=second.x_scale, zp=second.x_zp),
            record=dict(
                layer=node.name,
                activation=act.name if act is not None else None,
                reader=reader.name,
                scale=second.x_scale,
                zero_point=second.x_zp,
            ),
        )

    def _handing(self, found: Found, mod: _Static) -> _Static:
        # a shallow copy shares the int8 weights; the plan's own module stays as it was
        new = copy.copy(mod)
        new.post = found["post"]
        new.out_scale, new.out_zp = float(found["scale"]), int(found["zp"])
        return new

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        node, act = found.nodes[0], found["act"]
        mod = _int8(node)
        assert mod is not None
        gm.add_submodule(str(node.target), self._handing(found, mod))
        if act is not None:  # the activation now runs in the epilogue
            act.replace_all_uses_with(node)
            erase(gm, [act])

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        node, reader, act = found.nodes[0], found["reader"], found["act"]
        out = info(act if act is not None else node)
        assert out is not None  # check made sure
        first, second = _int8(node), _int8(reader)
        assert first is not None and second is not None
        if _timing.is_this_cpu(target) and (xi := info(node.args[0])) is not None:
            post = _activation(act) if act is not None else None

            def make() -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]:
                g = torch.Generator().manual_seed(int(sum(xi.shape)) * 17 + out.numel)
                x = torch.randn(*xi.shape, generator=g).abs_()
                handing = self._handing(found, first)

                def before() -> torch.Tensor:
                    h = first(x)
                    h = int8_static._post(h, post) if post is not None else h
                    return second(h)

                def after() -> torch.Tensor:
                    return second(handing(x))

                return before, after

            key = ("static_handoff", type(first).__name__, tuple(xi.shape),
                   tuple(first.weight_int8.shape), tuple(second.weight_int8.shape),
                   repr(getattr(first, "stride", None)), getattr(first, "groups", 1),
                   repr(getattr(second, "stride", None)), getattr(second, "groups", 1),
                   found["post"])  # fmt: skip
            t_before, t_after = _timing.timed_pair(
                key, cast(Timer, target.timer), make
            )  # is_this_cpu: it is set
            return Estimate(
                0.0,
                float(8 * out.numel),
                t_before - t_after,
                f"timed at input {list(xi.shape)} on this CPU: the pair through float32 "
                f"{t_before * 1e6:.0f} us, with the uint8 handoff {t_after * 1e6:.0f} us",
            )
        # the float32 tensor between the two written and read back by the quantise pass
        # (which also writes the uint8 one), and an activation's pass, against the uint8
        # tensor written once
        passes = 2 if act is not None else 1
        saved = NodeCost(3 * out.numel, passes * 8 * out.numel + out.numel)
        return Estimate(
            0.0,
            float(saved.bytes),
            op_time(saved, target, "float32"),
            "the float32 tensor between the two layers and the quantise pass, saved",
        )
