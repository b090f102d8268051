"""rules/conv/_decompose: at full rank every split reproduces the conv to rounding at odd
settings (stride, padding, dilation, non-square kernels and images, batch 1), which a
wrong reshape or a misplaced stride would break; the composed kernel is what the chain
computes, groups included; truncation errs as the singular values say; CP-ALS recovers
a tensor of low CP rank; the stacked fit finds a kernel two 3x3s compose; the ranks a
FLOP budget allows grow with the budget; bad input is refused in a sentence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opswap.errors import RuleError
from opswap.rules.conv import _decompose as D

CONVS = [
    dict(c=5, o=7, k=(3, 3), stride=2, padding=0, dilation=1),
    dict(c=6, o=4, k=(3, 5), stride=(1, 2), padding=(2, 1), dilation=(2, 1)),
    dict(c=3, o=9, k=(5, 5), stride=1, padding=2, dilation=2),
]


def _conv(spec: dict) -> nn.Conv2d:
    s = dict(spec)
    return nn.Conv2d(s.pop("c"), s.pop("o"), s.pop("k"), **s).double()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


@pytest.mark.parametrize("spec", CONVS)
@pytest.mark.parametrize("method", ["channel", "spatial", "depthwise", "cp"])
def test_full_rank_reproduces_the_conv(spec, method):
    torch.manual_seed(0)
    conv = _conv(spec)
    layer = D.layer_of(conv)
    dec = D.fit(layer, method, 10_000)
    for shape in [(1, spec["c"], 13, 10), (3, spec["c"], 9, 17)]:
        x = torch.randn(*shape, dtype=torch.float64)
        want = conv(x)
        got = dec.module(torch.float64)(x)
        assert got.shape == want.shape
        assert _rel(got, want) < 1e-5, (method, spec, _rel(got, want))
    assert dec.weight_error < 1e-5
    assert dec.layers[-1].bias is not None and all(la.bias is None for la in dec.layers[:-1])


@pytest.mark.parametrize("groups", [1, 2])
def test_the_composed_kernel_is_what_the_chain_computes(groups):
    torch.manual_seed(1)
    layers = (
        D.Layer(torch.randn(6, 4 // groups, 3, 2, dtype=torch.float64), groups=groups),
        D.Layer(torch.randn(4, 6 // groups, 2, 3, dtype=torch.float64), groups=groups),
        D.Layer(torch.randn(5, 4, 1, 1, dtype=torch.float64)),
    )
    x = torch.randn(2, 4, 11, 9, dtype=torch.float64)
    chain = x
    for la in layers:
        chain = la(chain)
    k = D.composed(layers)
    assert k.shape == (5, 4, 4, 4)
    assert _rel(F.conv2d(x, k), chain) < 1e-10


def test_truncation_errs_as_the_singular_values_say():
    torch.manual_seed(2)
    layer = D.layer_of(_conv(CONVS[0]).float())
    s = torch.linalg.svdvals(layer.weight.reshape(7, -1))
    for r in (1, 3, 5):
        dec = D.channel_svd(layer, r)
        assert abs(dec.weight_error - float(s[r:].norm() / s.norm())) < 1e-9
        assert dec.rank == r and dec.layers[0].out_channels == r
    r = D.channel_rank(layer, 0.3)
    assert D.channel_svd(layer, r).weight_error <= 0.3 < D.channel_svd(layer, r - 1).weight_error


def test_cp_als_recovers_a_tensor_of_low_cp_rank():
    torch.manual_seed(3)
    t = D.cp_tensor([torch.randn(n, 3, dtype=torch.float64) for n in (8, 5, 3, 3)])
    _, err = D.cp_als(t, 3, iters=200)
    assert err < 1e-4
    _, err1 = D.cp_als(t, 1, iters=50)
    assert err1 > 0.05


def test_the_stacked_fit_finds_a_kernel_two_3x3s_compose():
    torch.manual_seed(4)
    a, b = (
        torch.randn(2, 5, 3, 3, dtype=torch.float64),
        torch.randn(6, 2, 3, 3, dtype=torch.float64),
    )
    layer = D.Layer(D.compose(a, b), torch.randn(6, dtype=torch.float64), (1, 1), (2, 2))
    dec = D.stacked_3x3(layer, 6)
    assert dec.weight_error < 0.05
    assert [la.kernel_size for la in dec.layers] == [(3, 3), (3, 3)]
    assert dec.layers[0].padding == (2, 2) and dec.layers[1].padding == (0, 0)
    x = torch.randn(1, 5, 7, 12, dtype=torch.float64)
    assert D.output_error(layer, dec, x) < 0.05
    seven = D.Layer(torch.randn(4, 4, 7, 7, dtype=torch.float64), stride=(2, 2), padding=(3, 3))
    dec = D.stacked_3x3(seven, 4, iters=3)
    assert len(dec.layers) == 3 and dec.layers[-1].stride == (2, 2)
    assert (
        dec(torch.randn(1, 4, 9, 10, dtype=torch.float64)).shape
        == seven(torch.randn(1, 4, 9, 10, dtype=torch.float64)).shape
    )


def test_the_rank_a_budget_allows_grows_with_it():
    layer = D.layer_of(nn.Conv2d(16, 32, 3, padding=1))
    for method in ("channel", "spatial", "cp", "depthwise"):
        ranks = [D.max_rank(layer, method, 12, 12, keep) for keep in (0.2, 0.5, 0.9)]
        assert ranks == sorted(ranks) and ranks[-1] > 0, (method, ranks)
        dec = D.fit(layer, method, ranks[1])
        assert dec.macs(12, 12) <= 0.5 * layer.macs(12, 12)


def test_bad_input_is_refused_in_a_sentence():
    with pytest.raises(RuleError, match="padding_mode='reflect'"):
        D.layer_of(nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"))
    with pytest.raises(RuleError, match="not an nn.Conv2d"):
        D.layer_of(nn.Conv1d(2, 2, 3))
    grouped = D.layer_of(nn.Conv2d(4, 4, 3, groups=2))
    with pytest.raises(RuleError, match="groups=2"):
        D.channel_svd(grouped, 2)
    with pytest.raises(RuleError, match="rank must be a positive integer"):
        D.fit(grouped, "cp", 0)
    with pytest.raises(RuleError, match="method must be one of"):
        D.fit(grouped, "tucker", 2)
    with pytest.raises(RuleError, match="kernel is 3x3"):
        D.stacked_3x3(grouped)
