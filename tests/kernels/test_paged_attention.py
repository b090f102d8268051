"""The paged-attention references against plain attention on the same tokens, laid out in
shuffled blocks, at odd lengths and with grouped-query heads; then the Triton kernels
(under TRITON_INTERPRET=1 in one child Python; on a GPU the compiled kernels) against the
reference (its float32 math on float64 copies of the inputs): decode and chunked prefill
at context lengths 0, 1, 5, 17, 33 and 40, block sizes 4, 5, 8 and 16, heads / KV heads
4/4, 8/2 and 4/1, head dims 16, 24 (a padded tile) and 32, fp32 and bf16, one split and
several, empty chunks, chunks of one and chunks over several query tiles; the ops' fake
kernels (opcheck), the refused gradient, and the kernels compiled for Hopper (sm_90)."""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import _rows_check as rc  # noqa: E402

from opswap.kernels import _paged_triton as pk  # noqa: E402
from opswap.kernels import paged_attention as pa  # noqa: E402
from opswap.kernels._rows import KernelError  # noqa: E402


def _paged(keys: list[torch.Tensor], block: int, kv_heads: int, d: int, seed: int = 0):
    """Scatter each sequence's [length, kv_heads, d] keys into a shuffled block pool."""
    g = torch.Generator().manual_seed(seed)
    need = [(k.shape[0] + block - 1) // block for k in keys]
    pool = torch.randperm(sum(need) + 3, generator=g)
    cache = torch.randn(len(pool), block, kv_heads, d, generator=g)  # garbage elsewhere
    tables = torch.zeros(len(keys), max(need), dtype=torch.int32)
    used = 0
    for s, k in enumerate(keys):
        ids = pool[used : used + need[s]]
        used += need[s]
        tables[s, : need[s]] = ids.int()
        flat = torch.zeros(need[s] * block, kv_heads, d)
        flat[: k.shape[0]] = k
        cache[ids] = flat.view(need[s], block, kv_heads, d)
    return cache, tables


@pytest.mark.parametrize(("heads", "kv_heads", "block"), [(4, 4, 16), (6, 2, 5), (8, 1, 3)])
def test_decode_matches_attention_on_the_gathered_tokens(heads, kv_heads, block):
    torch.manual_seed(0)
    d, lengths = 8, [1, 7, 23]
    ks = [torch.randn(n, kv_heads, d) for n in lengths]
    vs = [torch.randn(n, kv_heads, d) for n in lengths]
    kc, tables = _paged(ks, block, kv_heads, d)
    vc, same = _paged(vs, block, kv_heads, d)  # the same seed: the same blocks
    assert torch.equal(tables, same)
    q = torch.randn(len(lengths), heads, d)
    got = pa.paged_decode_attention(q, kc, vc, tables, torch.tensor(lengths), d**-0.5)
    for s in range(len(lengths)):
        k = ks[s].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        v = vs[s].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        want = F.scaled_dot_product_attention(q[s][:, None], k, v)[:, 0]
        torch.testing.assert_close(got[s], want, atol=1e-5, rtol=1e-5)


def test_prefill_chunks_attend_causally_after_their_prefix():
    torch.manual_seed(1)
    heads, kv_heads, d, block = 4, 2, 8, 4
    lengths, chunks = [9, 5], [3, 5]  # sequence 0: 6 cached + a chunk of 3; 1: all new
    ks = [torch.randn(n, kv_heads, d) for n in lengths]
    kc, tables = _paged(ks, block, kv_heads, d)
    vc = kc.clone()  # values = keys: enough to check the positions read
    q = torch.randn(sum(chunks), heads, d)
    cu = torch.tensor([0, chunks[0], sum(chunks)])
    got = pa.paged_prefill_attention(q, kc, vc, tables, cu, torch.tensor(lengths), 0.3)
    for s, (n, c) in enumerate(zip(lengths, chunks, strict=True)):
        k = ks[s].transpose(0, 1).repeat_interleave(2, 0)
        qs = q[cu[s] : cu[s + 1]].transpose(0, 1)
        mask = torch.ones(c, n, dtype=torch.bool).tril(n - c)
        want = F.scaled_dot_product_attention(qs, k, k, attn_mask=mask, scale=0.3)
        torch.testing.assert_close(
            got[cu[s] : cu[s + 1]], want.transpose(0, 1), atol=1e-5, rtol=1e-5
        )


def test_mismatched_heads_are_refused_in_one_sentence():
    with pytest.raises(ValueError, match="multiple of KV heads"):
        pa.paged_decode_attention(
            torch.randn(1, 5, 8), torch.randn(2, 4, 2, 8), torch.randn(2, 4, 2, 8),
            torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1]), 1.0,
        )  # fmt: skip


# ------------------------------------------------------------------- the Triton kernels

F32, BF16 = torch.float32, torch.bfloat16
LOUD = 1e4  # what lies in blocks and slots no sequence owns: read by mistake, it shows
# decode: (heads, kv heads, block size, head dim, context lengths, dtype, splits (0: planned))
DECODE = [
    (4, 4, 16, 16, [1, 5, 17, 33], F32, 0),
    (8, 2, 4, 32, [33, 1, 17], BF16, 0),
    (4, 1, 8, 16, [5, 33, 0], F32, 0),  # a sequence with nothing cached: output 0
    (4, 2, 5, 24, [17, 9], F32, 0),  # block size 5, head dim 24 (padded to 32)
    (8, 2, 8, 32, [33, 40], BF16, 1),  # the whole context in one split
    (4, 1, 4, 16, [40], F32, 3),
    (4, 1, 4, 16, [0, 7], F32, 1),  # one split: the kernel writes the output, 0 included
]
# prefill: (heads, kv heads, block size, head dim, context lengths, chunk lengths, dtype)
PREFILL = [
    (4, 4, 16, 16, [5, 17, 33], [5, 1, 20], F32),  # a whole prompt, a chunk of one, a tail
    (8, 2, 4, 32, [33, 17, 9], [33, 0, 4], BF16),  # an empty chunk between two
    (4, 1, 8, 24, [40], [37], F32),  # three query tiles, head dim 24
]


def _key(c) -> str:
    return str([str(x) for x in c])


def _pool(lengths, block, kv_heads, d, dtype, seed):
    """K and V caches holding each sequence's tokens in shuffled blocks (LOUD elsewhere, the
    unused table entries naming a LOUD block), the tables and the lengths."""
    g = torch.Generator().manual_seed(seed)
    need = [(n + block - 1) // block for n in lengths]
    n_blocks = sum(need) + 2
    order = torch.randperm(n_blocks, generator=g)
    loud = int(order[-1])
    caches = [torch.full((n_blocks, block, kv_heads, d), LOUD) for _ in range(2)]
    tables = torch.full((len(lengths), max(need) + 1), loud, dtype=torch.int32)
    used = 0
    for s, n in enumerate(lengths):
        ids = order[used : used + need[s]]
        used += need[s]
        tables[s, : need[s]] = ids.int()
        for c in caches:
            flat = c[ids].reshape(-1, kv_heads, d)
            flat[:n] = torch.randn(n, kv_heads, d, generator=g)
            c[ids] = flat.view(-1, block, kv_heads, d)
    k, v = (c.to(rc.DEVICE, dtype) for c in caches)
    lens = torch.tensor(lengths, dtype=torch.int32, device=rc.DEVICE)
    return k, v, tables.to(rc.DEVICE), lens


def _q(rows, heads, d, dtype, seed):
    """Queries [rows, heads, d] as a fused QKV projection leaves them: a strided view."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, heads + 3, d, generator=g)[:, 1 : heads + 1].to(rc.DEVICE, dtype)


def _errors(got, q, k, v, run_reference) -> dict:
    """The kernel's and the dtype's own reference errors against the reference run on float64
    copies of the inputs."""
    truth = run_reference(q.double(), k.double(), v.double())
    own = run_reference(q, k, v)
    return {
        "err": rc.rel(got, truth) if truth.norm() > 0 else float(got.abs().max()),
        "err_torch": rc.rel(own, truth) if truth.norm() > 0 else 0.0,
        "dtype": str(got.dtype),
        "shape": list(got.shape),
        "finite": bool(torch.isfinite(got).all()),
    }


def _decode_case(heads, kv_heads, block, d, lengths, dtype, splits) -> dict:
    k, v, tables, lens = _pool(lengths, block, kv_heads, d, dtype, seed=len(lengths) + d)
    q = _q(len(lengths), heads, d, dtype, seed=block)
    scale = d**-0.5
    if splits:
        got = pa.triton_paged_decode(q, k, v, tables, lens, scale, splits)
    else:
        got = pa.paged_decode_attention(q, k, v, tables, lens, scale)
    r = _errors(got, q, k, v, lambda a, b, c: pa.reference_decode(a, b, c, tables, lens, scale))
    s_max = tables.shape[1] * block
    r["splits"] = pa.plan_splits(len(lengths), kv_heads, s_max, q.device, splits)[0]
    # the most splits this cache can hold: a compiled kernel splits in steps of 64 keys,
    # the interpreter in steps of 16 (a 40-key cache takes 3 splits there, 1 on a GPU)
    from opswap.kernels import decode_attention as da

    quantum = da.SPLIT_QUANTUM if got.is_cuda and not da.interpreting() else da.INTERP_BLOCK_N
    r["most_splits"] = -(-s_max // quantum)
    r["empty_is_zero"] = all(bool((got[i] == 0).all()) for i, n in enumerate(lengths) if n == 0)
    return r


def _prefill_case(heads, kv_heads, block, d, lengths, chunks, dtype) -> dict:
    k, v, tables, lens = _pool(lengths, block, kv_heads, d, dtype, seed=sum(chunks))
    q = _q(sum(chunks), heads, d, dtype, seed=d)
    cu = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], device=rc.DEVICE)
    got = pa.paged_prefill_attention(q, k, v, tables, cu, lens, 0.3)
    r = _errors(got, q, k, v, lambda a, b, c: pa.reference_prefill(a, b, c, tables, cu, lens, 0.3))
    # the chunk of one is the decode step of its sequence: both kernels agree on it
    one = [s for s, c in enumerate(chunks) if c == 1]
    if one:
        s = one[0]
        dec = pa.paged_decode_attention(q[cu[s] : cu[s] + 1], k, v, tables[s : s + 1],
                                        lens[s : s + 1], 0.3)  # fmt: skip
        r["decode_agrees"] = rc.rel(dec, got[cu[s] : cu[s] + 1])
    return r


def _or_error(fn, c) -> dict:
    try:
        return fn(*c)
    except Exception as e:  # one case that fails must not hide the others
        return {"error": f"{type(e).__name__}: {e}"[:2000]}


@pytest.fixture(scope="module")
def interpreted():
    return rc.run_child(__file__)


def _assert_close_enough(r: dict, dtype: torch.dtype) -> None:
    assert "error" not in r, r["error"]
    assert r["finite"] and r["dtype"] == str(dtype), r
    assert r["err"] <= rc.bound(dtype, r["err_torch"]), r


@pytest.mark.parametrize("case", DECODE, ids=_key)
def test_decode_kernel_matches_the_reference(interpreted, case):
    r = interpreted["decode " + _key(case)]
    heads, _, _, d, lengths, dtype, splits = case
    _assert_close_enough(r, dtype)
    assert r["shape"] == [len(lengths), heads, d] and r["empty_is_zero"], r
    if splits:  # the splits asked for, as many as the cache holds
        assert r["splits"] == min(splits, r["most_splits"]), r


@pytest.mark.parametrize("case", PREFILL, ids=_key)
def test_prefill_kernel_matches_the_reference(interpreted, case):
    r = interpreted["prefill " + _key(case)]
    heads, _, _, d, _, chunks, dtype = case
    _assert_close_enough(r, dtype)
    assert r["shape"] == [sum(chunks), heads, d], r
    if 1 in chunks:
        assert r["decode_agrees"] <= rc.bound(dtype, 0.0), r


def test_the_cases_cover_one_split_several_and_several_query_tiles():
    cpu = torch.device("cpu")
    counts = {pa.plan_splits(len(c[4]), c[1], 41 * c[2], cpu, c[6])[0] for c in DECODE}
    assert 1 in counts and max(counts) >= 3, counts
    assert max(max(c[5]) for c in PREFILL) > 2 * pa.INTERP_BLOCK_M


def _tiny(chunks=(3, 1)):
    """A small paged cache and queries for the ops on this CPU (no interpreter)."""
    lengths = [7, 4][: len(chunks)]
    k, v, tables, lens = (t.cpu() for t in _pool(lengths, 4, 2, 16, F32, seed=3))
    q = torch.randn(sum(chunks), 4, 16)
    cu = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, tables, lens, cu


def test_opcheck_of_both_ops():
    """Schema, autograd registration and the fake kernels (output like q). Not AOT
    dispatch: off the GPU and the interpreter the op runs the reference, which reads the
    lengths on the host (the public functions call that reference directly there)."""
    q, k, v, tables, lens, cu = _tiny()
    ops = torch.ops.opswap
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    for op, args in (
        (ops.paged_prefill_attention.default, (q, k, v, tables, cu, lens, 0.3)),
        (ops.paged_decode_attention.default, (q[:2], k, v, tables, lens, 0.3)),
    ):
        torch.library.opcheck(op, args, test_utils=utils)


def test_the_ops_on_the_cpu_are_the_references():
    q, k, v, tables, lens, cu = _tiny()
    got = torch.ops.opswap.paged_prefill_attention(q, k, v, tables, cu, lens, 0.3)
    torch.testing.assert_close(got, pa.reference_prefill(q, k, v, tables, cu, lens, 0.3))
    got = torch.ops.opswap.paged_decode_attention(q[:2], k, v, tables, lens, 0.3)
    torch.testing.assert_close(got, pa.reference_decode(q[:2], k, v, tables, lens, 0.3))


def test_a_gradient_through_the_op_is_refused_in_one_sentence():
    q, k, v, tables, lens, _ = _tiny()
    q = q[:2].clone().requires_grad_()
    out = torch.ops.opswap.paged_decode_attention(q, k, v, tables, lens, 0.3)
    with pytest.raises(KernelError, match="inference op with no backward"):
        out.sum().backward()


def test_what_the_kernels_do_not_take_is_named():
    q, k, v, tables, lens, _ = _tiny()
    assert "dtypes" in pa.unsupported(q.double(), k.double(), v.double(), tables, lens)
    assert "head dim 320" in pa.unsupported(
        torch.randn(1, 2, 320), torch.randn(2, 4, 2, 320), torch.randn(2, 4, 2, 320), tables, lens
    )
    assert "block tables" in pa.unsupported(q, k, v, tables.float(), lens)
    assert "device" in pa.unsupported(q, k, v, tables.to("meta"), lens)
    assert pa.unsupported(q, k, v, tables, lens) is None


def _signature(fn, ptr: str, constexprs: dict) -> dict:
    """Triton types of `fn`'s arguments: q/k/v/out pointers `ptr`, integer tensors int32,
    partials fp32, the scale fp32, strides and sizes int32."""
    ints = ("table_ptr", "len_ptr", "cu_ptr", "tiles_ptr")
    sig = {}
    for name in inspect.signature(fn).parameters:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            fp32 = name in ("lse_ptr", "o_part_ptr") or (
                fn is pk._paged_decode_fn and name == "o_ptr"
            )
            sig[name] = "*i32" if name in ints else "*fp32" if fp32 else ptr
        else:
            sig[name] = "fp32" if name == "qk_scale" else "i32"
    return sig


@pytest.mark.slow  # ten compilations to cubin, a second or two each
def test_kernels_compile_for_hopper_at_every_config():
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", 90, 32)

    def build(fn, ptr, constexprs, warps, stages=2):
        src = triton.compiler.ASTSource(triton.jit(fn), _signature(fn, ptr, constexprs), constexprs)
        return triton.compile(
            src, target=target, options={"num_warps": warps, "num_stages": stages}
        )

    base = {"PREC": "tf32", "DOT_F32": False, "BLOCK_SIZE": 16}
    for block_n, warps, stages in pa.DECODE_CONFIGS:  # bf16, head dim 64, a GQA group of 8
        consts = {
            **base,
            "BLOCK_D": 64,
            "BLOCK_G": 16,
            "BLOCK_N": block_n,
            "DIRECT": False,
            "RN": False,
        }
        assert build(pk._paged_decode_fn, "*bf16", consts, warps, stages).asm["cubin"]
    for block_n, warps, stages in pa.PREFILL_CONFIGS:  # bf16, head dim 128
        consts = {
            **base,
            "BLOCK_D": 128,
            "BLOCK_M": 64,
            "BLOCK_N": block_n,
            "STEPS": 9,
            "RN": False,
        }
        assert build(pk._paged_prefill_fn, "*bf16", consts, warps, stages).asm["cubin"]
    consts = {
        "PREC": "ieee",
        "DOT_F32": False,
        "BLOCK_SIZE": 5,
        "BLOCK_D": 128,
        "BLOCK_G": 16,
        "BLOCK_N": 32,
        "DIRECT": True,
        "RN": False,
    }
    assert build(pk._paged_decode_fn, "*fp32", consts, 4).asm["cubin"]  # fp32, head dim 80..128
    combine = {"BLOCK_D": 128, "BLOCK_S": 128, "RN": False}
    assert build(pk._paged_combine_fn, "*bf16", combine, 4).asm["cubin"]


if __name__ == "__main__":  # the interpreter's half of `interpreted`
    out = {"decode " + _key(c): _or_error(_decode_case, c) for c in DECODE}
    out.update({"prefill " + _key(c): _or_error(_prefill_case, c) for c in PREFILL})
    print(json.dumps(out))
