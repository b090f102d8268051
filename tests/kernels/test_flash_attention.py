"""opswap::flash_attention: the Triton forward and backward (under TRITON_INTERPRET=1 in one
child Python; on a GPU the compiled kernels) against float64 attention: odd lengths (1, 17,
100), S_q != S_k, causal (upper-left, as SDPA) and not, padding by key lengths and by a
boolean key mask, an additive mask, grouped-query heads (8 q / 2 kv), head dims 64 and
128, fp32, fp16 and bf16, the tensor-descriptor path; the CPU op, opcheck, torch.compile
and torch.export."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import _rows_check as rc  # noqa: E402

from opswap.kernels import flash_attention as FA  # noqa: E402

# (batch, heads, kv heads, S_q, S_k, head dim, causal, key lengths, mask, dtype, tma)
# mask: None, "keys" (bool [B, S_k] padding), "bool" ([1, 1, S_q, S_k]), "add" ([1, H, S_q, S_k])
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
CASES = [
    (1, 2, 2, 17, 17, 64, False, None, None, F32, False),
    (2, 4, 2, 33, 50, 64, True, None, None, F32, False),  # GQA, causal with S_q < S_k
    (1, 2, 2, 40, 9, 64, True, None, None, F32, False),  # causal with S_q > S_k
    (2, 2, 1, 20, 37, 128, False, [37, 5], None, F32, False),  # key lengths, one kv head
    (1, 8, 2, 1, 100, 128, False, None, None, F32, False),  # one query token (decode), GQA 4
    (2, 2, 2, 19, 23, 64, False, None, "keys", F32, False),  # BERT's padding mask
    (1, 2, 2, 21, 21, 64, True, None, "add", F16, False),
    (1, 2, 1, 100, 100, 64, True, [61], None, BF16, False),  # causal and padded, S 100
    (1, 2, 1, 31, 45, 128, False, None, "bool", F16, False),
    (2, 2, 2, 23, 23, 64, True, [23, 0], None, F32, True),  # TMA loads; a batch with no key
]


def _key(c):
    return str([*c[:7], c[7], c[8], str(c[9]), c[10]])


def _inputs(b, h, hk, sq, sk, d, causal, lens, mask, dtype, tma):
    g = torch.Generator().manual_seed(sq * 31 + sk + d)
    q = torch.randn(b, h, sq, d, generator=g)
    k = torch.randn(b, hk, sk, d, generator=g)
    v = torch.randn(b, hk, sk, d, generator=g)
    do = torch.randn(b, h, sq, d, generator=g)
    kw: dict = {"causal": causal}
    if lens:
        kw["lengths"] = torch.tensor(lens, dtype=torch.int32, device=rc.DEVICE)
    if mask == "keys":
        kp = torch.rand(b, sk, generator=g) > 0.3
        kp[:, 0] = True
        kw["key_padding"] = kp.to(rc.DEVICE)
    elif mask == "bool":
        kw["mask"] = (torch.rand(1, 1, sq, sk, generator=g) > 0.4).to(rc.DEVICE)
    elif mask == "add":
        kw["mask"] = torch.randn(1, h, sq, sk, generator=g).to(rc.DEVICE, dtype)
    return [t.to(rc.DEVICE, dtype) for t in (q, k, v, do)], kw


def _grads(q, k, v, do, kw, fn):
    qs, ks, vs = (t.detach().requires_grad_(True) for t in (q, k, v))
    o = fn(qs, ks, vs, **kw)
    return [o, *torch.autograd.grad(o, (qs, ks, vs), do.to(o.dtype))]


def _reference(q, k, v, causal, lengths=None, mask=None, key_padding=None):
    if key_padding is not None:
        mask = key_padding[:, None, None, :]
    if mask is not None and mask.is_floating_point():
        mask = mask.to(q.dtype)
    return FA.reference(q, k, v, causal, None, lengths, mask)


def _case(*c):
    (q, k, v, do), kw = _inputs(*c)
    FA.set_tma(c[-1])
    try:
        got = _grads(q, k, v, do, kw, FA.flash_attention)
    finally:
        FA.set_tma(False)
    truth = _grads(*(t.double() for t in (q, k, v, do)), kw, _reference)
    own = _grads(q, k, v, do, kw, _reference)  # PyTorch's math in the dtype
    names = ("o", "dq", "dk", "dv")
    return {
        "shapes": [list(t.shape) for t in got],
        "dtypes": [str(t.dtype) for t in got],
        "err": {n: rc.rel(a, t) for n, a, t in zip(names, got, truth, strict=True)},
        "err_torch": {n: rc.rel(a, t) for n, a, t in zip(names, own, truth, strict=True)},
        "finite": all(bool(torch.isfinite(t).all()) for t in got),
        "padded_keys_grad": float(got[2][1, :, 0:].abs().max()) if c[7] == [23, 0] else 0.0,
    }


@pytest.fixture(scope="module")
def interpreted():
    return rc.run_child(__file__)


@pytest.mark.parametrize("case", CASES, ids=_key)
def test_forward_and_backward_match_float64_attention(interpreted, case):
    r = interpreted[_key(case)]
    assert "error" not in r, r["error"]
    b, h, hk, sq, sk, d = case[:6]
    assert r["shapes"] == [[b, h, sq, d], [b, h, sq, d], [b, hk, sk, d], [b, hk, sk, d]]
    assert r["dtypes"] == [str(case[9])] * 4 and r["finite"], r
    for name, err in r["err"].items():
        # fp32: plain fp32 math; fp16/bf16: a small multiple of PyTorch's own error
        limit = 1e-5 if case[9] == F32 else 3 * max(r["err_torch"][name], 2.0**-9)
        assert err <= limit, (name, r)
    assert r["padded_keys_grad"] == 0.0  # a batch element with no key: no gradient at all


def test_cpu_op_is_sdpa_and_gradients_match_sdpa():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 9, 64, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 13, 64, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 13, 64, generator=g, requires_grad=True)
    kp = torch.tensor([[True] * 13, [True] * 7 + [False] * 6])
    o = FA.flash_attention(q, k, v, causal=False, key_padding=kp, scale=0.3)
    qs, ks, vs = (t.detach().requires_grad_(True) for t in (q, k, v))
    want = F.scaled_dot_product_attention(
        qs, ks, vs, attn_mask=kp[:, None, None, :], scale=0.3, enable_gqa=True
    )
    torch.testing.assert_close(o, want, atol=1e-5, rtol=1e-5)
    do = torch.randn_like(o)
    got = torch.autograd.grad(o, (q, k, v), do)
    ref = torch.autograd.grad(want, (qs, ks, vs), do)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_causal_is_upper_left_like_sdpa_when_lengths_differ():
    q, k, v = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 7, 16), torch.randn(1, 2, 7, 16)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(FA.flash_attention(q, k, v, causal=True), want)


def test_a_row_that_sees_no_key_is_zero_as_in_sdpa():
    q, k, v = torch.randn(2, 1, 3, 16), torch.randn(2, 1, 4, 16), torch.randn(2, 1, 4, 16)
    o = FA.flash_attention(q, k, v, lengths=torch.tensor([4, 0], dtype=torch.int32))
    want = F.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.tensor([[True] * 4, [False] * 4])[:, None, None, :]
    )
    assert torch.equal(o[1], torch.zeros_like(o[1])) and torch.isfinite(o).all()
    torch.testing.assert_close(o, want)


def test_unsupported_shapes_and_masks_are_named():
    q = torch.randn(1, 3, 4, 96)
    assert "head dim 96" in FA.unsupported(q, q, q)
    k = torch.randn(1, 2, 4, 64)
    assert "not a multiple" in FA.unsupported(torch.randn(1, 3, 4, 64), k, k)
    q = torch.randn(1, 2, 4, 64)
    assert "does not broadcast" in FA.unsupported(q, k, k, torch.ones(3, 4, dtype=torch.bool))
    assert "dtype torch.int64" in FA.unsupported(q, k, k, torch.ones(4, 4, dtype=torch.long))
    assert FA.unsupported(q, k, k, torch.zeros(1, 1, 4, 4)) is None


def test_opcheck_compile_and_export_keep_the_op():
    q, k, v = torch.randn(1, 2, 5, 32), torch.randn(1, 2, 7, 32), torch.randn(1, 2, 7, 32)
    mask = torch.randn(1, 1, 5, 7)
    for args in ((q, k, v, False, 0.2, None, None), (q, k, v, True, 0.3, None, mask)):
        torch.library.opcheck(torch.ops.opswap.flash_attention.default, args)

    class Attn(torch.nn.Module):
        def forward(self, q, k, v):
            return FA.flash_attention(q, k, v, causal=True)

    ep = torch.export.export(Attn(), (q, k, v))
    ops = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    assert torch.ops.opswap.flash_attention.default in ops
    torch.testing.assert_close(ep.module()(q, k, v), Attn()(q, k, v))
    q2 = torch.randn(2, 2, 9, 32, requires_grad=True)
    k2, v2 = torch.randn(2, 2, 11, 32), torch.randn(2, 2, 11, 32)
    compiled = torch.compile(Attn(), backend="aot_eager", fullgraph=True)
    out = compiled(q2, k2, v2)
    torch.testing.assert_close(out, Attn()(q2, k2, v2))
    (gq,) = torch.autograd.grad(out.sum(), q2)
    (wq,) = torch.autograd.grad(Attn()(q2, k2, v2).sum(), q2)
    torch.testing.assert_close(gq, wq)


def _case_or_error(c) -> dict:
    try:
        return _case(*c)
    except Exception as e:  # one case that fails to build must not hide the others
        return {"error": f"{type(e).__name__}: {e}"[:2000]}


if __name__ == "__main__":  # the interpreter's half of `interpreted`
    print(json.dumps({_key(c): _case_or_error(c) for c in CASES}))
