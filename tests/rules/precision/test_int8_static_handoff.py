"""precision.int8_static_handoff: an int8 convolution whose only reader is another int8
convolution hands it uint8; every link of a chain is taken, a convolution with another
reader (a residual, a second branch) or that ends the graph is not, with reasons; the
result is what the plan without the handoff computes, and stays inside the approx budget
against the user's module at other shapes, with in-place ops, a residual and a stateful
buffer in the mix; it saves, exports and reloads; ONNX export carries the uint8 map."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from opswap.graph.calibrate import Calibration, attach
from opswap.graph.capture import capture
from opswap.kernels import int8_static
from opswap.planner import apply_plan, make_plan
from opswap.rules.precision._int8_static_module import Int8StaticConv2d
from opswap.verify.samples import make_samples

from .._shapes import other_shapes
from .test_int8_static_conv import FIXED

pytestmark = pytest.mark.skipif(
    not int8_static.onednn_available(), reason="onednn's int8 kernels need an x86 CPU torch"
)

HANDOFF = "precision.int8_static_handoff"


@pytest.fixture(autouse=True)
def _int8_pays(monkeypatch):
    """Every convolution here in int8 (the test profile's roofline says small 1x1 ones do
    not pay for their quantise pass; whether they do is a benchmark's business)."""
    from opswap.rules.base import Estimate
    from opswap.rules.precision.int8_static_conv import StaticInt8Conv
    from opswap.rules.precision.int8_static_linear import StaticInt8Linear

    for rule in (StaticInt8Conv, StaticInt8Linear):
        monkeypatch.setattr(rule, "predict", lambda *a: Estimate(0.0, 0.0, 1e-6, "test"))


class Bottleneck(nn.Module):
    """A ResNet bottleneck (1x1, 3x3, 1x1 with BatchNorms, the residual added before the
    last ReLU, in place), a stem conv whose output feeds two branches, and a call count
    that forward updates."""

    def __init__(self, c=24, mid=12):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.c1 = nn.Conv2d(c, mid, 1, bias=False)
        self.b1 = nn.BatchNorm2d(mid)
        self.c2 = nn.Conv2d(mid, mid, 3, stride=1, padding=1, bias=False)
        self.b2 = nn.BatchNorm2d(mid)
        self.c3 = nn.Conv2d(mid, c, 1, bias=False)
        self.b3 = nn.BatchNorm2d(c)
        self.side = nn.Conv2d(c, c, 1)
        self.tail = nn.Conv2d(c, 8, 3, padding=1)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        s = torch.relu(self.stem(x))
        h = torch.relu(self.b1(self.c1(s)))
        h = self.b2(self.c2(h)).relu_()
        h = self.b3(self.c3(h))
        h = (h + self.side(s)).relu_()
        return self.tail(h)


def _model():
    torch.manual_seed(1)
    m = Bottleneck().eval()
    with torch.no_grad():
        for bn in (m.b1, m.b2, m.b3):
            bn.running_mean.uniform_(-0.3, 0.3)
            bn.running_var.uniform_(0.5, 2.0)
    return m


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _plan(model, x, rules, method="fx"):
    cap = capture(model, (x,), method=method)
    attach(cap.gm, Calibration(make_samples((x,), 6)))
    plan = make_plan(cap, rules=rules, exactness="approx", target=FIXED)
    return cap, plan, apply_plan(cap, plan)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_hands_off_along_the_chain_and_nowhere_else(method):
    model = _model()
    state = copy.deepcopy(model.state_dict())
    x = torch.randn(2, 3, 10, 9)
    cap, plan, applied = _plan(model, x, ["fusion.*", "precision.int8_static_*"], method)
    hand = [d for d in plan.decisions if d.rule == HANDOFF]
    # c1 -> c2 and c2 -> c3 (both links of the chain, the second after the first changed
    # the graph); not the stem (two readers), c3 (the residual add) or the tail (the output)
    assert len(hand) == 2, plan.decisions
    reasons = " ".join(m.reason for m in plan.misses if m.rule == HANDOFF)
    assert "2 readers" in reasons and "not an int8 convolution" in reasons
    convs = [m for m in applied.gm.modules() if isinstance(m, Int8StaticConv2d)]
    assert len(convs) == 6
    handing = [c for c in convs if c.out_scale > 0]
    assert len(handing) == 2
    # each hands off with its reader's own input scale
    readers = {(c.x_scale, c.x_zp) for c in convs}
    assert all((c.out_scale, c.out_zp) in readers for c in handing)
    # against the same plan without the handoff: the same numbers up to a half-step rounding
    _, plan0, plain = _plan(_model(), x, ["fusion.*", "precision.int8_static_conv"], method)
    assert not [d for d in plan0.decisions if d.rule == HANDOFF]
    for label, xs in [
        ("example", (x,)),
        *other_shapes(cap),
        ("batch 3, 13 x 6", (torch.randn(3, 3, 13, 6),)),
    ]:
        with torch.inference_mode():
            want, got, base = model(*xs), applied.gm(*xs), plain.gm(*xs)
        assert got.shape == want.shape, label
        assert _rel(got, base) < 5e-3, (label, _rel(got, base))
        assert _rel(got, want) < 0.05, (label, _rel(got, want))
    # the user's module: untouched weights; its counter ran only in the calls above
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items() if k != "calls")
    # the plan's own modules are not the ones it handed off (a shallow copy took the change)
    assert all(c.out_scale == 0 for c in plain.gm.modules() if isinstance(c, Int8StaticConv2d))


def test_the_map_between_two_convolutions_is_uint8():
    model = _model()
    x = torch.randn(2, 3, 10, 9)
    _, _, applied = _plan(model, x, ["fusion.*", "precision.int8_static_*"])
    seen = []
    hooks = [
        m.register_forward_hook(lambda mod, inp, out: seen.append((inp[0].dtype, out.dtype)))
        for m in applied.gm.modules()
        if isinstance(m, Int8StaticConv2d)
    ]
    with torch.inference_mode():
        applied.gm(x)
    for h in hooks:
        h.remove()
    assert seen.count((torch.float32, torch.uint8)) == 1  # c1 takes float, hands uint8
    assert seen.count((torch.uint8, torch.uint8)) == 1  # c2 takes and hands uint8
    assert seen.count((torch.uint8, torch.float32)) == 1  # c3 takes uint8, writes float


def test_state_dict_round_trip_and_old_states_load():
    model = _model()
    x = torch.randn(2, 3, 10, 9)
    _, _, applied = _plan(model, x, ["fusion.*", "precision.int8_static_*"])
    sd = applied.gm.state_dict()
    fresh = copy.deepcopy(applied.gm)
    for m in fresh.modules():
        if isinstance(m, Int8StaticConv2d):
            m.out_scale, m.out_zp = 0.0, 0
    fresh.load_state_dict(sd)
    with torch.inference_mode():
        assert torch.equal(fresh(x), applied.gm(x))
    # a state saved before the handoff existed (no output scale) loads as float32 output
    conv = next(m for m in fresh.modules() if isinstance(m, Int8StaticConv2d))
    conv.set_extra_state({"x_scale": 0.5, "x_zp": 3})
    assert (conv.x_scale, conv.x_zp, conv.out_scale, conv.out_zp) == (0.5, 3, 0.0, 0)


def test_exported_file_and_onnx_keep_the_handoff(tmp_path):
    model = _model()
    x = torch.randn(2, 3, 10, 9)
    _, _, applied = _plan(model, x, ["fusion.*", "precision.int8_static_*"])
    ep = torch.export.export(applied.gm, (x,))
    metas = [
        n.meta["val"].dtype
        for n in ep.graph.nodes
        if "int8_static_conv2d" in str(n.target) and "val" in n.meta
    ]
    assert metas.count(torch.uint8) == 2
    torch.export.save(ep, tmp_path / "m.pt2")
    loaded = torch.export.load(tmp_path / "m.pt2").module()
    with torch.inference_mode():
        assert _rel(loaded(x), applied.gm(x)) < 1e-6

    pytest.importorskip("onnxruntime")
    from opswap.backends.ort import ort_artifact

    art = ort_artifact(applied.gm, (x,), None, tmp_path)
    assert art.module is not None, art.error
    import onnx

    ops = [n.op_type for n in onnx.load(str(art.path)).graph.node]
    assert ops.count("QuantizeLinear") >= 2  # the two epilogues' requantisations
    with torch.inference_mode():
        want = applied.gm(x)
    got = next(iter(art.module(x).values())) if isinstance(art.module(x), dict) else art.module(x)
    # ONNX Runtime rounds x / s where the kernels round x * (1 / s): a value near a half
    # step of a uint8 map may go the other way, one step of 256, spread by the next
    # convolution; a wrong scale or zero point would be off by tens of steps
    assert float((got - want).abs().max()) < 0.01 * float(want.abs().max())
    assert _rel(got, want) < 5e-3


class FeedForward(nn.Module):
    """A transformer feed-forward (LayerNorm, up projection, GELU, down projection, the
    residual), then a ReLU MLP head whose ReLU is in place, a tanh-GELU pair, and a Linear
    read twice."""

    def __init__(self, d=48, hidden=96):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)
        self.h1 = nn.Linear(d, 64)
        self.h2 = nn.Linear(64, 40)
        self.g = nn.GELU(approximate="tanh")
        self.h3 = nn.Linear(40, 32)
        self.two = nn.Linear(32, 32)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        self.steps += 1
        x = x + self.down(nn.functional.gelu(self.up(self.norm(x))))
        h = self.h1(x).relu_()
        h = self.h3(self.g(self.h2(h)))
        t = self.two(h)
        return torch.cat([t, t * 2], -1)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_linear_chains_hand_off_with_the_activation_in_the_epilogue(method, tmp_path):
    torch.manual_seed(3)
    model = FeedForward().eval()
    x = torch.randn(2, 7, 48)
    cap, plan, applied = _plan(model, x, ["fusion.*", "precision.int8_static_*"], method)
    hand = [d for d in plan.decisions if d.rule == HANDOFF]
    # up -> GELU -> down, h1 -> ReLU -> h2, h2 -> tanh GELU -> h3, h3 -> two; not down (the
    # residual), not two (read twice)
    assert len(hand) == 4, [d.site.key for d in hand]
    assert any("2 readers" in m.reason for m in plan.misses if m.rule == HANDOFF)
    from opswap.rules.precision._int8_static_module import Int8StaticLinear

    lins = {type(m).__name__ + str(i): m for i, m in enumerate(applied.gm.modules())}
    posts = sorted(m.post for m in lins.values() if isinstance(m, Int8StaticLinear))
    assert posts == ["gelu", "gelu_tanh", "none", "none", "none", "relu"], posts
    assert not [n for n in applied.gm.graph.nodes if "gelu" in str(n.target)]
    rules = ["fusion.*", "precision.int8_static_conv", "precision.int8_static_linear"]
    _, _, plain = _plan(model, x, rules, method)
    for label, xs in [("example", (x,)), *other_shapes(cap), ("3 x 5", (torch.randn(3, 5, 48),))]:
        with torch.inference_mode():
            want, got, base = model(*xs), applied.gm(*xs), plain.gm(*xs)
        assert got.shape == want.shape, label
        assert _rel(got, base) < 5e-3, (label, _rel(got, base))
        assert _rel(got, want) < 0.05, (label, _rel(got, want))

    pytest.importorskip("onnxruntime")
    from opswap.backends.ort import ort_artifact

    art = ort_artifact(applied.gm, (x,), None, tmp_path)
    assert art.module is not None, art.error
    got = art.module(x)
    got = next(iter(got.values())) if isinstance(got, dict) else got
    with torch.inference_mode():
        want = applied.gm(x)
    assert _rel(got, want) < 5e-3
