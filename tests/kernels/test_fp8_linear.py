"""opswap::fp8_linear: e4m3 quantisation bounds, the CPU simulation against float64, the
support check's reasons, export and the module's state_dict; on a GPU, `_scaled_mm` and
the Triton row quantisation against the same references."""

from __future__ import annotations

import pytest
import torch

from opswap.kernels import fp8_linear as fp8
from opswap.rules.precision._lowbit_modules import FP8Linear

CUDA = torch.cuda.is_available()
needs_fp8 = pytest.mark.skipif(
    not CUDA or fp8.fp8_supported("cuda") is not None,
    reason="needs a CUDA GPU with row-wise FP8 (compute capability 9.0; runs in the GPU suite)",
)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("rowwise", [True, False])
def test_weight_quantisation_errs_at_most_half_an_e4m3_step(rowwise):
    torch.manual_seed(0)
    w = torch.randn(45, 300) * torch.rand(45, 1) * 4
    wq, s = fp8.quantize_weight(w, rowwise)
    assert wq.dtype == fp8.FP8 and s.shape == ((45,) if rowwise else ())
    deq = wq.double() * (s.double()[:, None] if rowwise else s.double())
    # e4m3: 3 mantissa bits, relative step 2^-3, rounding error <= 2^-4 of the value,
    # and a fixed floor of half the smallest subnormal (2^-10) times the scale
    floor = (s.double()[:, None] if rowwise else s.double()) * 2.0**-10
    assert ((deq - w.double()).abs() <= w.double().abs() * 2.0**-4 + floor + 1e-12).all()
    assert float((wq.float().abs().amax(dim=1))[0]) == 448.0 or not rowwise


@pytest.mark.parametrize("rowwise", [True, False])
def test_cpu_op_matches_float64_and_the_error_is_fp8s(rowwise):
    torch.manual_seed(1)
    x = torch.randn(2, 7, 304).bfloat16() * 3
    w, b = torch.randn(48, 304) / 304**0.5, torch.randn(48).bfloat16()
    wq, s = fp8.quantize_weight(w, rowwise)
    y = fp8.fp8_linear(x, wq, s, b, rowwise)
    ref = fp8.reference(x, wq, s, b, rowwise)
    true = x.double() @ w.double().t() + b.double()
    assert y.shape == (2, 7, 48) and y.dtype == torch.bfloat16
    assert _rel(y, ref) < 4e-3  # bfloat16 output rounding
    assert 0.01 < _rel(ref, true) < 0.06  # e4m3 on both operands


def test_support_check_gives_one_sentence_reasons():
    why = fp8.fp8_supported("cpu")
    assert why and "CUDA GPU" in why and "cpu" in why
    assert "multiples of 16" in fp8.shape_supported(300, 48)
    assert fp8.shape_supported(304, 48) is None


def test_export_keeps_the_op_and_state_dict_round_trips():
    torch.manual_seed(2)
    lin = torch.nn.Linear(64, 32).bfloat16()
    m1 = FP8Linear(lin.weight, lin.bias)
    m2 = FP8Linear(torch.randn(32, 64).bfloat16(), None)
    m2.register_buffer("bias", torch.zeros(32).bfloat16())
    m2.load_state_dict(m1.state_dict())
    x = torch.randn(5, 64).bfloat16()
    with torch.inference_mode():
        assert torch.equal(m1(x), m2(x))
    assert set(m1.state_dict()) == {"weight_fp8", "weight_scale", "bias"}
    ep = torch.export.export(m1, (x,))
    assert torch.ops.opswap.fp8_linear.default in [n.target for n in ep.graph.nodes]


@needs_fp8
@pytest.mark.parametrize("rowwise", [True, False])
@pytest.mark.parametrize("m", [1, 16, 333])
def test_scaled_mm_matches_float64(rowwise, m):
    torch.manual_seed(m)
    k, n = 2048, 256
    x = torch.randn(m, k, device="cuda").bfloat16()
    w, b = torch.randn(n, k, device="cuda") / k**0.5, torch.randn(n, device="cuda").bfloat16()
    wq, s = fp8.quantize_weight(w, rowwise)
    y = fp8.fp8_linear(x, wq, s, b, rowwise)
    ref = fp8.reference(x, wq, s, b, rowwise)
    # fast accumulation and the bfloat16 output: a few bfloat16 roundings
    assert _rel(y, ref) < 1e-2
    assert _rel(ref, x.double() @ w.double().t() + b.double()) < 0.06


@needs_fp8
def test_triton_row_quantisation_matches_aten():
    # (not run in the interpreter: Triton 3.9's interpreter rounds float32 -> e4m3 wrongly
    # where rounding carries into the next power of two, 127.8 -> 64)
    torch.manual_seed(3)
    x = torch.randn(37, 5632, device="cuda").bfloat16() * 5
    q, s = fp8.quantize_rows(x)
    q2, s2 = fp8._quant_rows_torch(x, True)
    assert torch.equal(s, s2) and torch.equal(q.float(), q2.float())
