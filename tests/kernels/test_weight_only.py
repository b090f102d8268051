"""opswap::wo_linear: quantisation round trips, the Triton kernel (under TRITON_INTERPRET=1
on a CPU, compiled on a GPU) against the float64 reference on odd shapes, the CPU paths,
the op through opcheck and torch.export, and the module's state_dict."""

from __future__ import annotations

import json
import os
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


if __name__ == "__main__":  # the interpreter's half of `interpreted`
    out = {str(list(c)): _interpreted_case(*c) for c in CASES}
    out["fp16"] = _interpreted_fp16()
    print(json.dumps(out))
