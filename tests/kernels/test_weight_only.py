"""opswap::wo_linear: quantisation round trips, the Triton kernel (under TRITON_INTERPRET=1
on a CPU, compiled on a GPU) against the float64 reference on odd shapes, the CPU paths,
the op through opcheck and torch.export, and the module's state_dict."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from opswap.kernels import weight_only as wo
from opswap.rules.precision._lowbit_modules import WeightOnlyLinear

SRC = Path(__file__).resolve().parents[2] / "src"
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (runs in the GPU suite)")


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _layer(n, k, bits, group, seed, dtype=torch.bfloat16, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g).to(dtype)
    q, s, o, gs = wo.quantize(w, bits, group)
    return [t.to(device) if t is not None else None for t in (w, b, q, s, o)] + [gs]


def _bound(torch_err: float) -> float:
    """What the kernel may err: a small multiple of PyTorch's own bfloat16 Linear on the
    same weights, floored at bfloat16's unit roundoff (a 40-element output's error is a
    noisy statistic)."""
    return 3 * max(torch_err, 2.0**-9)


def _torch_err(x, q, s, o, b, bits, k, ref):
    """What PyTorch's own bfloat16 Linear errs on the dequantised weight: the yardstick."""
    w = wo.dequantize(q, s, o, bits, k, x.dtype)
    return _rel(F.linear(x, w, b), ref)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantise_round_trip_is_within_half_a_step(bits):
    torch.manual_seed(1)
    w = torch.randn(37, 300) * torch.rand(37, 1) * 3  # rows of different ranges
    for group in (None, 64, 128):
        q, s, o, g = wo.quantize(w, bits, group)
        deq = wo.dequantize(q, s, o, bits, 300, torch.float64)
        step = s.double().repeat_interleave(g, dim=1)[:, :300]
        assert deq.shape == w.shape
        assert ((deq - w.double()).abs() <= step / 2 + 1e-6).all()
        if bits == 4:
            assert q.dtype == torch.uint8 and q.shape == (37, wo.padded_k(300, g) // 2)
            codes = wo.unpack_int4(q)
            assert int(codes.max()) <= 15
        else:
            assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    # the error levels the rules' exactness rests on (random weights, default groups)
    q8, s8, _, _ = wo.quantize(w, 8)
    assert _rel(wo.dequantize(q8, s8, None, 8, 300), w) < 0.01
    q4, s4, o4, _ = wo.quantize(w, 4)
    assert 0.02 < _rel(wo.dequantize(q4, s4, o4, 4, 300), w) < 0.1


def test_bad_settings_are_refused_in_one_sentence():
    w = torch.randn(8, 300)
    with pytest.raises(wo.WeightOnlyError, match="bits must be 4 or 8"):
        wo.quantize(w, 3)
    with pytest.raises(wo.WeightOnlyError, match="power of two"):
        wo.quantize(w, 4, 100)
    with pytest.raises(wo.WeightOnlyError, match="even number"):
        wo.quantize(torch.randn(8, 301), 4, 301)


# M in {1, 3, 16} (the GEMV and the tl.dot paths), K a multiple of 128 and not, N odd;
# split-K 1 (direct store) and 3 (the last program of a tile adds the partials)
CASES = [
    (1, 640, 123, 4, 128, 1),
    (3, 640, 123, 4, 128, 3),
    (16, 300, 45, 4, 64, 2),
    (1, 301, 40, 4, 128, 3),
    (1, 640, 123, 8, None, 3),
    (3, 300, 45, 8, 64, 1),
    (16, 640, 45, 8, None, 2),
    # one row, several groups per chunk (BLOCK_K 256: 4 groups of 64, 2 of 128)
    (1, 768, 45, 4, 64, 2),
    (1, 1280, 37, 4, 128, 1),
    (1, 512, 29, 8, 64, 3),
    # the tl.dot path at the INT4 GEMV's odd shapes
    (3, 1000, 77, 4, 128, 2),
    (16, 123, 5, 4, 128, 1),
]
#: the chunk each case's launch takes (the interpreter takes a fixed configuration)
BLOCK_K = {(1, 768, 45, 4, 64, 2): 256, (1, 1280, 37, 4, 128, 1): 256, (1, 512, 29, 8, 64, 3): 256}


def _interpreted_case(m, k, n, bits, group, split):
    """One CASES entry through the kernel; run where TRITON_INTERPRET=1 was set before
    Triton was imported (its own library functions are jitted at import)."""
    w, b, q, s, o, _ = _layer(n, k, bits, group, seed=m * 7 + k + bits)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)).bfloat16()
    ref = wo.reference(x, q, s, o, b, bits, k)
    block_k = BLOCK_K.get((m, k, n, bits, group, split), 128)
    cfg = {"BLOCK_N": 32 if split > 1 else 16, "SPLIT_K": split, "BLOCK_K": block_k}
    y = wo.triton_wo_linear(x, q, s, o, b, bits, k, config=cfg)
    return {
        "dtype": str(y.dtype),
        "shape": list(y.shape),
        "finite": bool(torch.isfinite(y).all()),
        "err": _rel(y, ref),
        "torch_err": _torch_err(x, q, s, o, b, bits, k, ref),
        "counters": int(wo._COUNTERS[x.device].abs().sum()),
    }


def _interpreted_fp16():
    w, _, q, s, o, _ = _layer(64, 256, 4, 128, seed=3)
    x = torch.randn(2, 5, 256).half()  # [B, S, K]: leading dims kept
    y = wo.triton_wo_linear(x, q, s, o, None, 4, 256, config={"SPLIT_K": 2})
    ref = wo.reference(x, q, s, o, None, 4, 256)
    return {
        "dtype": str(y.dtype),
        "shape": list(y.shape),
        "finite": bool(torch.isfinite(y).all()),
        "err": _rel(y, ref),
        "torch_err": _torch_err(x, q, s, o, None, 4, 256, ref),
        "counters": 0,
    }


# INT4 at one row: `_int4_gemv` (codes read as 32-bit words). (K, N, x dtype, bias, group,
# split, BLOCK_U, scale dtype): K not a multiple of the group (123, 1000) and one that is,
# N odd, chunks that do not divide the row (K = 1000: 32 units, BLOCK_U 3 -> 4: 8 chunks;
# 5632: 176 units in chunks of 64, the last one part empty), per channel (group = K), groups
# of 32, and scale and offset stored in bfloat16
GEMV_CASES = [
    (123, 5, "bf16", True, 128, 1, 4, "fp32"),
    (123, 77, "fp16", False, 128, 1, 4, "fp32"),
    (1000, 77, "bf16", True, 128, 3, 4, "fp32"),
    (1000, 5, "fp16", True, 128, 2, 16, "fp32"),
    (1000, 77, "bf16", False, 32, 1, 8, "fp32"),
    (2048, 77, "bf16", True, 128, 4, 16, "fp32"),
    (5632, 33, "bf16", False, 128, 2, 64, "fp32"),
    (256, 45, "fp16", True, 256, 2, 4, "fp32"),
    (1000, 77, "bf16", True, 128, 3, 8, "bf16"),
    (1000, 77, "fp16", False, 128, 1, 16, "bf16"),
]
# the same kernel loading 1 or 2 chunks ahead (last field): K = 1000 in 8 chunks of 4
# units, 8, 3 and 1 a program with splits 1, 3 and 8 (the last program of split 3 has two,
# so its second chunk ahead is empty); 5632 in 3 chunks of 64, the last part empty; a split
# whose programs hold one chunk each
GEMV_PREFETCH_CASES = [
    (1000, 77, "bf16", True, 128, 1, 4, "fp32", 1),
    (1000, 77, "bf16", True, 128, 1, 4, "fp32", 2),
    (1000, 5, "fp16", False, 128, 3, 4, "bf16", 1),
    (1000, 5, "fp16", False, 128, 3, 4, "bf16", 2),
    (5632, 33, "bf16", True, 128, 1, 64, "fp32", 1),
    (5632, 33, "bf16", True, 128, 1, 64, "bf16", 2),
    (1000, 77, "bf16", False, 32, 8, 4, "fp32", 2),
]
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _interpreted_gemv(k, n, dtype, bias, group, split, block_u, sdtype, x_scale=1.0, prefetch=0):
    """One GEMV_CASES entry (or its x scaled by `x_scale`) through `_int4_gemv`."""
    dt = _DTYPES[dtype]
    w, b, q, s, o, gs = _layer(n, k, 4, group, seed=k + n + split, dtype=dt)
    s, o = s.to(_DTYPES[sdtype]), o.to(_DTYPES[sdtype])
    b = b if bias else None
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(k * n)) * x_scale
    x = x.to(dt)
    ref = wo.reference(x, q, s, o, b, 4, k)
    assert wo.int4_gemv_ok(q, gs)
    cfg = {"BLOCK_N": 16 if n > 8 else 8, "SPLIT_K": split, "BLOCK_U": block_u}
    cfg["PREFETCH"] = prefetch
    y = wo.triton_wo_linear(x, q, s, o, b, 4, k, config=cfg, int4_gemv=True)
    return {
        "dtype": str(y.dtype),
        "shape": list(y.shape),
        "finite": bool(torch.isfinite(y).all()),
        "err": _rel(y, ref),
        "torch_err": _torch_err(x, q, s, o, b, 4, k, ref),
        "counters": int(wo._COUNTERS[x.device].abs().sum()),
        "gemv_kernel": ("int4_gemv_fixed", True) in wo._KERNELS,
    }


@pytest.fixture(scope="module")
def interpreted():
    """Every interpreter case, run once in a child Python with TRITON_INTERPRET=1. On a
    GPU machine the compiled kernel's tests below run instead (the child failed there on
    the H200 machine's Triton 3.6, cause not yet read: see the lowbit report)."""
    if CUDA:
        pytest.skip("a CUDA GPU is here: the compiled kernel is tested instead")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(SRC)}
    run = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("m", "k", "n", "bits", "group", "split"), CASES)
def test_triton_kernel_in_the_interpreter_matches_float64(interpreted, m, k, n, bits, group, split):
    r = interpreted[str([m, k, n, bits, group, split])]
    assert r["dtype"] == "torch.bfloat16" and r["shape"] == [m, n] and r["finite"]
    assert r["err"] <= _bound(r["torch_err"]), r
    assert r["counters"] == 0  # every tile's last program reset its counter


@pytest.mark.parametrize(
    ("k", "n", "dtype", "bias", "group", "split", "block_u", "sdtype"), GEMV_CASES
)
def test_int4_gemv_in_the_interpreter_matches_float64(
    interpreted, k, n, dtype, bias, group, split, block_u, sdtype
):
    r = interpreted[str(["gemv", k, n, dtype, bias, group, split, block_u, sdtype])]
    assert r["gemv_kernel"], "INT4 at one row did not run _int4_gemv"
    assert r["dtype"] == str(_DTYPES[dtype]) and r["shape"] == [1, n] and r["finite"]
    assert r["err"] <= _bound(r["torch_err"]), r
    assert r["counters"] == 0


@pytest.mark.parametrize(
    ("k", "n", "dtype", "bias", "group", "split", "block_u", "sdtype", "depth"),
    GEMV_PREFETCH_CASES,
)
def test_int4_gemv_loading_chunks_ahead_matches_float64(
    interpreted, k, n, dtype, bias, group, split, block_u, sdtype, depth
):
    key = ["gemv prefetch", k, n, dtype, bias, group, split, block_u, sdtype, depth]
    r = interpreted[str(key)]
    assert r["gemv_kernel"] and r["shape"] == [1, n] and r["finite"]
    assert r["err"] <= _bound(r["torch_err"]), r
    assert r["counters"] == 0


@pytest.mark.parametrize("x_scale", [1e4, 1e-4])
def test_int4_gemv_keeps_its_precision_for_large_and_small_x(interpreted, x_scale):
    """The codes are subnormal floats and x is scaled by up to 2^85 before the FMAs: large
    activations must not overflow, small ones must not lose their bits to subnormals."""
    r = interpreted[f"gemv x{x_scale:g}"]
    assert r["finite"] and r["err"] <= _bound(r["torch_err"]), r


def test_triton_kernel_takes_float16_and_no_bias(interpreted):
    r = interpreted["fp16"]
    assert r["shape"] == [2, 5, 64] and r["dtype"] == "torch.float16" and r["finite"]
    assert r["err"] <= _bound(r["torch_err"]), r


@pytest.mark.parametrize(
    ("bits", "k", "dtype"),
    [
        (8, 640, torch.bfloat16),
        (8, 640, torch.float32),
        (8, 300, torch.bfloat16),
        (4, 300, torch.float32),
    ],
)
def test_cpu_op_matches_float64(bits, k, dtype):
    w, b, q, s, o, _ = _layer(123, k, bits, None, seed=k + bits, dtype=dtype)
    x = torch.randn(5, k).to(dtype)
    y = wo.wo_linear(x, q, s, o, b, bits, k)
    ref = wo.reference(x, q, s, o, b, bits, k)
    assert y.dtype == dtype and y.shape == (5, 123)
    bound = 1e-5 if dtype == torch.float32 else _bound(_torch_err(x, q, s, o, b, bits, k, ref))
    assert _rel(y, ref) <= bound


def test_opcheck_and_export_keep_the_op(tmp_path):
    torch.manual_seed(4)
    lin = torch.nn.Linear(256, 96).bfloat16()
    mod = WeightOnlyLinear(lin.weight, lin.bias, bits=4).eval()
    x = torch.randn(3, 256).bfloat16()
    torch.library.opcheck(wo.wo_linear, (x, mod.qweight, mod.scale, mod.offset, mod.bias, 4, 256))
    ep = torch.export.export(mod, (x,))
    ops = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.opswap.wo_linear.default in ops, ops
    path = tmp_path / "m.pt2"
    torch.export.save(ep, str(path))
    again = torch.export.load(str(path)).module()
    with torch.inference_mode():
        assert torch.equal(again(x), mod(x))


@pytest.mark.parametrize("bits", [8, 4])
def test_state_dict_round_trips(bits):
    torch.manual_seed(5)
    a = torch.nn.Linear(200, 48).bfloat16()
    m1 = WeightOnlyLinear(a.weight, a.bias, bits)
    m2 = WeightOnlyLinear(torch.randn(48, 200).bfloat16(), torch.randn(48).bfloat16(), bits)
    sd = m1.state_dict()
    assert set(sd) == {"qweight", "scale", "bias"} | ({"offset"} if bits == 4 else set())
    m2.load_state_dict(sd)
    x = torch.randn(4, 200).bfloat16()
    with torch.inference_mode():
        assert torch.equal(m1(x), m2(x))
        assert _rel(m1(x), a(x)) < (0.02 if bits == 8 else 0.15)


def _sm90_build(consts: dict, warps: int, xdtype: str):
    """`_int4_gemv_fn` compiled for sm_90 as a launch on the GPU would specialise it
    (pointers and the sizes and strides that are multiples of 16 marked so): PTX and SASS."""
    import inspect

    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    fn = triton.jit(wo._int4_gemv_fn)
    names = list(inspect.signature(wo._int4_gemv_fn).parameters)
    ptrs = {"x_ptr": xdtype, "w_ptr": "*i32", "b_ptr": xdtype, "y_ptr": xdtype, "cnt_ptr": "*i32"}
    sig = {
        p: "constexpr" if p in consts else ptrs.get(p, "*fp32") if p.endswith("_ptr") else "i32"
        for p in names
    }
    div16 = {"N", "K", "KW", "stride_xm", "stride_wn", "stride_sn"}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, p in enumerate(names)
        if sig[p] != "constexpr" and (sig[p].startswith("*") or p in div16)
    }
    src = triton.compiler.ASTSource(fn, sig, consts, attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    return k.asm["ptx"], k.asm["cubin"]


def test_int4_gemv_configs_fit_every_row_length():
    """The autotuner's list for `_int4_gemv`: 4 or 8 rows a thread, and per shape only
    chunks no wider than the row and splits no larger than the chunks (a short row still
    gets a configuration)."""
    pytest.importorskip("triton")
    for bn, bu, nw in wo.INT4_TILES:
        assert bn * bu // (32 * nw) in (4, 8)
    for k in (123, 1000, 2048, 5632):
        units = wo.padded_k(k, 128) // 32
        keep = wo._prune_int4(wo._int4_configs(), {"KW": 4 * units})
        assert keep
        for c in keep:
            chunks = -(-units // c.kwargs["BLOCK_U"])
            assert c.kwargs["SPLIT_K"] <= chunks
            assert c.kwargs["BLOCK_U"] <= max(units, 16)
            # loading d chunks ahead is kept only where a program walks more than d chunks
            assert -(-chunks // c.kwargs["SPLIT_K"]) > c.kwargs["PREFETCH"]
        assert any(c.kwargs["PREFETCH"] for c in keep) == (units > 16)
        assert {c.kwargs["PREFETCH"] for c in keep} <= {0, 1}  # the autotuner's depths
        deep = wo._prune_int4(wo._int4_configs((0, 1, 2)), {"KW": 4 * units})
        assert any(c.kwargs["PREFETCH"] == 2 for c in deep) == (units > 32)


def test_int4_launch_table_round_trips_and_is_read_per_device(tmp_path, monkeypatch):
    """tune_int4.py's winners written into the table are what `int4_tile` gives for that
    GPU class, shape, group, scale dtype and PDL, and nothing for any other (nor on the
    CPU); an entry that no longer suits the shape is ignored; a broken table is one
    sentence."""
    table = tmp_path / "int4_tiles.json"
    cfg = {"BLOCK_N": 8, "BLOCK_U": 64, "SPLIT_K": 1, "PREFETCH": True, "num_warps": 4}
    row = {"device": "sm90", "n": 2048, "k": 5632, "group": 128, "scale_dtype": "float32"}
    rows = [{**row, "pdl": True, "config": cfg, "us": 5.1, "speedup_vs_autotuned": 1.1}]
    assert wo.update_int4_tiles(rows, "measured test", table) == 1
    entries = wo.int4_tiles(table)
    assert entries == {("sm90", 2048, 5632, 128, "float32", True): cfg}
    monkeypatch.setattr(wo, "INT4_TILES_TABLE", table)
    cpu = torch.device("cpu")
    assert wo.int4_tile(cpu, 2048, 5632, 128, torch.float32, True) is None
    from opswap.kernels import crossover

    monkeypatch.setattr(wo, "interpreting", lambda: False)
    monkeypatch.setattr(crossover, "device_class", lambda d: "sm90")
    gpu = torch.device("cuda", 0)
    assert wo.int4_tile(gpu, 2048, 5632, 128, torch.float32, True) == cfg
    for other in [
        (2048, 5632, 128, torch.bfloat16, True),
        (2048, 5632, 128, torch.float32, False),
        (2048, 2048, 128, torch.float32, True),
        (2048, 5632, 64, torch.float32, True),
    ]:
        assert wo.int4_tile(gpu, *other) is None, other
    # a second write replaces the entry of the same key and keeps the others
    cfg2 = {**cfg, "BLOCK_U": 32}
    wo.update_int4_tiles(
        [{**rows[0], "config": cfg2}, {**rows[0], "n": 256, "config": cfg}], "again", table
    )
    assert wo.int4_tiles(table)[("sm90", 2048, 5632, 128, "float32", True)] == cfg2
    assert wo.int4_tile(gpu, 2048, 5632, 128, torch.float32, True) == cfg2  # not the old answer
    assert len(wo.int4_tiles(table)) == 2
    # prefetching over a row of one chunk a program no longer fits: autotuned instead
    wo.update_int4_tiles([{**rows[0], "k": 2048, "config": cfg}], "short", table)
    assert wo.int4_tile(gpu, 2048, 2048, 128, torch.float32, True) is None
    table.write_text("{not json")
    with pytest.raises(wo.WeightOnlyError, match="INT4 launch table"):
        wo.int4_tiles(table)


def test_shipped_int4_launch_table_fits_its_shapes():
    """Every shipped entry is a configuration the kernel takes for its shape."""
    for key, cfg in wo.int4_tiles().items():
        _, n, k, group, sdtype, _ = key
        assert sdtype in ("float32", "bfloat16", "float16"), key
        assert wo._int4_fits(cfg, wo.padded_k(k, group) // 32), key
        assert cfg["BLOCK_N"] * cfg["BLOCK_U"] // (32 * cfg["num_warps"]) in (4, 8), key


@pytest.mark.slow  # two compilations to cubin and their disassembly, a few seconds each
def test_int4_gemv_compiles_for_hopper_without_int_to_float_conversions(tmp_path):
    """The design in SASS: the codes arrive as 16-byte loads (LDG.E.128), become floats
    without I2F (the subnormal trick), and every fp32 FMA keeps subnormals (no FTZ)."""
    triton = pytest.importorskip("triton")
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not nvdisasm.exists():
        pytest.skip("this Triton ships no nvdisasm")
    builds = [
        ({"HAS_BIAS": False, "BLOCK_N": 16, "BLOCK_U": 64, "GROUP": 128, "SPLIT_K": 1}, 4, "*bf16"),
        ({"HAS_BIAS": True, "BLOCK_N": 8, "BLOCK_U": 32, "GROUP": 128, "SPLIT_K": 2}, 2, "*fp16"),
        ({"HAS_BIAS": False, "BLOCK_N": 8, "BLOCK_U": 32, "GROUP": 128, "SPLIT_K": 1}, 4, "*bf16"),
    ]
    builds = [
        (c | {"PDL": False, "PREFETCH": 2 * (i == 2)}, w, d) for i, (c, w, d) in enumerate(builds)
    ]
    for consts, warps, xdtype in builds:
        ptx, cubin = _sm90_build(consts, warps, xdtype)
        assert "fma.rn.f32" in ptx and ".ftz" not in ptx
        path = tmp_path / "k.cubin"
        path.write_bytes(cubin)
        sass = subprocess.run(
            [str(nvdisasm), "-c", str(path)], capture_output=True, text=True, check=True
        ).stdout
        assert "LDG.E.128" in sass and "FFMA" in sass
        assert "I2F" not in sass and "FTZ" not in sass, consts


@pytest.mark.parametrize("prefetch", [0, 2])
def test_int4_gemv_loads_scales_with_the_codes_before_the_dependent_launch_wait(prefetch):
    """Under PDL everything the kernel before does not write may load before the wait:
    the codes (16-byte loads) and the float32 scales and offsets (32-bit loads) of the
    chunks in flight. The kernel that loaded its scales after the wait spent a trip to
    memory per Linear after the kernel before had finished (2.45x bf16 against 2.80x over
    the 154 Linears on an H100, results/tune_int4_ab_h100.json)."""
    pytest.importorskip("triton")
    consts = {"HAS_BIAS": False, "BLOCK_N": 16, "BLOCK_U": 32, "GROUP": 128, "SPLIT_K": 1}
    ptx, _ = _sm90_build(consts | {"PDL": True, "PREFETCH": prefetch}, 4, "*bf16")
    assert ptx.count("griddepcontrol.wait") == 1
    before = ptx[: ptx.index("griddepcontrol.wait")]
    loads = re.findall(r"ld\.global[\w.]*", before)
    assert "ld.global.v4.b32" in loads and "ld.global.b32" in loads, sorted(set(loads))
    # the chunks in flight: one more chunk's codes, scales and offsets per chunk ahead
    ptx0, _ = _sm90_build(consts | {"PDL": True, "PREFETCH": 0}, 4, "*bf16")
    n0 = len(re.findall(r"ld\.global", ptx0[: ptx0.index("griddepcontrol.wait")]))
    assert len(loads) == n0 * (prefetch + 1)


@needs_cuda
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_cuda_kernel_matches_float64_autotuned(bits, m):
    for k, n in [(640, 123), (2048, 256), (300, 45)]:
        w, b, q, s, o, _ = _layer(n, k, bits, None, seed=m + k, device="cuda")
        x = torch.randn(m, k, device="cuda").bfloat16()
        ref = wo.reference(x, q, s, o, b, bits, k)
        y = wo.wo_linear(x, q, s, o, b, bits, k)
        assert _rel(y, ref) <= _bound(_torch_err(x, q, s, o, b, bits, k, ref)), (k, n)
        y2 = wo.wo_linear(x, q, s, o, b, bits, k)
        assert torch.equal(y, y2)  # split-K adds partials in a fixed order: deterministic


@needs_cuda
def test_cuda_kernel_under_a_cuda_graph():
    w, b, q, s, o, _ = _layer(512, 1024, 4, 128, seed=9, device="cuda")
    x = torch.randn(1, 1024, device="cuda").bfloat16()
    wo.wo_linear(x, q, s, o, b, 4, 1024)  # tunes and allocates the counters outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = wo.wo_linear(x, q, s, o, b, 4, 1024)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        ref = wo.reference(x, q, s, o, b, 4, 1024)
        assert _rel(y, ref) <= _bound(_torch_err(x, q, s, o, b, 4, 1024, ref))


@needs_cuda
@pytest.mark.skipif(CUDA and not wo.pdl_ok(torch.device("cuda")), reason="PDL needs sm_90")
def test_int4_gemv_as_a_dependent_launch_reads_what_the_kernel_before_wrote(monkeypatch):
    """A chain of INT4 Linears at one row, each launched with PDL (its weight loads before
    gdc_wait overlap the Linear before it), captured in a CUDA graph: every Linear must
    read its input only once the one before has written it, so the chain matches the
    same chain launched plainly, replay after replay, for shapes with split-K and without."""
    shapes = [(1024, 2048), (2048, 640), (640, 5632), (5632, 1024)]
    layers = [_layer(n, k, 4, 128, seed=k + n, device="cuda") for k, n in shapes]
    x = torch.randn(1, 1024, device="cuda").bfloat16()

    def chain():
        h = x
        for (k, _), (_, b, q, s, o, _) in zip(shapes, layers, strict=True):
            h = wo.wo_linear(h, q, s, o, b, 4, k)
        return h

    ref = chain()  # tunes and allocates the counters outside capture
    monkeypatch.setattr(wo, "INT4_PDL", True)
    assert torch.equal(chain(), ref)  # eager, the same launches: the same sums
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = chain()
    for _ in range(5):
        x.copy_(torch.randn_like(x))
        g.replay()
        monkeypatch.setattr(wo, "INT4_PDL", False)
        want = chain()
        monkeypatch.setattr(wo, "INT4_PDL", True)
        torch.cuda.synchronize()
        assert torch.equal(y, want)


if __name__ == "__main__":  # the interpreter's half of `interpreted`
    out = {str(list(c)): _interpreted_case(*c) for c in CASES}
    out["fp16"] = _interpreted_fp16()
    for c in GEMV_CASES:
        out[str(["gemv", *c])] = _interpreted_gemv(*c)
    for c in GEMV_PREFETCH_CASES:
        out[str(["gemv prefetch", *c])] = _interpreted_gemv(*c[:-1], prefetch=c[-1])
    for x_scale in (1e4, 1e-4):
        out[f"gemv x{x_scale:g}"] = _interpreted_gemv(
            1000, 77, "bf16", True, 128, 2, 8, "fp32", x_scale
        )
    print(json.dumps(out))
