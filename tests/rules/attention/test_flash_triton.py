"""attention.flash_triton: finds the SDPA calls the kernel takes (causal or not, GQA), leaves
the user's module alone and the rewritten graph equal to it at other shapes, names why it
refuses the rest (an explicit mask, dropout, head dim 96, fp32), and on a CPU target
refuses with the CPU reason."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from opswap.rules._triton import CPU_REASON

from .._triton_models import plan, reasons

RULE = "attention.flash_triton"


class Attn(nn.Module):
    def __init__(self, d=64, heads=4, kv_heads=2):
        super().__init__()
        self.h, self.hk, self.d = heads, kv_heads, d
        self.q = nn.Linear(32, heads * d)
        self.kv = nn.Linear(32, 2 * kv_heads * d)
        self.register_buffer("bias", torch.zeros(32))  # stateful: read after

    def forward(self, x, mask):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.h, self.d).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.hk, self.d).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # fires
        kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        c = F.scaled_dot_product_attention(q, kk, vv, scale=0.3)  # fires
        m = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)  # refused: a mask
        out = (a + c + m).transpose(1, 2).reshape(b, s, -1)[..., :32]
        out += self.bias  # in place, after
        return out


def _inputs(dtype, b=2, s=9):
    g = torch.Generator().manual_seed(s)
    x = torch.randn(b, s, 32, generator=g).to(dtype)
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    return x, mask


def test_finds_causal_and_gqa_sdpa_and_names_the_misses():
    m = Attn().to(torch.bfloat16).eval()
    x = _inputs(torch.bfloat16)
    p, _, _ = plan(m, x, [RULE])
    sites = [d for d in p.decisions if d.rule == RULE] + [
        s for s in p.skipped if getattr(s, "rule", RULE) == RULE
    ]
    assert len(sites) == 2, (p.decisions, p.skipped, p.misses)
    assert "explicit attn_mask" in reasons(p, RULE)
    pc, _, _ = plan(m, x, [RULE], target="cpu")
    assert not pc.decisions and all(CPU_REASON in s.reason for s in pc.skipped)


def test_head_dim_and_dtype_it_cannot_take_are_refused():
    m = Attn(d=96).to(torch.bfloat16).eval()
    p, _, _ = plan(m, _inputs(torch.bfloat16), [RULE])
    assert not p.decisions and "head dim 96" in reasons(p, RULE)
    p32, _, _ = plan(Attn().eval(), _inputs(torch.float32), [RULE])
    assert not p32.decisions and "TF32" in reasons(p32, RULE)
