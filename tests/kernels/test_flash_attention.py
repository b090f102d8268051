"""opswap::flash_attention: the Triton forward (under TRITON_INTERPRET=1 in one child Python;
on a GPU the compiled kernel) against float64 attention on odd lengths, causal and not,
S_q != S_k, padding by key lengths, grouped-query heads, head dims 64 and 128; gradients
through the op; the CPU op, opcheck and torch.export."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _rows_check as rc  # noqa: E402

from opswap.kernels import flash_attention as FA  # noqa: E402

# (batch, heads, kv heads, S_q, S_k, head dim, causal, key lengths, dtype)
CASES = [
    (1, 2, 2, 17, 17, 64, False, None, torch.float32),
    (2, 4, 2, 33, 50, 64, True, None, torch.float32),  # GQA, causal with S_q < S_k
    (1, 2, 2, 40, 9, 64, True, None, torch.float32),  # causal with S_q > S_k
    (2, 2, 1, 20, 37, 128, False, [37, 5], torch.float32),  # padding, one kv head
    (1, 8, 2, 1, 100, 128, False, None, torch.float32),  # one query token (decode)
    (2, 2, 2, 23, 23, 64, True, [23, 11], torch.bfloat16),
    (1, 2, 1, 31, 31, 128, False, None, torch.float16),
]


def _key(c):
    return str([*c[:7], c[7], str(c[8])])


def _case(b, h, hk, sq, sk, d, causal, lens, dtype):
    g = torch.Generator().manual_seed(sq * 31 + sk)
    q = torch.randn(b, h, sq, d, generator=g).to(rc.DEVICE, dtype)
    k = torch.randn(b, hk, sk, d, generator=g).to(rc.DEVICE, dtype)
    v = torch.randn(b, hk, sk, d, generator=g).to(rc.DEVICE, dtype)
    lengths = torch.tensor(lens, dtype=torch.int32, device=rc.DEVICE) if lens else None
    o = FA.flash_attention(q, k, v, causal=causal, lengths=lengths)
    truth = FA.reference(q.double(), k.double(), v.double(), causal, None, lengths)
    own = FA.reference(q, k, v, causal, None, lengths)  # PyTorch's math in the dtype
    return {
        "shape": list(o.shape),
        "dtype": str(o.dtype),
        "err": rc.rel(o, truth),
        "err_torch": rc.rel(own, truth),
        "finite": bool(torch.isfinite(o).all()),
    }


@pytest.fixture(scope="module")
def interpreted():
    return rc.run_child(__file__)


@pytest.mark.parametrize("case", CASES, ids=_key)
def test_kernel_matches_float64_attention(interpreted, case):
    r = interpreted[_key(case)]
    assert r["shape"] == [case[0], case[1], case[3], case[5]] and r["dtype"] == str(case[8])
    assert r["finite"], r
    # fp32 in the interpreter is plain fp32 math; bf16/fp16: a small multiple of PyTorch's own
    limit = 1e-5 if case[8] == torch.float32 else 3 * max(r["err_torch"], 2.0**-9)
    assert r["err"] <= limit, r


def test_cpu_op_is_sdpa_and_gradients_flow():
    q = torch.randn(2, 4, 9, 64, requires_grad=True)
    k = torch.randn(2, 2, 13, 64, requires_grad=True)
    v = torch.randn(2, 2, 13, 64, requires_grad=True)
    o = FA.flash_attention(q, k, v, causal=True)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True
    )
    torch.testing.assert_close(o, want, atol=1e-5, rtol=1e-5)
    (o * torch.randn_like(o)).sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


def test_a_row_that_sees_no_key_is_zero_not_nan():
    q, k, v = torch.randn(2, 1, 3, 16), torch.randn(2, 1, 4, 16), torch.randn(2, 1, 4, 16)
    o = FA.flash_attention(q, k, v, lengths=torch.tensor([4, 0], dtype=torch.int32))
    assert torch.equal(o[1], torch.zeros_like(o[1])) and torch.isfinite(o).all()


def test_unsupported_shapes_are_named():
    q = torch.randn(1, 3, 4, 96)
    assert "head dim 96" in FA.unsupported(q, q, q)
    k = torch.randn(1, 2, 4, 64)
    assert "not a multiple" in FA.unsupported(torch.randn(1, 3, 4, 64), k, k)


def test_opcheck_and_export_keep_the_op():
    q, k, v = torch.randn(1, 2, 5, 32), torch.randn(1, 2, 7, 32), torch.randn(1, 2, 7, 32)
    torch.library.opcheck(torch.ops.opswap.flash_attention.default, (q, k, v, False, 0.2, None))

    class Attn(torch.nn.Module):
        def forward(self, q, k, v):
            return FA.flash_attention(q, k, v, causal=True)

    ep = torch.export.export(Attn(), (q, k, v))
    ops = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    assert torch.ops.opswap.flash_attention.default in ops
    torch.testing.assert_close(ep.module()(q, k, v), Attn()(q, k, v))


if __name__ == "__main__":  # the interpreter's half of `interpreted`
    print(json.dumps({_key(c): _case(*c) for c in CASES}))
