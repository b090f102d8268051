"""softmax.softmax: fires on the eager attention of a tiny Llama (scale and mask
folded: masked_softmax), on the softmax and log_softmax ops and the safe softmax written
out; refuses the unsafe form (naming softmax.stable_softmax), a softmax over another dim,
and on a CPU target."""

from __future__ import annotations

import torch
from torch import nn

from opswap.rules._triton import CPU_REASON

from .._triton_models import fired, llama, ops_in, plan, reasons

RULE = "softmax.softmax"


def test_fires_on_the_attention_of_a_tiny_llama_with_the_mask_folded():
    lm, cap = llama()
    p, applied, _ = plan(lm.module, lm.example_inputs, [RULE], captured=cap)
    assert fired(p, RULE) == 2, (p.decisions, p.misses)
    assert ops_in(applied.gm).count(torch.ops.opswap.masked_softmax.default) == 2
    assert all(d.site.data["kernel"] == "masked_softmax" for d in p.decisions)
    p2, _, _ = plan(lm.module, lm.example_inputs, [RULE], target="cpu", captured=cap)
    assert not p2.decisions and all(CPU_REASON in s.reason for s in p2.skipped)


class Forms(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(6).eval()  # a stateful module before the softmaxes
        self.sm = nn.Softmax(dim=-1)

    def forward(self, x):
        x = self.norm(x)
        safe = torch.exp(x - x.amax(-1, keepdim=True))
        a = safe / safe.sum(-1, keepdim=True)  # written out: fires
        b = torch.log_softmax(x * 2.0, dim=-1)  # fires (log_softmax, no scale folded)
        c = self.sm(x / 4.0)  # nn.Softmax with a scale: fires (masked_softmax, no mask)
        u = torch.exp(x)
        d = u / u.sum(-1, keepdim=True)  # unsafe: refused
        e = torch.softmax(x, dim=1)  # not the last dim: refused
        y = a + b + c + d
        y += 1.0  # in place, after
        return y, e


def test_forms_fire_and_misses_say_why():
    torch.manual_seed(3)
    for method in ("fx", "export"):
        m = Forms().eval()
        for x in (torch.randn(3, 6, 37),):
            p, applied, _ = plan(m, (x,), [RULE], method=method)
            kinds = sorted(d.site.data["kernel"] for d in p.decisions)
            assert kinds == ["log_softmax", "masked_softmax", "softmax"], (method, p.decisions)
            why = reasons(p, RULE)
            assert "softmax.stable_softmax" in why and "not its last dim" in why, why
