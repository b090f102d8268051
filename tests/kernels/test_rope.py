"""opswap::rope: the Triton kernel (under TRITON_INTERPRET=1 in one child Python) on q and
k of different head counts in one launch, HF's rotate_half form and GPT-J's interleaved
one, head dims 64 and 128 at odd sequence lengths, cos/sin as [S, D], [B, 1, S, D] and
a table read at positions; forward and backward against float64 in fp32 and bf16, q a
transposed (strided) view as Llama's attention makes it; the CPU op, opcheck, export."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _rows_check as rc  # noqa: E402

from opswap.kernels import rope as R  # noqa: E402

#: (head dim, seq, dtype, interleaved, tables)
CASES = [
    (64, 13, torch.float32, False, "hf"),
    (128, 7, torch.float32, False, "shared"),
    (64, 5, torch.float32, True, "positions"),
    (128, 9, torch.bfloat16, False, "hf"),
    (64, 11, torch.bfloat16, True, "shared"),
]


def _key(c):
    return str([c[0], c[1], str(c[2]), c[3], c[4]])


def freqs(seq: int, dim: int, interleaved: bool, offset=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [S, D] (or [B, S, D] with a per-batch position offset) as Llama and GPT-J
    build them."""
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).double() / dim))
    pos = torch.arange(seq).double()
    pos = pos if offset is None else pos + offset[:, None]
    f = pos[..., None] * inv
    e = f.repeat_interleave(2, -1) if interleaved else torch.cat((f, f), -1)
    return e.cos().float(), e.sin().float()


def _case(d, s, dtype, interleaved, kind):
    g = torch.Generator().manual_seed(d + s)
    b, hq, hk = 2, 3, 1
    q = torch.randn(b, s, hq, d, generator=g).to(rc.DEVICE, dtype).transpose(1, 2)
    k = torch.randn(b, hk, s, d, generator=g).to(rc.DEVICE, dtype)
    pos = None
    if kind == "hf":  # [B, 1, S, D], each sequence at its own offset, in q's dtype
        cos, sin = freqs(s, d, interleaved, torch.tensor([0.0, 3.0]))
        cos, sin = cos[:, None].to(rc.DEVICE, dtype), sin[:, None].to(rc.DEVICE, dtype)
    elif kind == "shared":
        cos, sin = (t.to(rc.DEVICE, dtype) for t in freqs(s, d, interleaved))
    else:  # a table of 4 s positions, read backwards
        cos, sin = (t.to(rc.DEVICE, dtype) for t in freqs(4 * s, d, interleaved))
        pos = torch.arange(s - 1, -1, -1, device=rc.DEVICE) * 3
    qg, kg = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    yq, yk = R.rope(qg, kg, cos, sin, pos, interleaved)
    dq, dk = torch.randn(yq.shape, generator=g).to(dtype), torch.randn(yk.shape, generator=g)
    dq, dk = dq.to(rc.DEVICE), dk.to(rc.DEVICE, dtype)
    torch.autograd.backward([yq, yk], [dq, dk])
    qd, kd = (t.detach().double().requires_grad_() for t in (q, k))
    rq, rk = R.reference(qd, kd, cos.double(), sin.double(), pos, interleaved)
    torch.autograd.backward([rq, rk], [dq.double(), dk.double()])
    # PyTorch in the dtype, as HF writes it: x * cos + rotate_half(x) * sin
    c4, s4 = R.tables(cos, sin, pos)
    eq = q * c4 + R.rotate(q, interleaved) * s4
    return {
        "dtype": str(yq.dtype),
        "shapes": [list(yq.shape), list(yk.shape)],
        "y": max(rc.rel(yq, rq), rc.rel(yk, rk)),
        "y_torch": rc.rel(eq, rq),
        "dq": rc.rel(qg.grad, qd.grad),
        "dk": rc.rel(kg.grad, kd.grad),
    }


@pytest.fixture(scope="module")
def interpreted():
    return rc.run_child(__file__)


@pytest.mark.parametrize("case", CASES, ids=_key)
def test_kernel_in_the_interpreter_matches_float64(interpreted, case):
    d, s, dtype = case[0], case[1], case[2]
    r = interpreted[_key(case)]
    assert r["shapes"] == [[2, 3, s, d], [2, 1, s, d]] and r["dtype"] == str(dtype)
    assert r["y"] <= rc.bound(dtype, r["y_torch"]), r
    assert max(r["dq"], r["dk"]) <= rc.bound(dtype, r["y_torch"]), r


def test_cpu_op_is_hf_apply_rotary_pos_emb():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k = torch.randn(2, 4, 9, 32), torch.randn(2, 2, 9, 32)
    cos, sin = freqs(9, 32, False, torch.tensor([0.0, 5.0]))
    hq, hk = apply_rotary_pos_emb(q, k, cos, sin)  # unsqueezes to [B, 1, S, D] itself
    oq, ok = R.rope(q, k, cos, sin, None, False)
    assert torch.allclose(hq, oq, atol=1e-6) and torch.allclose(hk, ok, atol=1e-6)


def test_bad_shapes_say_what_to_pass():
    with pytest.raises(R.KernelError, match="even head dim"):
        R.triton_apply(*(torch.randn(1, 1, 3, 5),) * 2, *(torch.randn(3, 5),) * 2, None, False)


def test_opcheck_and_export_keep_the_op():
    q, k = torch.randn(2, 3, 5, 16, requires_grad=True), torch.randn(2, 1, 5, 16)
    cos, sin = freqs(5, 16, False)
    torch.library.opcheck(R.rope, (q, k, cos, sin, None, False))
    torch.library.opcheck(R.rope, (q, k, cos.requires_grad_(), sin, None, True))
    torch.library.opcheck(R.rope, (q, k, cos.detach(), sin, torch.tensor([4, 2, 0, 1, 3]), False))

    class Rot(torch.nn.Module):
        def forward(self, q, k, c, s):
            a, b = R.rope(q, k, c, s, None, False)
            return a.sum() + b.sum()

    ep = torch.export.export(Rot(), (q.detach(), k, cos.detach(), sin))
    assert torch.ops.opswap.rope.default in {n.target for n in ep.graph.nodes}


if __name__ == "__main__":  # the interpreter's half of `interpreted`
    print(json.dumps({_key(c): _case(*c) for c in CASES}))
