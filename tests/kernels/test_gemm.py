"""opswap::gemm: the Triton kernel (under TRITON_INTERPRET=1 in one child Python, or on the
GPU where there is one) against float64 on odd shapes (M 1, 7, 33; N 5, 48; K 3, 64; a
3-D input; a transposed input view), every activation, with and without bias and residual,
the weight [N, K] or [K, N], in float32 (ieee and tf32) and bfloat16; the persistent
variant (TMA descriptors and pointer loads, fewer programs than tiles and more) and
split-K (1 to 4 splits, and the split from the shape) at M, N, K of 1, 17, 100, 129; on a
GPU also the default launches at a prefill and a decode shape; the launch choice and its
table; the CPU op, its gradients, bad input, the fake implementation under torch.export."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _rows_check as rc  # noqa: E402

from opswap.kernels import gemm as G  # noqa: E402

# (lead dims of a, N, K, dtype, precision, activation, bias, residual, b_transposed)
CASES = [
    ((1,), 5, 3, torch.float32, "ieee", "none", False, False, True),
    ((7,), 48, 64, torch.float32, "ieee", "relu", True, False, True),
    ((33,), 5, 64, torch.float32, "ieee", "gelu", True, True, False),
    ((33,), 48, 3, torch.float32, "ieee", "silu", False, True, True),
    ((3, 7), 48, 64, torch.float32, "ieee", "gelu_tanh", True, True, True),
    ((7,), 48, 64, torch.float32, "tf32", "none", True, False, True),
    ((1,), 48, 64, torch.bfloat16, "ieee", "none", True, False, True),
    ((7,), 5, 3, torch.bfloat16, "ieee", "relu", False, True, False),
    ((33,), 48, 64, torch.bfloat16, "ieee", "gelu", True, True, True),
    ((33,), 48, 64, torch.bfloat16, "ieee", "gelu_tanh", True, False, False),
    ((3, 7), 5, 64, torch.bfloat16, "ieee", "silu", True, True, True),
    ((2, 3, 7), 48, 64, torch.float16, "ieee", "relu", True, True, True),
]


# (name, launch, M, N, K, dtype, activation, bias, residual, b_transposed, TMA, splits)
_P, _S = "persistent", "splitk"
VARIANT_CASES = [
    ("tma_few_programs", G.Launch(_P, 16, 16, 16, programs=3), 17, 40, 64, torch.bfloat16,
     "gelu", True, True, True, True, 1),
    ("tma_kn_weight", G.Launch(_P, 16, 16, 16, programs=2), 33, 48, 64, torch.float32,
     "relu", True, False, False, True, 1),
    ("pointers_unaligned_k", G.Launch(_P, 16, 32, 16, programs=5), 100, 129, 129,
     torch.bfloat16, "silu", False, True, True, False, 1),
    ("more_programs_than_tiles", G.Launch(_P, 16, 16, 16, programs=50), 1, 17, 100,
     torch.bfloat16, "gelu_tanh", True, False, True, False, 1),
    ("tma_off", G.Launch(_P, 16, 16, 32, programs=3, tma=False), 17, 40, 64, torch.float32,
     "none", False, True, True, False, 1),
    ("split1", G.Launch(_S, 16, 16, 16, split_k=1), 1, 17, 100, torch.bfloat16, "gelu_tanh",
     True, False, True, False, 1),
    ("split2", G.Launch(_S, 16, 16, 16, split_k=2), 17, 40, 129, torch.float32, "none",
     False, True, False, False, 2),
    ("split3", G.Launch(_S, 16, 16, 16, split_k=3), 1, 5, 129, torch.bfloat16, "relu", True,
     True, True, False, 3),
    ("split4", G.Launch(_S, 16, 32, 16, split_k=4), 33, 48, 100, torch.bfloat16, "silu", True,
     False, True, False, 4),
    ("split_from_shape", G.Launch(_S, 16, 16, 32), 1, 17, 129, torch.float32, "gelu", True,
     True, True, False, 2),
]  # fmt: skip


def _key(c: tuple) -> str:
    return str([list(c[0]), *c[1:3], str(c[3]), *c[4:]])


def _eager(a, b, bias, res, act, bt):
    """What eager PyTorch runs for the same function in the dtype: the yardstick."""
    y = torch.nn.functional.linear(a, b if bt else b.t(), bias)
    y = G.activate(y, act)
    return y + res if res is not None else y


def _case(lead, n, k, dtype, precision, act, has_bias, has_res, bt, seed=0):
    gen = torch.Generator().manual_seed(n * 31 + k + len(lead) + seed)
    dev = rc.DEVICE

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dev, dtype)

    a = rand(*lead, k)
    b = rand(n, k) if bt else rand(k, n)
    bias = rand(n) if has_bias else None
    res = rand(*lead, n) if has_res else None
    y = G.gemm(a, b, bias, res, act, bt, precision)
    d = [t.double() if t is not None else None for t in (a, b, bias, res)]
    truth = _eager(*d, act, bt)
    if dev == "cuda" and precision == "tf32":
        torch.backends.cuda.matmul.allow_tf32 = True
    ye = _eager(a, b, bias, res, act, bt)
    torch.backends.cuda.matmul.allow_tf32 = False
    return {
        "shape": list(y.shape),
        "dtype": str(y.dtype),
        "y": rc.rel(y, truth),
        "y_torch": rc.rel(ye, truth),
    }


def _variant_case(launch, m, n, k, dtype, act, has_bias, has_res, bt):
    """A forced launch's result against float64, what it ran, and whether a second run
    gives the same bits."""
    with G.forced_launch(launch):
        out = _case((m,), n, k, dtype, "ieee", act, has_bias, has_res, bt)
        ran = dict(G.LAST_RUN)
        again = [_case((m,), n, k, dtype, "ieee", act, has_bias, has_res, bt)["y"]]
    return {**out, **ran, "same_bits": again[0] == out["y"]}


def _gpu_defaults():
    """On a GPU: the launches the op picks itself at a prefill-like and a decode shape
    (persistent TMA and split-K on an H100 / H200), against float64, run twice (the same
    error to the last bit), and under torch.compile."""
    got = {}
    for name, (m, n, k) in {"prefill": (256, 512, 1024), "decode": (4, 1024, 4096)}.items():
        runs = [_case((m,), n, k, torch.bfloat16, "ieee", "silu", True, True, True)]
        ran = dict(G.LAST_RUN)
        runs += [_case((m,), n, k, torch.bfloat16, "ieee", "silu", True, True, True)]
        got[name] = {**runs[0], **ran, "same_bits": runs[0]["y"] == runs[1]["y"]}
        # under torch.compile: traced (split-K's two launches and its workspace; a
        # persistent choice traces the tiled kernel) and compiled by Inductor
        gen = torch.Generator().manual_seed(m + n)
        x, w, b = (
            torch.randn(*s, generator=gen).to("cuda", torch.bfloat16)
            for s in ((m, k), (n, k), (n,))
        )
        fn = torch.compile(lambda x, w, b: G.gemm(x, w, b, None, "silu", True, "ieee"))
        truth = torch.nn.functional.silu(x.double() @ w.double().t() + b.double())
        got[name]["compiled"] = rc.rel(fn(x, w, b), truth)
        got[name]["compiled_torch"] = rc.rel(torch.nn.functional.silu(x @ w.t() + b), truth)
    got["hopper"] = G.tma_ready(torch.device("cuda"))
    return got


def _transposed_input():
    """A [M, K] input that is a transposed view (column-major): read through its strides."""
    gen = torch.Generator().manual_seed(5)
    at = torch.randn(64, 33, generator=gen).to(rc.DEVICE)
    b = torch.randn(48, 64, generator=gen).to(rc.DEVICE)
    y = G.gemm(at.t(), b, None, None, "none", True, "ieee")
    return rc.rel(y, at.t().double() @ b.double().t())


def _tf32_is_tf32():
    """On a GPU: the tf32 product differs from the exact one (its inputs lose 13 bits)."""
    gen = torch.Generator().manual_seed(9)
    a = torch.randn(64, 512, generator=gen).to(rc.DEVICE)
    b = torch.randn(64, 512, generator=gen).to(rc.DEVICE)
    exact = G.gemm(a, b, None, None, "none", True, "ieee")
    tf32 = G.gemm(a, b, None, None, "none", True, "tf32")
    return rc.rel(tf32, exact)


@pytest.fixture(scope="module")
def interpreted():
    return rc.run_child(__file__)


@pytest.mark.parametrize("case", CASES, ids=_key)
def test_kernel_matches_float64(interpreted, case):
    r = interpreted[_key(case)]
    lead, n, dtype, precision = case[0], case[1], case[3], case[4]
    assert r["shape"] == [*lead, n] and r["dtype"] == str(dtype)
    if dtype == torch.float32:
        # tf32 on a GPU: its inputs keep 10 mantissa bits (unit roundoff 2^-11)
        bound = 3 * max(r["y_torch"], 2.0**-11) if precision == "tf32" else 1e-5
    else:
        bound = 3 * max(r["y_torch"], 2.0**-9 if dtype == torch.bfloat16 else 2.0**-12)
    assert r["y"] <= bound, r


def _bound(r, dtype):
    if dtype == torch.float32:
        return 1e-5
    return 3 * max(r["y_torch"], 2.0**-9 if dtype == torch.bfloat16 else 2.0**-12)


@pytest.mark.parametrize("case", VARIANT_CASES, ids=[c[0] for c in VARIANT_CASES])
def test_variants_match_float64_and_run_as_asked(interpreted, case):
    name, launch, m, n, _, dtype, *_, tma, splits = case
    r = interpreted["variant:" + name]
    assert r["shape"] == [m, n] and r["dtype"] == str(dtype)
    assert r["y"] <= _bound(r, dtype), r
    # the copy engine is Hopper's (the interpreter reads descriptors anywhere)
    tma = tma and (not torch.cuda.is_available() or torch.cuda.get_device_capability() >= (9, 0))
    assert (r["variant"], r["tma"], r["splits"]) == (launch.variant, tma, splits)
    assert r["same_bits"]  # split-K adds its partial sums in one order: deterministic


def test_gpu_default_launches(interpreted):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: the default launches are chosen on the device")
    for name, want in (("prefill", "persistent"), ("decode", "splitk")):
        r = interpreted["gpu:" + name]
        assert r["y"] <= _bound(r, torch.bfloat16), (name, r)
        assert r["compiled"] <= 3 * max(r["compiled_torch"], 2.0**-9), (name, r)
        assert r["same_bits"], name
        if interpreted["gpu:hopper"]:  # the table may pick otherwise on a measured GPU
            assert r["variant"] in (want, "tiled"), (name, r)


def test_default_launch_follows_the_shape():
    # decode on 132 multiprocessors: 1 x 4096 with 64-column tiles is 64 tiles, split-K
    d = G.default_launch(1, 4096, 4096, 2, True, 132)
    assert (d.variant, d.block_m, d.block_n, d.block_k) == ("splitk", 16, 64, 128)
    assert G.split_count(1, 4096, 4096, d, 132) == (2, 2048)
    assert G.default_launch(48, 4096, 4096, 4, False, 132).block_k == 64  # float32
    # the LM head's 2004 column tiles fill the GPU alone: not split, and few rows stay
    # with the tiled kernel's decode configurations (1.04x cuBLAS there on an H100)
    assert G.default_launch(1, 128256, 4096, 2, True, 132) == G.Launch()
    # prefill on Hopper: 128 x 256 tiles where they make one per multiprocessor
    big = G.default_launch(4096, 4096, 4096, 2, True, 132)
    assert (big.variant, big.block_n, big.stages, big.warps) == ("persistent", 256, 3, 8)
    assert G.default_launch(2048, 2048, 2048, 2, True, 132).block_n == 128
    assert G.default_launch(4096, 4096, 4096, 1, True, 132).block_k == 128  # FP8
    assert G.default_launch(4096, 4096, 4096, 2, False, 132) == G.Launch()  # off Hopper
    assert G.default_launch(4096, 4096, 4096, 4, True, 132) == G.Launch()  # float32
    assert G.default_launch(16, 4096, 512, 2, False, 132) == G.Launch()  # short K


def test_split_count_takes_whole_k_steps_and_leaves_none_empty():
    lau = G.Launch("splitk", 16, 64, 128, split_k=3)
    for k in (128, 129, 1000, 4096):
        splits, per = G.split_count(1, 64, k, lau, 132)
        steps = -(-k // 128)
        assert per % 128 == 0 and splits <= min(3, steps)
        assert (splits - 1) * per < k <= splits * per  # the last split is not empty
    assert G.split_count(1, 64, 96 * 128, G.Launch("splitk", 16, 64, 128), 132)[0] == 16


def test_launch_table_round_trip_and_choice(tmp_path, monkeypatch):
    path = tmp_path / "gemm_launch.json"
    lau = G.Launch("persistent", 128, 256, 64, 8, 3, 8)
    row = dict(device="sm90", dtype="bfloat16", precision="ieee", ms=0.2, cublas_ms=0.21,
               shape=G.shape_class(4096, 4096, 4096), launch=lau.to_json())  # fmt: skip
    assert G.update_launch_table([row], "measured x.json 2026-12-08", path) == 1
    table = G.launch_table(path)
    assert table[("sm90", "bfloat16", "ieee", "m<=4096,n<=4096,k<=4096")] == lau
    # forced launches win over everything, and are refused in one sentence when bad
    a = torch.randn(4, 8)
    with G.forced_launch(G.Launch("splitk", 16, 16, 16)):
        assert G.choose_launch(a, torch.randn(6, 8), True, "ieee", 6).variant == "splitk"
    with pytest.raises(G.KernelError, match="powers of two of at least 16"):
        G.Launch("persistent", 128, 96, 64)
    with pytest.raises(G.KernelError, match="is not one of tiled"):
        G.Launch("stream-k", 128, 128, 64)
    path.write_text('{"entries": [{"device": "sm90"}]}')
    with pytest.raises(G.KernelError, match="restore it from the package"):
        G.launch_table(path)
    # the shipped table reads, and names only variants that exist
    assert all(v.variant in G.VARIANTS for v in G.launch_table().values())


def test_gpu_variants_compile_for_hopper():
    """The persistent kernel's TMA loop and flattened tile loop, and split-K's two
    kernels, built for sm90 by this Triton's compiler on the CPU (the interpreter runs
    neither the pipeliner nor the TMA lowering): wgmma and bulk tensor copies in the PTX."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU the kernel tests above compile and run these kernels")
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from opswap.kernels._rows import jitted

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this Triton has no bundled ptxas to build for sm90")

    def ptx(fn, types, consts):
        jit = jitted(fn)
        sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in jit.arg_names}
        cst = {(i,): consts[a] for i, a in enumerate(jit.arg_names) if a in consts}
        src = ASTSource(jit, sig, cst)
        opts = dict(num_warps=4, num_stages=3)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]

    ptrs = {
        a: "*bf16" for a in ("a_ptr", "b_ptr", "c_ptr", "bias_ptr", "res_ptr", "sa_ptr", "sb_ptr")
    }
    flags = dict(HAS_BIAS=True, HAS_RES=True, SCALED=False, ACT=4, RN=False)
    dot = dict(TF32=False, F32=False, UPCAST=False)
    blocks = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8)
    descs = {"a_ptr": "tensordesc<bf16[64, 32]>", "b_ptr": "tensordesc<bf16[64, 32]>"}
    persistent = ptx(G._persistent_fn, {**ptrs, **descs},
                     {**flags, **dot, **blocks, "TMA": True, "B_KN": False, "FLATTEN": True})  # fmt: skip
    assert "cp.async.bulk.tensor" in persistent and "wgmma.mma_async" in persistent
    assert "mma" in ptx(G._splitk_fn, {**ptrs, "ws_ptr": "*fp32"}, {**dot, **blocks})
    summed = ptx(
        G._splitk_sum_fn, {**ptrs, "ws_ptr": "*fp32"}, {**flags, "BLOCK_M": 16, "BLOCK_N": 64}
    )
    assert "st.global" in summed


def test_kernel_reads_a_transposed_input_view(interpreted):
    assert interpreted["transposed"] <= 1e-5


def test_tf32_is_tf32_on_a_gpu_and_float32_in_the_interpreter(interpreted):
    if torch.cuda.is_available():
        assert interpreted["tf32_vs_ieee"] > 1e-5  # the inputs were rounded
        assert interpreted["tf32_vs_ieee"] < 5e-3
    else:
        assert interpreted["tf32_vs_ieee"] <= 1e-6  # the interpreter multiplies in fp32


def test_cpu_op_matches_float64_and_has_gradients():
    a = torch.randn(2, 5, 12, dtype=torch.float64)
    b, bias, res = torch.randn(7, 12), torch.randn(7), torch.randn(2, 5, 7)
    for act in G.ACTIVATIONS:
        y = G.gemm(a.float(), b, bias, res, act, True, "ieee")
        truth = _eager(a, b.double(), bias.double(), res.double(), act, True)
        assert rc.rel(y, truth) <= 1e-6, act
    args = (a.float().requires_grad_(), b.requires_grad_(), bias.requires_grad_())
    torch.library.opcheck(G.gemm, (*args, res.clone().requires_grad_(), "gelu_tanh", True, "ieee"))
    kn = torch.randn(12, 7, dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, 12, dtype=torch.float64, requires_grad=True)
    for act in ("relu", "gelu", "silu"):
        torch.autograd.gradcheck(
            lambda x, w, act=act: G.gemm(x, w, None, None, act, False, "ieee"), (x, kn)
        )


def test_fp8_reference_reads_scaled_e4m3_values():
    a, b = torch.randn(9, 32), torch.randn(16, 32)
    sa, sb = torch.tensor(0.5), torch.tensor(0.25)
    aq, bq = a.to(G.FP8), b.to(G.FP8)
    y = G.gemm(aq, bq, None, None, "relu", True, "fp8", sa, sb)
    assert y.dtype == torch.bfloat16
    want = torch.relu((aq.double() @ bq.double().t()) * 0.125)
    assert rc.rel(y, want) <= 2.0**-8


def test_gpu_configurations_fit_shared_memory_and_the_row_class():
    for m, size in ((1, 2), (16, 4), (33, 2), (4096, 1), (4096, 4)):
        tried = G.configs_for(m, size)
        assert tried
        for c in tried:
            bm, bn, bk = (c.kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
            assert (bm + bn) * bk * size * c.num_stages <= 200 * 1024
            assert (bm <= 32) == (m <= 32)
    # the FP8 configurations' K step of 128 only where the bytes allow it
    assert any(
        c.kwargs["BLOCK_K"] == 128 and c.kwargs["BLOCK_N"] == 256 for c in G.configs_for(4096, 1)
    )
    assert not any(
        c.kwargs["BLOCK_K"] == 128 and c.kwargs["BLOCK_N"] == 256 for c in G.configs_for(4096, 2)
    )


def test_bad_input_is_refused_in_one_sentence():
    a, b = torch.randn(4, 8), torch.randn(6, 8)
    with pytest.raises(G.KernelError, match="not one of none, relu"):
        G.gemm(a, b, None, None, "tanh", True, "ieee")
    with pytest.raises(G.KernelError, match="precision 'bf16' is not one of"):
        G.gemm(a, b, None, None, "none", True, "bf16")
    with pytest.raises(G.KernelError, match="has K = 6"):
        G.gemm(a, b, None, None, "none", False, "ieee")
    with pytest.raises(G.KernelError, match="the bias is \\[5\\]"):
        G.gemm(a, b, torch.randn(5), None, "none", True, "ieee")
    with pytest.raises(G.KernelError, match="the residual is"):
        G.gemm(a, b, None, torch.randn(4, 5), "none", True, "ieee")
    with pytest.raises(G.KernelError, match="one dtype"):
        G.gemm(a, b.double(), None, None, "none", True, "ieee")
    with pytest.raises(G.KernelError, match="float8_e4m3fn"):
        G.gemm(a, b, None, None, "none", True, "fp8", torch.tensor(1.0), torch.tensor(1.0))


def test_export_keeps_the_op_and_its_fake_follows_the_batch():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 6)

        def forward(self, x, r):
            return G.gemm(x, self.lin.weight, self.lin.bias, r, "silu", True, "ieee")

    x, r = torch.randn(2, 3, 8), torch.randn(2, 3, 6)
    batch = torch.export.Dim("batch")
    m = M()
    ep = torch.export.export(m, (x, r), dynamic_shapes=({0: batch}, {0: batch}))
    assert torch.ops.opswap.gemm.default in {n.target for n in ep.graph.nodes}
    x5, r5 = torch.randn(5, 3, 8), torch.randn(5, 3, 6)
    got = ep.module()(x5, r5)
    want = torch.nn.functional.silu(m.lin(x5)) + r5
    assert got.shape == (5, 3, 6) and torch.allclose(got, want, atol=1e-5)
    fake = G._fake(x5.to("meta"), torch.empty(6, 8, device="meta"), None, None, "none", True, "fp8")
    assert fake.shape == (5, 3, 6) and fake.dtype == torch.bfloat16


if __name__ == "__main__":  # the interpreter's half of `interpreted`
    out = {_key(c): _case(*c) for c in CASES}
    out["transposed"] = _transposed_input()
    out["tf32_vs_ieee"] = _tf32_is_tf32()
    for name, launch, *rest in VARIANT_CASES:
        out["variant:" + name] = _variant_case(launch, *rest[:8])
    if rc.DEVICE == "cuda":
        out.update({"gpu:" + k: v for k, v in _gpu_defaults().items()})
    print(json.dumps(out))
