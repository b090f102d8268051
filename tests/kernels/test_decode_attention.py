"""opswap::decode_attention: the split-K Triton kernels (under TRITON_INTERPRET=1 in one
child Python; on a GPU the compiled kernels) against float64 attention over a static
cache: valid lengths 1, 17, 100 and lengths that differ within a batch (one equal to
S_max, one 0), GQA (8 q / 2 kv, 16 / 2) and MHA, head dims 64 and 128, fp32, bf16 and
fp16, one split, several and the planned count; the CPU op, opcheck, the fallback of head
dims the kernels lack, the refused gradient; and both kernels compiled for Hopper
(sm_90) at every autotuned config, which catches what only the interpreter accepts."""

from __future__ import annotations

import inspect
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import _rows_check as rc  # noqa: E402

from opswap.kernels import decode_attention as DA  # noqa: E402
from opswap.kernels._rows import KernelError  # noqa: E402

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# (batch, heads, kv heads, S_max, head dim, valid lengths, dtype, splits asked (0: planned))
CASES = [
    (1, 8, 2, 1, 64, [1], F32, 0),  # a cache of one key
    (2, 8, 2, 100, 64, [17, 100], F32, 0),  # GQA 4, one length equal to S_max
    (2, 8, 2, 100, 64, [17, 100], F32, 7),
    (1, 4, 4, 17, 128, [17], F32, 1),  # MHA, the whole cache in one split
    (3, 8, 2, 100, 128, [1, 100, 61], BF16, 0),  # length 1 with many empty splits
    (1, 16, 2, 48, 64, [45], BF16, 3),  # GQA 8
    (2, 4, 4, 100, 64, [100, 37], F16, 3),
    (2, 8, 2, 77, 128, [77, 0], F16, 2),  # a sequence with no key: output 0
    (1, 2, 2, 40, 96, [23], F32, 0),  # head dim 96: the reference runs
]


def _key(c):
    return str([*c[:6], str(c[6]), c[7]])


def _inputs(b, h, hk, s, d, lens, dtype):
    g = torch.Generator().manual_seed(b * 1000 + s * 7 + d + h)
    # q as a decoder makes it: [B, 1, H, D] transposed to [B, H, 1, D] (strided)
    q = torch.randn(b, 1, h, d, generator=g).transpose(1, 2)
    k = torch.randn(b, hk, s, d, generator=g)
    v = torch.randn(b, hk, s, d, generator=g)
    for t in (k, v):  # what lies past a length must not matter: make it loud
        for i, n in enumerate(lens):
            t[i, :, n:] = 1e4
    lengths = torch.tensor(lens, dtype=torch.int32)
    return [t.to(rc.DEVICE, dtype) for t in (q, k, v)] + [lengths.to(rc.DEVICE)]


def _own(q, k, v, lengths, scale):
    """Attention in the inputs' own dtype (what PyTorch's math errs by in it)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    keep = torch.arange(k.shape[2], device=q.device)[None, :] < lengths[:, None]
    s = (q @ k.transpose(-1, -2)) * scale
    p = torch.softmax(s.masked_fill(~keep[:, None, None, :], float("-inf")), -1)
    return p.nan_to_num(0.0) @ v


def _case(b, h, hk, s, d, lens, dtype, splits):
    q, k, v, lengths = _inputs(b, h, hk, s, d, lens, dtype)
    scale = 1 / math.sqrt(d)
    got = DA.decode_attention(q, k, v, lengths, splits=splits)
    truth = DA.reference(q.double(), k.double(), v.double(), lengths, scale)
    own = _own(q, k, v, lengths, scale)
    live = [i for i, n in enumerate(lens) if n > 0]
    return {
        "shape": list(got.shape),
        "dtype": str(got.dtype),
        "splits": DA.plan_splits(b, hk, s, q.device, splits)[0],
        "err": rc.rel(got[live], truth[live]),
        "err_torch": rc.rel(own[live], truth[live]),
        "empty_is_zero": all(bool((got[i] == 0).all()) for i, n in enumerate(lens) if n == 0),
        "finite": bool(torch.isfinite(got).all()),
        "unsupported": DA.unsupported(q, k, v, lengths),
        "compiled": q.device.type == "cuda" and not DA.interpreting(),
    }


@pytest.fixture(scope="module")
def interpreted():
    return rc.run_child(__file__)


@pytest.mark.parametrize("case", CASES, ids=_key)
def test_kernel_matches_float64_attention(interpreted, case):
    r = interpreted[_key(case)]
    assert "error" not in r, r["error"]
    b, h, _, s, d, lens, dtype, splits = case
    assert r["shape"] == [b, h, 1, d] and r["dtype"] == str(dtype), r
    assert r["finite"] and r["empty_is_zero"], r
    limit = rc.bound(dtype, r["err_torch"])
    assert r["err"] <= limit, r
    if d in DA.HEAD_DIMS:
        assert r["unsupported"] is None
        if splits:  # the split count asked for, where the cache has keys enough for it
            quantum = DA.SPLIT_QUANTUM if r["compiled"] else DA.INTERP_BLOCK_N
            assert r["splits"] == min(splits, math.ceil(s / quantum)), r
    else:
        assert f"head dim {d}" in r["unsupported"]


def test_the_cases_cover_one_split_and_several():
    counts = {DA.plan_splits(c[0], c[2], c[3], torch.device("cpu"), c[7])[0] for c in CASES}
    assert 1 in counts and len(counts) >= 4, counts


def test_split_plan_on_a_gpu_fills_the_sms_without_tiny_splits(monkeypatch):
    class Props:
        multi_processor_count = 132

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    gpu = torch.device("cuda")
    n, length = DA.plan_splits(1, 8, 4096, gpu)  # 8 programs for 132 SMs: cut the keys
    assert n * length >= 4096 and length % DA.SPLIT_QUANTUM == 0 and n * 8 >= 132
    assert DA.plan_splits(1, 4, 160, gpu) == (3, 64)  # never shorter than one quantum
    assert DA.plan_splits(64, 8, 4096, gpu)[0] == 1  # 512 programs already fill the GPU
    assert DA.plan_splits(1, 1, 10**6, gpu)[0] <= DA.MAX_SPLITS


def test_cpu_op_is_masked_sdpa():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 8, 1, 64, generator=g)
    k, v = torch.randn(2, 2, 30, 64, generator=g), torch.randn(2, 2, 30, 64, generator=g)
    lengths = torch.tensor([30, 11], dtype=torch.int32)
    got = DA.decode_attention(q, k, v, lengths, scale=0.2)
    keep = (torch.arange(30)[None, :] < lengths[:, None])[:, None, None, :]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=0.2, enable_gqa=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_opcheck():
    q = torch.randn(2, 4, 1, 64)
    k, v = torch.randn(2, 2, 9, 64), torch.randn(2, 2, 9, 64)
    lengths = torch.tensor([9, 0], dtype=torch.int32)  # a full cache and an empty one
    torch.library.opcheck(torch.ops.opswap.decode_attention.default, (q, k, v, lengths, 0.125, 0))


def test_unsupported_inputs_are_named_or_refused():
    k = torch.randn(1, 2, 8, 96)
    q = torch.randn(1, 2, 1, 96)
    lengths = torch.tensor([5], dtype=torch.int32)
    assert "head dim 96" in DA.unsupported(q, k, k, lengths)
    scale = 96**-0.5
    torch.testing.assert_close(
        DA.decode_attention(q, k, k, lengths), DA.reference(q, k, k, lengths, scale)
    )
    k64 = torch.randn(1, 2, 8, 64)
    with pytest.raises(KernelError, match="not a multiple"):
        DA.decode_attention(torch.randn(1, 3, 1, 64), k64, k64, lengths)
    with pytest.raises(KernelError, match=r"\[batch, heads, 1, head_dim\]"):
        DA.decode_attention(torch.randn(1, 2, 4, 64), k64, k64, lengths)
    with pytest.raises(KernelError, match="lengths"):
        DA.decode_attention(torch.randn(1, 2, 1, 64), k64, k64, torch.tensor([5.0]))


def test_a_gradient_is_refused_in_one_sentence():
    q = torch.randn(1, 2, 1, 64, requires_grad=True)
    k = torch.randn(1, 2, 8, 64)
    out = DA.decode_attention(q, k, k, torch.tensor([8], dtype=torch.int32))
    with pytest.raises(KernelError, match="inference op with no backward"):
        out.sum().backward()


def _signature(fn, ptr: str, constexprs: dict) -> dict:
    """Triton types of `fn`'s arguments: the q/k/v/out pointers `ptr`, lengths int32,
    partials fp32, the scale fp32, strides and sizes int32."""
    kinds = {"q_ptr": ptr, "k_ptr": ptr, "v_ptr": ptr, "out_ptr": ptr, "len_ptr": "*i32"}
    sig = {}
    for name in inspect.signature(fn).parameters:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = kinds.get(name, "*fp32")
        else:
            sig[name] = "fp32" if name == "qk_scale" else "i32"
    return sig


@pytest.mark.slow  # seven compilations to cubin, about 2 s each
def test_kernels_compile_for_hopper_at_every_config():
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", 90, 32)

    def build(fn, ptr, constexprs, warps, stages=3):
        src = triton.compiler.ASTSource(triton.jit(fn), _signature(fn, ptr, constexprs), constexprs)
        return triton.compile(
            src, target=target, options={"num_warps": warps, "num_stages": stages}
        )

    for block_n, warps, stages in DA.CONFIGS:  # bf16 at head dim 128, a GQA group of 8
        consts = {"D": 128, "BLOCK_G": 16, "BLOCK_N": block_n, "PREC": "tf32", "DOT_F32": False}
        assert build(DA._decode_split_fn, "*bf16", consts, warps, stages).asm["cubin"]
    consts = {"D": 64, "BLOCK_G": 32, "BLOCK_N": 64, "PREC": "ieee", "DOT_F32": False}
    assert build(DA._decode_split_fn, "*fp32", consts, 4, 2).asm["cubin"]
    reduce_consts = {"D": 128, "BLOCK_S": 128, "RN": False}
    assert build(DA._decode_reduce_fn, "*bf16", reduce_consts, 4).asm["cubin"]


def _case_or_error(c) -> dict:
    try:
        return _case(*c)
    except Exception as e:  # one case that fails to build must not hide the others
        return {"error": f"{type(e).__name__}: {e}"[:2000]}


if __name__ == "__main__":  # the interpreter's half of `interpreted`
    print(json.dumps({_key(c): _case_or_error(c) for c in CASES}))
