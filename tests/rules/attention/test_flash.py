"""attention.flash: on the h200 target a tiny bf16 attention block (GQA, a padding
mask, causal) matches at each SDPA call; with no measured crossover the planner keeps
SDPA, saying so, and with a measured win it installs opswap::flash_attention, whose
result matches the user's module at other shapes; head dim 96, dropout, fp32 and a CPU
target are refused with their reasons."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opswap.graph.capture import capture
from opswap.kernels import crossover
from opswap.planner import make_plan
from opswap.rules._triton import CPU_REASON

from .._triton_models import fired, ops_in, plan, reasons

RULE = "attention.flash"


class Block(nn.Module):
    """Self-attention with 4 query heads over 2 kv heads (head dim `d`), a key-padding
    mask derived from the input, a causal second pass, a buffer and an in-place add."""

    def __init__(self, d=64, dropout=0.0):
        super().__init__()
        self.d, self.dropout = d, dropout
        self.q = nn.Linear(32, 4 * d)
        self.kv = nn.Linear(32, 2 * 2 * d)
        self.o = nn.Linear(4 * d, 32)
        self.register_buffer("gain", torch.full((32,), 0.5))

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 4, self.d).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, 2, self.d).permute(2, 0, 3, 1, 4)
        keep = (x[..., 0] > -3.0)[:, None, None, :]  # a padding mask: [B, 1, 1, S]
        a = F.scaled_dot_product_attention(
            q, k, v, attn_mask=keep, dropout_p=self.dropout, enable_gqa=True
        )
        a = F.scaled_dot_product_attention(a, a, a, is_causal=True, scale=0.3)
        out = self.o(a.transpose(1, 2).reshape(b, s, -1))
        out.add_(x * self.gain)
        return out


def _inputs(dtype=torch.bfloat16):
    torch.manual_seed(0)
    return (torch.randn(2, 11, 32, dtype=dtype),)


def _measured(tmp_path, monkeypatch, beats: bool):
    """A crossover table where every flash_attention class of the block is measured."""
    entries = [
        crossover.Entry(
            "flash_attention", "sm90", "bfloat16", crossover.attention_shape(11, 11, 64, c),
            "forward", beats, None, 1.3 if beats else 0.7, None, "measured test.json",
        ).to_json()
        for c in (False, True)
    ]  # fmt: skip
    path = tmp_path / "crossover.json"
    path.write_text(json.dumps({"entries": entries}))
    monkeypatch.setattr(crossover, "TABLE", path)


def test_matches_each_sdpa_and_keeps_sdpa_until_measured(tmp_path, monkeypatch):
    path = tmp_path / "crossover.json"  # a table with no flash_attention measurement
    path.write_text(json.dumps({"entries": []}))
    monkeypatch.setattr(crossover, "TABLE", path)
    model = Block().to(torch.bfloat16).eval()
    p, applied, _ = plan(model, _inputs(), [RULE], method="export")
    assert fired(p, RULE) == 0 and len(p.skipped) == 2, (p.decisions, p.misses)
    assert all("none yet" in s.reason for s in p.skipped)
    assert torch.ops.opswap.flash_attention.default not in ops_in(applied.gm)


def test_installs_the_kernel_where_measured_faster(tmp_path, monkeypatch):
    _measured(tmp_path, monkeypatch, beats=True)
    model = Block().to(torch.bfloat16).eval()
    for method in ("export", "fx"):
        p, applied, _ = plan(model, _inputs(), [RULE], method=method)
        assert fired(p, RULE) == 2, (method, p.decisions, p.misses, p.skipped)
        assert ops_in(applied.gm).count(torch.ops.opswap.flash_attention.default) == 2
        assert any(d.site.data.get("mask") for d in p.decisions)


def test_a_measured_loss_is_skipped(tmp_path, monkeypatch):
    _measured(tmp_path, monkeypatch, beats=False)
    p, _, _ = plan(Block().to(torch.bfloat16).eval(), _inputs(), [RULE], method="export")
    assert fired(p, RULE) == 0 and all("0.7x" in s.reason for s in p.skipped), p.skipped


@pytest.mark.parametrize(
    "model, dtype, why",
    [
        (Block(d=96), torch.bfloat16, "head dim 96"),
        (Block(dropout=0.1), torch.bfloat16, "dropout p=0.1"),
        (Block(), torch.float32, "float32 attention"),
    ],
    ids=["head-dim-96", "dropout", "fp32"],
)
def test_refuses_what_the_kernel_does_not_take(model, dtype, why):
    model = model.to(dtype).eval()
    cap = capture(model, _inputs(dtype), method="export")
    p = make_plan(cap, rules=[RULE], target="h200")
    assert fired(p, RULE) == 0 and why in reasons(p, RULE), reasons(p, RULE)


def test_a_cpu_target_keeps_sdpa_with_the_reason(tmp_path, monkeypatch):
    _measured(tmp_path, monkeypatch, beats=True)
    model = Block().to(torch.bfloat16).eval()
    p, _, _ = plan(model, _inputs(), [RULE], method="export", target="cpu")
    assert not p.decisions and p.skipped and all(CPU_REASON in s.reason for s in p.skipped)
