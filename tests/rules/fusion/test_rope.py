"""fusion.rope: fires once per layer of a tiny Llama (q and k in one op), on a
hand-written apply_rotary_pos_emb over GQA heads at another head dim; a lone rotation
takes the op alone; refused on a CPU target and for a 3-D input."""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, rotate_half

from opswap.rules._triton import CPU_REASON

from .._triton_models import fired, llama, ops_in, plan, reasons

RULE = "fusion.rope"


def test_fires_once_per_layer_of_a_tiny_llama():
    lm, cap = llama()
    p, applied, _ = plan(lm.module, lm.example_inputs, [RULE], captured=cap)
    assert fired(p, RULE) == 2, (p.decisions, p.misses)
    assert ops_in(applied.gm).count(torch.ops.opswap.rope.default) == 2
    assert all(d.site.data["k"] for d in p.decisions)
    p2, _, _ = plan(lm.module, lm.example_inputs, [RULE], target="cpu", captured=cap)
    assert not p2.decisions and all(CPU_REASON in s.reason for s in p2.skipped)


class Attn(nn.Module):
    """q with 4 heads, k with 2 (GQA), head dim 24; plus a lone rotation of a 3-D v."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(32, 4 * 24), nn.Linear(32, 2 * 24)
        inv = 1.0 / (10000 ** (torch.arange(0, 24, 2).float() / 24))
        self.register_buffer("inv", inv)

    def forward(self, x):
        b, s, _ = x.shape
        f = torch.arange(s, dtype=torch.float32)[:, None] * self.inv
        emb = torch.cat((f, f), -1)[None].expand(b, -1, -1)
        cos, sin = emb.cos(), emb.sin()
        q = self.q(x).view(b, s, 4, 24).transpose(1, 2)
        k = self.k(x).view(b, s, 2, 24).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        v = x[..., :24]
        v = v * cos + rotate_half(v) * sin  # 3-D: refused
        return q.sum(1) + k.sum(1), v


def test_gqa_heads_fire_and_a_3d_rotation_is_refused():
    torch.manual_seed(6)
    p, applied, _ = plan(Attn().eval(), (torch.randn(2, 7, 32),), [RULE], method="export")
    assert fired(p, RULE) == 1, (p.decisions, p.misses)
    assert "is not [B, H, S, D]" in reasons(p, RULE)
