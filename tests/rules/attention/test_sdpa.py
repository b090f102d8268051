"""attention.sdpa: fires once per attention layer on the zoo's BERT and GPT and on
transformers' eager attention of BERT, GPT-2, Llama (GQA), ViT and T5 (no scale, a
position bias), with and without padding; on hand-written spellings (K stored transposed,
the scale on q or as sqrt(d), boolean, sliding-window and cross attention, bmm, GQA by
repeat_interleave); checks each against the user's module at the example's shapes and at
other batch sizes and lengths, and that the module is unchanged; names its misses (the
weights returned, softmax on dim 1, a head mask, a fill too small)."""

from __future__ import annotations

import copy
import math
from functools import cache

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opswap.api import capture
from opswap.models import load
from opswap.planner import apply_plan, make_plan

from .._shapes import assert_same_at_other_shapes

RULE = "attention.sdpa"
SDPA = torch.ops.aten.scaled_dot_product_attention.default


def run(model, inputs, rel=1e-5, captured=None):
    """(plan, applied): the rule planned on a CPU target and applied; the result equals the
    user's module at the example and at other shapes, and the module is unchanged."""
    before = copy.deepcopy(model.state_dict())
    cap = captured or capture(model, inputs)
    plan = make_plan(cap, rules=[RULE], target="cpu")
    applied = apply_plan(cap, plan)
    assert not plan.failed and not applied.failed, (plan.failed, applied.failed)
    assert not plan.skipped, plan.skipped  # the planner takes every site on this CPU
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with torch.no_grad():
        want, got = model(*inputs), applied.gm(*inputs)
    want = want[0] if isinstance(want, (tuple, list)) else want
    got = got[0] if isinstance(got, (tuple, list)) else got
    assert ((want - got).norm() / want.norm()).item() <= rel
    assert assert_same_at_other_shapes(model, cap, applied.gm, rel=rel) >= 2
    return plan, applied


def sdpa_calls(gm) -> list:
    return [n for n in gm.graph.nodes if n.target is SDPA]


def reasons(plan) -> str:
    return " | ".join(m.reason for m in plan.misses if m.rule == RULE)


def masks(plan) -> list[str]:
    return [d.site.data["mask"] for d in plan.decisions if d.rule == RULE]


@pytest.mark.parametrize("spec, mask", [("zoo:bert", "no mask"), ("zoo:gpt", "causal")])
def test_zoo_models(spec, mask):
    lm = load(spec)
    plan, applied = run(lm.module, lm.example_inputs)
    assert masks(plan) == [mask, mask]  # two layers
    calls = sdpa_calls(applied.gm)
    assert len(calls) == 2 and all(c.kwargs["scale"] == 0.25 for c in calls)
    assert all(c.args[5] == (mask == "causal") for c in calls)


@cache
def hf(spec: str, **overrides: str):
    lm = load(spec, dict(overrides))
    return lm, capture(lm.module, lm.example_inputs)


HF = [
    # spec, overrides, matches, mask kind, groups
    ("hf:bert", dict(num_hidden_layers="1"), 1, "additive mask", 1),  # padded
    ("hf:gpt2", dict(n_layer="1"), 1, "additive mask", 1),  # causal + padding
    ("hf:llama", dict(num_hidden_layers="1"), 1, "additive mask", 2),  # GQA 4:2, padded
    ("hf:llama", dict(num_hidden_layers="1", mask="none"), 1, "causal", 2),
    ("hf:vit", dict(num_hidden_layers="1"), 1, "no mask", 1),
    # encoder self, decoder self and cross attention; no scale, a position bias
    ("hf:t5", dict(num_layers="1", num_decoder_layers="1"), 3, "additive mask", 1),
]


@pytest.mark.parametrize("spec, overrides, n, mask, groups", HF)
def test_transformers_eager_attention(spec, overrides, n, mask, groups):
    lm, cap = hf(spec, **overrides)
    plan, applied = run(lm.module, lm.example_inputs, captured=cap)
    assert masks(plan) == [mask] * n, (plan.decisions, plan.misses)
    assert all(d.site.data["groups"] == groups for d in plan.decisions)
    calls = sdpa_calls(applied.gm)
    assert len(calls) == n
    assert all(c.kwargs.get("enable_gqa", False) == (groups > 1) for c in calls)
    if spec == "hf:t5":
        assert all(c.kwargs["scale"] == 1.0 for c in calls)


class Spellings(nn.Module):
    """Hand-written attention in six spellings, around a BatchNorm in eval mode and a
    buffer; an in-place add after."""

    def __init__(self, d=8, heads=4):
        super().__init__()
        self.h, self.d = heads, d
        self.qkv = nn.Linear(16, 3 * heads * d)
        self.norm = nn.BatchNorm1d(16).eval()
        with torch.no_grad():
            self.norm.running_mean.uniform_(-1, 1)
            self.norm.running_var.uniform_(0.5, 2)
        self.register_buffer("shift", torch.randn(16))

    def forward(self, x, mem, keep):  # x: [B, S, 16], mem: [B, T, 16], keep: [B, 1, 1, S] bool
        b, s = x.shape[0], x.shape[1]
        x = self.norm(x.transpose(1, 2)).transpose(1, 2) + self.shift
        q, k, v = self.qkv(x).view(b, s, 3, self.h, self.d).permute(2, 0, 3, 1, 4).unbind(0)
        d = q.size(-1)
        kt = k.permute(0, 1, 3, 2)  # K stored transposed, [B, H, D, S]
        a = torch.softmax((q * d**-0.5) @ kt, dim=-1) @ v  # scale on q, from a size
        w = (q @ k.transpose(-2, -1)) / math.sqrt(d)
        w = w.masked_fill(~keep, float("-inf"))  # boolean padding mask
        c = F.softmax(w, dim=-1) @ v
        i = torch.arange(s)
        window = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 3)  # sliding window
        w = torch.where(window, q @ k.mT * 0.3, torch.finfo(q.dtype).min)
        e = w.float().softmax(-1).to(q.dtype) @ v  # casts around the softmax
        _, mk, mv = self.qkv(mem).view(b, -1, 3, self.h, self.d).permute(2, 0, 3, 1, 4).unbind(0)
        f = torch.softmax(q @ mk.transpose(2, 3) * 0.35, -1) @ mv  # cross-attention, length T
        g3 = torch.bmm(q.reshape(-1, s, self.d), k.reshape(-1, s, self.d).transpose(1, 2))
        g = torch.softmax(g3 / 3.0, dim=-1).bmm(v.reshape(-1, s, self.d)).view_as(q)  # bmm
        kv, vv = k[:, :2], v[:, :2]  # two kv heads, repeated for four query heads
        kr, vr = kv.repeat_interleave(2, dim=1), vv.repeat_interleave(2, dim=1)
        h = torch.softmax(q @ kr.transpose(-2, -1) * 0.4, dim=-1) @ vr
        y = (a + c + e + f + g + h).transpose(1, 2).reshape(b, s, -1)
        y += 1.0  # in place, after
        return y


def _spelling_inputs(b=3, s=7, t=5):
    keep = torch.ones(b, 1, 1, s, dtype=torch.bool)
    keep[0, ..., s - 2 :] = False
    return torch.randn(b, s, 16), torch.randn(b, t, 16), keep


def test_hand_written_spellings_and_a_row_with_every_key_masked():
    torch.manual_seed(0)
    m = Spellings().eval()
    plan, applied = run(m, _spelling_inputs())
    kinds = sorted(masks(plan))
    assert kinds == sorted(
        ["no mask", "boolean mask", "additive mask", "no mask", "no mask", "no mask"]
    ), (plan.decisions, plan.misses)
    gqa = [d for d in plan.decisions if d.site.data["groups"] == 2]
    assert len(gqa) == 1
    scales = sorted(round(d.site.data["scale"], 6) for d in plan.decisions)
    assert scales == sorted(round(x, 6) for x in [8**-0.5, 8**-0.5, 0.3, 0.35, 1 / 3, 0.4])

    # a row with every key masked is NaN in eager's softmax; SDPA gives 0, the rewrite NaN
    x, mem, keep = _spelling_inputs(2, 6, 4)
    keep[1] = False  # every key of batch 1 masked: eager's softmax gives NaN there
    with torch.no_grad():
        want, got = m(x, mem, keep), applied.gm(x, mem, keep)
    assert want[1].isnan().all() and torch.allclose(want, got, atol=1e-5, equal_nan=True)


class Misses(nn.Module):
    def forward(self, q, k, v, head_mask):  # [B, H, S, D], head_mask [1, H, 1, 1]
        s = q @ k.transpose(-2, -1) * 0.5
        p = torch.softmax(s, dim=-1)
        out = p @ v  # the weights are returned too: refused
        p1 = torch.softmax(q @ k.transpose(-2, -1), dim=1)  # softmax over the queries
        p2 = torch.softmax(q @ k.transpose(-2, -1), dim=-1) * head_mask  # a head mask
        s3 = (q @ k.transpose(-2, -1)).masked_fill(head_mask < 0, -1e4)  # fill too small
        return out + p1 @ v + p2 @ v + torch.softmax(s3, -1) @ v, p


def test_misses_say_why():
    m = Misses()
    x = [torch.randn(2, 3, 5, 4) for _ in range(3)] + [torch.randn(1, 3, 1, 1)]
    plan = make_plan(capture(m, tuple(x)), rules=[RULE], target="cpu")
    assert not plan.decisions, plan.decisions
    why = reasons(plan)
    assert "also read by" in why and "output_attentions" in why, why
    assert "not the last (keys) dim" in why
    assert "head mask" in why
    assert "-10000.0" in why and "below -1e30" in why


class Local(nn.Module):
    """Attention over a window of `window` keys; the mask is a buffer cropped to the length
    (GPT-2's `bias` style) or built with arange at run time; causal or both ways."""

    def __init__(self, window: int | None, causal: bool, buffer: bool, maxlen: int = 128):
        super().__init__()
        self.qkv, self.o = nn.Linear(16, 48), nn.Linear(16, 16)
        self.window, self.causal, self.buffer = window, causal, buffer
        self.register_buffer("keep", self._keep(torch.arange(maxlen)))

    def _keep(self, i):
        keep = i[None, :] <= i[:, None]  # no window: plain causal
        if self.window is not None:
            near = (i[:, None] - i[None, :]).abs() < self.window
            keep = keep & near if self.causal else near
        return keep

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (y.view(b, t, 2, 8).transpose(1, 2) for y in self.qkv(x).chunk(3, -1))
        s = q @ k.transpose(-2, -1) / math.sqrt(8)
        keep = self.keep[:t, :t] if self.buffer else self._keep(torch.arange(t))
        s = s.masked_fill(~keep, float("-inf"))
        return self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(b, t, 16))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("buffer", [True, False])
def test_a_sliding_window_wider_than_the_example_stays_a_mask(causal, buffer):
    # at lengths 16 and 15 the window of 24 hides nothing more than causal (or nothing):
    # read as a flag it would compute full attention at length 40
    torch.manual_seed(0)
    m = Local(24, causal, buffer).eval()
    plan, applied = run(m, (torch.randn(2, 16, 16),))
    assert masks(plan) == ["boolean mask"], plan.decisions
    for t in (25, 40, 100):
        x = torch.randn(1, t, 16)
        with torch.no_grad():
            torch.testing.assert_close(applied.gm(x), m(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("buffer", [True, False])
def test_a_causal_mask_is_still_proven_causal_at_every_length(buffer):
    torch.manual_seed(0)
    # a buffer whose window is wider than the buffer is causal wherever the model runs; an
    # arange-built window of 10000 is not causal at length 10001, so only no window is
    m = Local(10_000 if buffer else None, True, buffer, maxlen=96).eval()
    plan, applied = run(m, (torch.randn(2, 16, 16),))
    assert masks(plan) == ["causal"], plan.decisions
    x = torch.randn(1, 90, 16)
    with torch.no_grad():
        torch.testing.assert_close(applied.gm(x), m(x), rtol=1e-5, atol=1e-5)


#: the head size's scale as users write it: read off a size, never a number in the code
HEAD_SCALES = {
    "math.sqrt(q.shape[-1])": lambda q: math.sqrt(q.shape[-1]),
    "q.size(-1) ** 0.5": lambda q: q.size(-1) ** 0.5,
    "q.shape[-1] ** -0.5, a product": lambda q: 1.0 / q.shape[-1] ** -0.5,
    "torch.sqrt(torch.tensor(q.shape[-1]))": lambda q: torch.sqrt(torch.tensor(q.shape[-1])),
    "torch.tensor(q.shape[-1], dtype=q.dtype).sqrt()": lambda q: torch.tensor(
        q.shape[-1], dtype=q.dtype
    ).sqrt(),
}


class HeadScaled(nn.Module):
    """Attention scaled by the square root of its head size, read off q's shape; with
    `branch`, an `if` on the length that FX cannot trace, so capture takes torch.export."""

    def __init__(self, scale: str, heads: int = 3, d: int = 6, branch: bool = False):
        super().__init__()
        self.scale, self.h, self.branch = HEAD_SCALES[scale], heads, branch
        self.qkv, self.o = nn.Linear(heads * d, 3 * heads * d), nn.Linear(heads * d, heads * d)

    def forward(self, x):  # x: [B, T, H * D]
        b, t, w = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.h, w // self.h).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-2, -1) / self.scale(q)
        out = (s.softmax(-1) @ v).transpose(1, 2).reshape(b, t, w)
        if self.branch and t > 1:
            out = out + 0.0
        return self.o(out)


@pytest.mark.parametrize("scale", list(HEAD_SCALES))
@pytest.mark.parametrize("route", ["fx", "export", "auto past a branch FX cannot trace"])
def test_a_head_size_scale_read_off_a_dynamic_shape_is_static(scale, route):
    # batch and length are dynamic, the head size 6 is not: sqrt(6) is a constant scale
    torch.manual_seed(0)
    model = HeadScaled(scale, branch=route.startswith("auto")).eval()
    x = torch.randn(2, 7, 18)
    method = "auto" if route.startswith("auto") else route
    try:
        cap = capture(model, (x,), method)
    except Exception as e:  # torch.tensor of a traced size: FX cannot trace it, export can
        assert route == "fx" and "torch.tensor" in scale, e
        return
    assert cap.method == ("export" if route != "fx" else "fx")
    assert {a.name for a in cap.dynamic.axes} >= {"batch"} and len(cap.dynamic.axes) == 2
    plan, applied = run(model, (x,), captured=cap)
    assert reasons(plan) == ""
    calls = sdpa_calls(applied.gm)
    assert len(calls) == 1 and calls[0].kwargs["scale"] == pytest.approx(6**-0.5)
