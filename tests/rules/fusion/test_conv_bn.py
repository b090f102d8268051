"""fusion.conv_bn: where it folds (every kind of conv, both capture flavours), where it refuses
and why, and that state_dict keys and shared modules are handled.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opswap.graph.ops import op_kind

from ._helpers import METHODS, TOL, _bn, _first, check, fired, images, optimize, reasons, rel_l2


class ConvBNs(nn.Module):
    """Conv1d/2d/3d, grouped, bias-free, transposed and functional convs, each then a BN."""

    def __init__(self):
        super().__init__()
        self.c2 = nn.Conv2d(13, 12, 3, stride=2, padding=1, groups=1)
        self.b2 = _bn(nn.BatchNorm2d, 12)
        self.g2 = nn.Conv2d(12, 12, 3, padding=1, groups=4, bias=False)
        self.bg = _bn(nn.BatchNorm2d, 12)
        self.t2 = nn.ConvTranspose2d(12, 6, 3, stride=2, groups=3)
        self.bt = _bn(nn.BatchNorm2d, 6)
        self.w = nn.Parameter(torch.randn(5, 6, 1, 1))
        self.bf = _bn(nn.BatchNorm2d, 5)
        self.c1 = nn.Conv1d(13, 7, 2, dilation=2)
        self.b1 = _bn(nn.BatchNorm1d, 7)
        self.c3 = nn.Conv3d(13, 4, (1, 3, 3), padding=(0, 1, 1))
        self.b3 = _bn(nn.BatchNorm3d, 4)

    def forward(self, x):  # x: [B, 13, 5, 7]
        y = self.bg(self.g2(self.b2(self.c2(x))))
        y = self.bt(self.t2(y))
        y = self.bf(F.conv2d(y, self.w))
        z = self.b1(self.c1(x.flatten(2)))
        v = self.b3(self.c3(x.unsqueeze(2)))
        return y.mean((2, 3)).sum(1) + z.mean((1, 2)) + v.mean((1, 2, 3, 4))


@pytest.mark.parametrize("method", METHODS)
def test_conv_bn_folds_every_kind_of_conv(method):
    plan, applied = check(
        ConvBNs(), images(3, 13, 5, 7), ["fusion.conv_bn"], method, {"fusion.conv_bn": 6}
    )
    assert not reasons(plan, "fusion.conv_bn")
    assert "batch_norm" not in [op_kind(n) for n in applied.gm.graph.nodes]


class ConvBNCases(nn.Module):
    """Four conv+BN pairs, three of which must be refused."""

    def __init__(self):
        super().__init__()
        self.ok, self.bn_ok = nn.Conv2d(13, 13, 3, padding=1), _bn(nn.BatchNorm2d, 13)
        self.tr, self.bn_tr = nn.Conv2d(13, 13, 1), _bn(nn.BatchNorm2d, 13)
        self.sh, self.bn_sh = nn.Conv2d(13, 13, 1), _bn(nn.BatchNorm2d, 13)

    def forward(self, x, w):
        y = self.bn_ok(self.ok(x))
        y = self.bn_tr(self.tr(y))  # bn_tr alone is put in training mode
        s = self.sh(y)
        y = self.bn_sh(s) + s  # the conv output is read twice
        return self.bn_ok(F.conv2d(y, w, padding=1))  # weight is a forward argument


def _cases():
    m = ConvBNCases().eval()
    m.bn_tr.train()
    return m


@pytest.mark.parametrize("method", METHODS)
def test_conv_bn_refuses_with_reasons(method):
    model = _cases()
    inputs = (torch.randn(3, 13, 5, 7), torch.randn(13, 13, 3, 3))
    plan, applied = optimize(model, inputs, ["fusion.conv_bn"], method)
    assert fired(plan, "fusion.conv_bn") == 1
    why = " | ".join(reasons(plan, "fusion.conv_bn"))
    assert "is in training mode" in why
    assert "output is also read by" in why and "cannot be folded" in why
    assert "weight of" in why and "not a constant" in why and "model input w" in why
    # training-mode BN keeps its batch statistics: compare in the same mode on the same batch
    new = (torch.randn(3, 13, 5, 7), torch.randn(13, 13, 3, 3))
    with torch.no_grad():
        assert rel_l2(model(*new), _first(applied.gm(*new))) <= TOL


@pytest.mark.parametrize("method", METHODS)
def test_conv_bn_refuses_non_constant_statistics(method):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(13, 4, 3)

        def forward(self, x, mean):
            return F.batch_norm(self.conv(x), mean, torch.ones(4) * 2, training=False)

    plan, _ = optimize(
        M().eval(), (torch.randn(3, 13, 5, 7), torch.randn(4)), ["fusion.conv_bn"], method
    )
    assert fired(plan, "fusion.conv_bn") == 0
    assert any(
        "running mean" in r and "not a constant" in r for r in reasons(plan, "fusion.conv_bn")
    )


def test_conv_bn_keeps_state_dict_keys_in_fx():
    plan, applied = optimize(
        nn.Sequential(nn.Conv2d(13, 8, 3), _bn(nn.BatchNorm2d, 8)).eval(),
        (torch.randn(3, 13, 5, 7),),
        ["fusion.conv_bn"],
        "fx",
    )
    assert set(applied.gm.state_dict()) == {"0.weight", "0.bias"}
    assert all(
        type(t) is torch.nn.Parameter or isinstance(t, torch.Tensor)
        for t in applied.gm.state_dict().values()
    )


def test_conv_bn_folds_a_shared_conv_module_into_a_copy():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(13, 13, 1), _bn(nn.BatchNorm2d, 13)

        def forward(self, x):
            return self.conv(self.bn(self.conv(x)))  # the same conv called twice

    check(M(), images(3, 13, 5, 7), ["fusion.conv_bn"], "fx", {"fusion.conv_bn": 1})


@pytest.mark.parametrize("method", ["fx", "export"])
def test_conv_bn_folds_and_refuses_training_mode(method):
    """The example of docs/writing-a-rule.md."""
    model = nn.Sequential(
        nn.Conv2d(13, 12, 3, padding=1),
        _bn(nn.BatchNorm2d, 12),
        nn.Conv2d(12, 5, 1),
        _bn(nn.BatchNorm2d, 5),
    )
    model.eval()[3].train()
    plan, applied = optimize(model, (torch.randn(3, 13, 5, 7),), ["fusion.conv_bn"], method)
    assert fired(plan, "fusion.conv_bn") == 1
    assert any("training mode" in r for r in reasons(plan, "fusion.conv_bn"))
