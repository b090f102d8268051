"""fusion.layer_norm: the spellings of a hand-written LayerNorm and the refusals; property tests."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from ._helpers import METHOD, METHODS, SETTINGS, TOL, check, count, reasons, reasons_text, run


class HandNorms(nn.Module):
    """Five spellings of LayerNorm, then three near-misses."""

    def __init__(self, h: int = 13):
        super().__init__()
        self.w, self.b = nn.Parameter(1 + 0.1 * torch.randn(h)), nn.Parameter(torch.randn(h))
        self.w2 = nn.Parameter(torch.randn(5, h))  # normalised over the last two dims

    def forward(self, x, scale):  # x: [B, 5, 13]
        m = x.mean(-1, keepdim=True)
        v = x.var(-1, keepdim=True, unbiased=False)
        x = (x - m) / torch.sqrt(v + 1e-5) * self.w + self.b
        m = x.mean(dim=-1, keepdim=True)
        x = (x - m) * torch.rsqrt(((x - m) ** 2).mean(-1, keepdim=True) + 1e-6)
        m = torch.mean(x, (-2, -1), keepdim=True)
        d = x - m
        x = self.w2 * (d / (d.pow(2).mean((-2, -1), keepdim=True) + 1e-3).sqrt())
        m = x.mean(-1, keepdim=True)
        x = (x - m) / torch.sqrt(torch.var(x, -1, keepdim=True, correction=0) + 1e-5) + self.b
        m = x.mean(-1, keepdim=True)
        x = (x - m) / torch.sqrt(x.var(-1, keepdim=True) + 1e-5) + 1.0  # unbiased: refused
        m = x.mean(1, keepdim=True)
        x = (x - m) / torch.sqrt(((x - m) ** 2).mean(1, keepdim=True) + 1e-5)  # dim 1: refused
        m = x.mean(-1, keepdim=True)
        x = (x - m) / torch.sqrt(((x - m) ** 2).mean(-1, keepdim=True) + 1e-5) * scale
        return x  # the last multiply is by a forward argument: norm fused, multiply kept


@pytest.mark.parametrize("method", METHODS)
def test_layer_norm_spellings_and_refusals(method):
    make = lambda: (torch.randn(3, 5, 13) * 3 + 1, torch.randn(13))  # noqa: E731
    plan, applied = check(
        HandNorms(), make, ["fusion.layer_norm"], method, {"fusion.layer_norm": 5}
    )
    why = " | ".join(reasons(plan, "fusion.layer_norm"))
    assert "unbiased variance" in why
    assert "not its last dim(s)" in why
    assert "not folded into the LayerNorm" in why and "model input scale" in why
    lns = [m for m in applied.gm.modules() if isinstance(m, nn.LayerNorm)]
    assert sorted(m.eps for m in lns) == sorted([1e-5, 1e-6, 1e-3, 1e-5, 1e-5])
    assert sorted(tuple(m.normalized_shape) for m in lns).count((5, 13)) == 1
    eps = sorted(d.site.data["eps"] for d in plan.decisions)
    assert eps == sorted([1e-5, 1e-6, 1e-3, 1e-5, 1e-5])


@st.composite
def ln_cases(draw):
    k = draw(st.integers(1, 2))
    shape = [draw(st.integers(1, 4)) for _ in range(draw(st.integers(0, 2)))] + [
        draw(st.integers(2, 9)) for _ in range(k)
    ]
    return dict(
        shape=shape,
        k=k,
        variance=draw(st.sampled_from(["var", "pow", "mul", "square"])),
        root=draw(st.sampled_from(["div_sqrt", "mul_rsqrt"])),
        affine=draw(st.sampled_from(["none", "w", "wb", "b"])),
        eps=draw(st.sampled_from([1e-12, 1e-6, 1e-5, 1e-3])),
        refuse=draw(st.sampled_from(["", "", "", "unbiased", "dim"])),
    )


class HandLN(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        norm = c["shape"][-c["k"] :]
        self.w = nn.Parameter(1 + 0.2 * torch.randn(norm))
        self.b = nn.Parameter(torch.randn(norm))

    def forward(self, x):
        c = self.c
        dims = tuple(range(-c["k"], 0)) if c["refuse"] != "dim" else (0,)
        m = x.mean(dims, keepdim=True)
        d = x - m
        if c["variance"] == "var" or c["refuse"] == "unbiased":
            v = x.var(dims, keepdim=True, unbiased=c["refuse"] == "unbiased")
        elif c["variance"] == "pow":
            v = d.pow(2).mean(dims, keepdim=True)
        elif c["variance"] == "mul":
            v = (d * d).mean(dims, keepdim=True)
        else:
            v = torch.square(d).mean(dims, keepdim=True)
        if c["root"] == "div_sqrt":
            y = d / torch.sqrt(v + c["eps"])
        else:
            y = d * torch.rsqrt(v + c["eps"])
        if "w" in c["affine"]:
            y = y * self.w
        if "b" in c["affine"]:
            y = y + self.b
        return y


@SETTINGS
@given(case=ln_cases(), method=METHOD)
def test_layer_norm_keeps_outputs(case, method):
    if case["refuse"] == "dim" and len(case["shape"]) == case["k"]:
        case["shape"] = [3, *case["shape"]]  # dim 0 must not be one of the last dims
    x = torch.randn(*case["shape"]) * 2 + 0.5
    # batch and sequence dynamic, the rest static: with nothing else fixing the width, auto
    # would find the normalised dims dynamic too (test_a_width_nothing_fixes_stays_dynamic)
    plan, err = run(HandLN(case).eval(), (x,), ["fusion.layer_norm"], method, "batch,seq")
    assert err <= TOL
    # normalising over dim 0, the batch (which stays dynamic unless a weight of that size
    # ties it down): nn.LayerNorm would fix its size
    over_batch = (
        not case["refuse"] and len(case["shape"]) == case["k"] >= 2 and case["affine"] == "none"
    )
    if over_batch:
        assert count(plan, "fusion.layer_norm") == 0
        assert "whose size follows the input" in reasons_text(plan, "fusion.layer_norm")
        return
    assert count(plan, "fusion.layer_norm") == (0 if case["refuse"] else 1)
    if case["refuse"] == "unbiased":
        assert "unbiased variance" in reasons_text(plan, "fusion.layer_norm")
    if case["refuse"] == "dim":
        assert "not its last dim(s)" in reasons_text(plan, "fusion.layer_norm")
    if not case["refuse"]:
        assert plan.decisions[0].site.data["eps"] == case["eps"]


def test_a_width_nothing_fixes_stays_dynamic():
    case = {
        "shape": [3, 6],
        "k": 1,
        "variance": "var",
        "root": "div_sqrt",
        "affine": "none",
        "eps": 1e-5,
        "refuse": "",
    }
    x = torch.randn(3, 6)
    plan, _ = run(HandLN(case).eval(), (x,), ["fusion.layer_norm"], "fx")
    assert count(plan, "fusion.layer_norm") == 0  # nn.LayerNorm would fix the width at 6
    assert "whose size follows the input" in reasons_text(plan, "fusion.layer_norm")
    case["affine"] = "wb"  # a weight of width 6 fixes it: the fusion applies
    plan, _ = run(HandLN(case).eval(), (x,), ["fusion.layer_norm"], "fx")
    assert count(plan, "fusion.layer_norm") == 1
