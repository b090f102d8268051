"""layout.channels_last: NHWC conversion where the target prefers it, skipped where it does
not, rolled back when a view breaks; the NHWC stride test against torch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from opswap.graph import capture, op_kind
from opswap.graph.shapes import propagate
from opswap.planner import make_plan
from opswap.rules import registry
from opswap.rules.base import misses_of, sites_of
from opswap.rules.layout._nhwc import nhwc_strides

from ._helpers import FLAVOURS, NCHW_CPU, NHWC_CPU, SETTINGS, SHAPE, apply_rule, flavours, keys, run


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(5, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 6, 3)
        self.fc = nn.Linear(6 * 5 * 11, 4)

    def forward(self, x):
        f = F.relu(self.bn(self.c1(x)))
        g = self.c2(f)
        return self.fc(g.view(g.size(0), -1)), g  # a .view of a 4-D activation, and a 4-D output


def _conv_weights(gm) -> list[torch.Tensor]:
    out = []
    for n in gm.graph.nodes:
        if op_kind(n) == "conv":
            out.append(
                gm.get_submodule(n.target).weight
                if n.op == "call_module"
                else gm.get_parameter(n.args[1].target)
            )
    return out


@pytest.mark.parametrize("method", FLAVOURS)
def test_channels_last(method):
    model = SmallCNN().eval()
    plan, applied = run(model, "layout.channels_last", method)
    assert keys(plan) == ["model"] and plan.decisions[0].estimate.time_saved_s > 0
    gm = applied.gm
    x = torch.randn(SHAPE)
    propagate(gm, (x,))
    convs = [n for n in gm.graph.nodes if op_kind(n) == "conv"]
    assert len(convs) == 2
    for n in convs:  # strides of a real run: NHWC, C innermost
        meta = n.meta["tensor_meta"]
        assert nhwc_strides(meta.shape, meta.stride) and meta.stride[1] == 1
    for w in _conv_weights(gm):
        assert w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous()
    logits, fmap = gm(x)
    assert fmap.is_contiguous()  # converted back at the output
    assert model.c1.weight.is_contiguous() and model.c2.weight.is_contiguous()


def test_channels_last_refuses_model_without_convs():
    mlp = nn.Sequential(nn.Linear(13, 7), nn.ReLU())
    captured = capture(mlp, (torch.randn(SHAPE),), method="fx")
    found = registry.get("layout.channels_last").match(captured.gm)
    assert not sites_of(found)
    assert not misses_of(found)  # nothing to do is not a near miss


def test_channels_last_skipped_where_nchw_is_preferred():
    captured = capture(SmallCNN().eval(), (torch.randn(SHAPE),), method="fx")
    plan = make_plan(captured, rules=["layout.channels_last"], target=NCHW_CPU)
    assert not plan.decisions
    assert len(plan.skipped) == 1 and "prefers contiguous" in plan.skipped[0].reason


def test_the_estimate_states_bytes_with_units():
    # a skip reason or estimate the report prints reads "1.7 kB", not "1680 B"
    import re

    captured = capture(SmallCNN().eval(), (torch.randn(8, 5, 7, 13),), method="fx")
    plan = make_plan(captured, rules=["layout.channels_last"], target=NHWC_CPU)
    notes = [d.estimate.note for d in plan.decisions] + [s.reason for s in plan.skipped]
    assert notes and all("conv(s) stop reordering" in n for n in notes), notes
    assert all(re.search(r"\(\d+(\.\d)? [kMG]B\)", n) for n in notes), notes
    assert not any(re.search(r"\d{4,} B\b", n) for n in notes), notes


def test_channels_last_rolls_back_when_a_view_breaks():
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Conv2d(5, 4, 3)

        def forward(self, x):
            # NCHW: flatten(2) then view is fine; NHWC: the C and H*W strides do not merge
            return self.c(x).flatten(2).view(3, -1)

    model = Flat().eval()
    captured = capture(model, (torch.randn(SHAPE),), method="fx")
    plan = make_plan(captured, rules=["layout.channels_last"], target=NHWC_CPU)
    assert not plan.decisions
    assert len(plan.failed) == 1 and "no longer runs" in plan.failed[0].reason
    assert all(w.is_contiguous() for w in _conv_weights(captured.gm))


class ConvNet(nn.Module):
    def __init__(self, c_in, c_mid, k):
        super().__init__()
        self.a = nn.Conv2d(c_in, c_mid, k, padding=k // 2)
        self.b = nn.Conv2d(c_mid, c_mid, 3, padding=1, groups=1)

    def forward(self, x):
        return self.b(F.relu(self.a(x))) + 1


@SETTINGS
@given(st.lists(st.integers(1, 4), min_size=4, max_size=4), st.permutations(range(4)))
def test_nhwc_strides_agrees_with_torch(shape, order):
    """The rule's reading of 4-D strides matches torch's own, ambiguous size-1 cases
    included (torch settles those as NCHW)."""
    import torch._prims_common as prims

    t = torch.empty([shape[d] for d in order]).permute(*[order.index(i) for i in range(4)])
    want = prims.suggest_memory_format(t) == torch.channels_last
    assert nhwc_strides(t.shape, t.stride()) == want


@settings(max_examples=8, deadline=None, derandomize=True)
@given(
    st.integers(1, 3),
    st.integers(1, 6),
    st.integers(2, 7),
    st.integers(3, 9),
    st.integers(3, 9),
    st.sampled_from([1, 3]),
    flavours,
)
def test_channels_last_preserves(n, c_in, c_mid, h, w, k, method):
    torch.manual_seed(0)
    model, x = ConvNet(c_in, c_mid, k).eval(), torch.randn(n, c_in, h, w)
    plan, applied = apply_rule(model, x, "layout.channels_last", method)
    assert len(plan.decisions) == 1
    fresh = torch.randn_like(x)
    want, got = model(fresh), applied.gm(fresh)
    assert ((got - want).norm() / want.norm()).item() <= 1e-5
    assert got.is_contiguous()
    propagate(applied.gm, (x,))
    for node in applied.gm.graph.nodes:
        if op_kind(node) == "conv":
            meta = node.meta["tensor_meta"]
            assert nhwc_strides(meta.shape, meta.stride)
