"""fusion.conv_relu: fusing with or without conv_bn first, refusals with reasons, the
FusedConvReLU module's paths, and random conv stacks with conv_bn (property tests).
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from opswap.rules.fusion._fused_conv_relu import FusedConvReLU, mkldnn_fused_available

from ._helpers import (
    METHOD,
    METHODS,
    SETTINGS,
    TOL,
    _bn,
    _eval_bn,
    check,
    count,
    images,
    reasons,
    reasons_text,
    rel_l2,
    run,
)


class ConvReLUs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.bn_a, self.relu = (
            nn.Conv2d(13, 16, 3, padding=1),
            _bn(nn.BatchNorm2d, 16),
            nn.ReLU(),
        )
        self.b = nn.Conv2d(16, 9, 3, stride=2, padding="valid", bias=False)
        self.c = nn.Conv2d(9, 9, 3, padding="same", groups=3)
        self.d, self.bn_d = nn.Conv1d(13, 5, 3), _bn(nn.BatchNorm1d, 5)

    def forward(self, x):
        y = self.relu(self.bn_a(self.a(x)))
        y = F.relu(self.b(y), inplace=True)
        y = torch.relu(self.c(y))
        z = self.bn_d(self.d(x.flatten(2))).relu()
        return y.flatten(1).sum(1, keepdim=True) + z.flatten(1)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("rules", [["fusion.conv_relu"], ["fusion.conv_bn", "fusion.conv_relu"]])
def test_conv_relu_fuses_with_or_without_conv_bn_first(method, rules):
    expect = {"fusion.conv_relu": 4}
    if "fusion.conv_bn" in rules:
        expect["fusion.conv_bn"] = 2
    plan, applied = check(ConvReLUs(), images(3, 13, 5, 7), rules, method, expect)
    fused = [m for m in applied.gm.modules() if isinstance(m, FusedConvReLU)]
    assert len(fused) == 4
    ops = [str(n.target) for n in applied.gm.graph.nodes]
    assert not any("relu" in o or "batch_norm" in o for o in ops)
    keys = {d.site.key for d in plan.decisions if d.rule == "fusion.conv_relu"}
    if method == "fx" and rules == ["fusion.conv_relu"]:
        assert "a+bn_a+relu" in keys and "b+relu_1" in keys


class ConvReLUCases(nn.Module):
    def __init__(self):
        super().__init__()
        self.refl = nn.Conv2d(13, 8, 3, padding=1, padding_mode="reflect")
        self.even = nn.Conv2d(13, 8, 2, padding="same")
        self.tr = nn.ConvTranspose2d(13, 8, 3)
        self.sh = nn.Conv2d(13, 8, 3, padding=1)

    def forward(self, x):
        a = torch.relu(self.refl(x))
        b = torch.relu(self.even(x))
        c = torch.relu(self.tr(x))[:, :, 1:-1, 1:-1]
        s = self.sh(x)
        return a + b + c + torch.relu(s) + s


@pytest.mark.parametrize("method", METHODS)
def test_conv_relu_refuses_with_reasons(method):
    # export spells reflect padding as a pad op and a plain conv, which does fuse
    plan, applied = check(
        ConvReLUCases(),
        images(3, 13, 5, 7),
        ["fusion.conv_relu"],
        method,
        {"fusion.conv_relu": 0 if method == "fx" else 1},
    )
    why = " | ".join(reasons(plan, "fusion.conv_relu"))
    if method == "fx":
        assert "padding_mode='reflect'" in why
    assert "padding='same' with an even kernel" in why
    assert "transposed convolution" in why
    assert "also read by" in why


def test_fused_conv_relu_module_paths_agree():
    torch.manual_seed(0)
    w, b = torch.randn(8, 13, 3, 3), torch.randn(8)
    m = FusedConvReLU(w, b, (2, 1), (1, 0), (1, 2), 1)
    x = torch.randn(3, 13, 5, 7)
    ref = F.relu(F.conv2d(x, w, b, (2, 1), (1, 0), (1, 2)))
    with torch.no_grad():
        fast = m(x)
    assert rel_l2(ref, fast) <= TOL
    if mkldnn_fused_available():
        from opswap.kernels.conv_relu import _PACKED

        assert m.weight in _PACKED  # the oneDNN path ran, with the weight reordered once
    slow = m(x.requires_grad_())  # gradients needed: plain conv + relu, differentiable
    slow.sum().backward()
    assert rel_l2(ref, slow.detach()) <= TOL and x.grad is not None
    again = pickle.loads(pickle.dumps(copy.deepcopy(m)))
    assert set(again.state_dict()) == {"weight", "bias"}
    with torch.no_grad():
        assert rel_l2(ref, again(x.detach())) <= TOL
        x64, w64, b64 = x.detach().double(), w.double(), b.double()
        ref64 = F.relu(F.conv2d(x64, w64, b64, (2, 1), (1, 0), (1, 2)))
        assert rel_l2(ref64, m.double()(x64)) <= 1e-12  # float64 takes the plain path


def test_fused_conv_relu_sees_new_weights():
    m = FusedConvReLU(torch.randn(4, 3, 3, 3), None, (1, 1), (1, 1), (1, 1), 1)
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        m(x)
        m.load_state_dict({"weight": torch.randn(4, 3, 3, 3)})
        assert rel_l2(F.relu(F.conv2d(x, m.weight, None, 1, 1)), m(x)) <= TOL


class ConvBlock(nn.Module):
    def __init__(self, conv: nn.Module, bn: nn.Module, relu: bool, refuse: str):
        super().__init__()
        self.conv, self.bn, self.relu, self.refuse = conv, bn, relu, refuse

    def forward(self, x):
        c = self.conv(x)
        y = self.bn(c)
        if self.relu:
            y = torch.relu(y)
        if self.refuse == "shared":
            y = y + c.mean()  # the conv output escapes the pattern
        return y


@st.composite
def conv_cases(draw):
    dims = draw(st.sampled_from([1, 2, 2, 3]))
    transposed = draw(st.booleans()) and dims == 2
    groups = draw(st.integers(1, 3))
    cin, cout = groups * draw(st.integers(1, 4)), groups * draw(st.integers(1, 4))
    k, stride = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    pad, dil = draw(st.integers(0, 2)), draw(st.integers(1, 2))
    if transposed:
        pad = min(pad, dil * (k - 1) // 2)  # keeps the transposed output non-empty
    size = [draw(st.integers(max(dil * (k - 1) + 1, 3), 9)) for _ in range(dims)]
    cls = {1: nn.Conv1d, 2: nn.ConvTranspose2d if transposed else nn.Conv2d, 3: nn.Conv3d}[dims]
    extra = {"output_padding": stride - 1} if transposed and dil == 1 else {}
    conv = cls(
        cin,
        cout,
        k,
        stride=stride,
        padding=pad,
        dilation=dil,
        groups=groups,
        bias=draw(st.booleans()),
        **extra,
    )
    bn = _eval_bn({1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[dims], cout)
    refuse = draw(st.sampled_from(["", "", "", "training", "shared"]))
    relu = draw(st.booleans())
    x = torch.randn(draw(st.integers(2, 3)), cin, *size)
    model = ConvBlock(conv, bn, relu, refuse).eval()
    if refuse == "training":
        model.bn.train()  # only the BN: the rest of the model is in eval mode
    return model, x, refuse, relu, transposed


@SETTINGS
@given(case=conv_cases(), method=METHOD)
def test_conv_bn_and_conv_relu_keep_outputs(case, method):
    model, x, refuse, relu, transposed = case
    plan, err = run(model, (x,), ["fusion.conv_bn", "fusion.conv_relu"], method)
    assert err <= TOL
    folds = 0 if refuse else 1
    assert count(plan, "fusion.conv_bn") == folds
    fuses = relu and not transposed and not refuse
    assert count(plan, "fusion.conv_relu") == fuses
    if refuse == "training":
        assert "training mode" in reasons_text(plan, "fusion.conv_bn")
    if refuse == "shared":
        assert "also read by" in reasons_text(plan, "fusion.conv_bn")
