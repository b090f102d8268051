"""opswap::int8_linear: the integer kernel against its reference and against the float
Linear it replaces (a worst-case bound per element, not only an average), on odd shapes,
through torch.library's op checks and torch.export save/load."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from opswap.kernels.int8_linear import direct, int8_linear, quantize_weight, reference
from opswap.rules.precision._int8_module import Int8Linear


def _bound(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Largest |int8 result - float result| the rounding allows, per output element:
    x = xq*sx + ex and w = wq*sw + ew with |ex| <= sx/2 and |ew| <= sw/2, so
    |x.w - xq.wq*sx*sw| <= sum_k |x||ew| + |wq*sw||ex|, plus float32 slack."""
    sx = x2.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
    sw = w.abs().amax(1).clamp_min(1e-12) / 127
    wq_abs = (w.abs() / sw[:, None]).round() * sw[:, None]
    b = x2.abs() @ (sw[:, None] / 2).expand_as(w).t() + (sx / 2) @ wq_abs.abs().sum(1)[None, :]
    return b * (1 + 1e-4) + 1e-5 * (x2.abs() @ w.abs().t())


@settings(max_examples=30, deadline=None)
@given(
    lead=st.sampled_from([(1,), (3,), (17,), (2, 5), (1, 1, 9)]),
    k=st.sampled_from([8, 13, 64, 100]),
    n=st.sampled_from([1, 16, 33]),
    bias=st.booleans(),
    scale=st.sampled_from([1e-3, 1.0, 50.0]),
)
def test_kernel_matches_reference_and_stays_inside_the_rounding_bound(lead, k, n, bias, scale):
    torch.manual_seed(k * 7 + n)
    x = torch.randn(*lead, k) * scale
    w = torch.randn(n, k) * 0.1
    b = torch.randn(n) if bias else None
    wq, ws = quantize_weight(w)
    got = direct(x, wq, ws, b)
    assert got.shape == (*lead, n) and got.dtype == torch.float32
    # the integer GEMM and the float reference of the same integer math agree to rounding
    torch.testing.assert_close(got, reference(x, wq, ws, b), rtol=1e-5, atol=1e-5 * scale)
    # and the result is within what int8 rounding of x and w can move a float Linear
    want = F.linear(x, w, b)
    err = (got - want).abs().reshape(-1, n)
    assert (err <= _bound(x.reshape(-1, k), w)).all()


def test_per_row_scales_keep_an_outlier_token_from_costing_the_others():
    torch.manual_seed(0)
    x = torch.randn(8, 256)
    x[3] *= 1000.0  # one outlier token
    w = torch.randn(128, 256) * 0.05
    wq, ws = quantize_weight(w)
    got, want = direct(x, wq, ws, None), F.linear(x, w)
    rel = (got - want).norm(dim=1) / want.norm(dim=1)
    assert rel.max() < 0.03  # each row at its own scale, the outlier row included
    # a per-tensor scale would have put the other rows' values into a few int8 steps
    s = x.abs().max() / 127
    coarse = (torch.round(x / s).clamp(-127, 127) * s) @ (wq.float() * ws)
    assert ((coarse - want).norm(dim=1) / want.norm(dim=1))[[0, 1, 2, 4]].min() > 10 * rel.max()


def test_zero_rows_and_zero_weights_give_the_bias_not_nan():
    x = torch.zeros(5, 64)
    x[1] = torch.randn(64)
    w = torch.randn(16, 64)
    w[4] = 0.0
    b = torch.randn(16)
    wq, ws = quantize_weight(w)
    y = direct(x, wq, ws, b)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y[0], b)
    torch.testing.assert_close(y[:, 4], b[4].expand(5))


@pytest.mark.parametrize("rows, k, n", [(9, 64, 16), (37, 100, 33)])
def test_a_row_holding_inf_gives_float32s_inf_a_nan_row_nan_and_the_other_rows_are_untouched(
    rows, k, n
):
    torch.manual_seed(rows)
    clean = torch.randn(rows, k)
    w, b = torch.randn(n, k) * 0.1, torch.randn(n)
    x = clean.clone()
    x[1, 5], x[2, 7], x[3, 0] = float("inf"), -float("inf"), float("nan")
    wq, ws = quantize_weight(w)
    got, want = direct(x, wq, ws, b), F.linear(x, w, b)
    for row, col in ((1, 5), (2, 7)):
        held = wq[col] != 0  # inf times a weight int8 holds: +-inf with float32's sign
        assert torch.equal(got[row][held], want[row][held]) and torch.isinf(got[row][held]).all()
        # a weight below half its channel's int8 step is held as 0: inf * 0, NaN
        assert got[row][~held].isnan().all() and held.float().mean() > 0.9
    assert got[3].isnan().all() and want[3].isnan().all()
    finite = [0, *range(4, rows)]  # rows are quantised on their own: the others are as they were
    assert torch.isfinite(got[finite]).all()
    torch.testing.assert_close(got[finite], direct(clean[finite], wq, ws, b))
    torch.testing.assert_close(reference(x, wq, ws, b), got, equal_nan=True)
    torch.testing.assert_close(
        int8_linear(x.reshape(1, rows, k), wq, ws, b)[0], got, equal_nan=True
    )


def test_typical_error_is_about_one_percent():
    torch.manual_seed(1)
    lin = torch.nn.Linear(768, 768)
    x = torch.randn(64, 768)
    y = Int8Linear(lin.weight, lin.bias)(x)
    rel = float((y - lin(x)).norm() / lin(x).norm())
    assert 1e-3 < rel < 2e-2  # int8 really rounds, and by about what the docs say


def test_registered_op_passes_torch_library_checks_and_exports_as_one_node():
    torch.manual_seed(2)
    x = torch.randn(3, 7, 64)
    wq, ws = quantize_weight(torch.randn(32, 64))
    for b in (None, torch.randn(32)):
        torch.library.opcheck(
            int8_linear, (x, wq, ws, b), test_utils=("test_schema", "test_faketensor")
        )
        torch.testing.assert_close(int8_linear(x, wq, ws, b), direct(x, wq, ws, b))

    class OneOp(torch.nn.Module):
        def forward(self, x, wq, ws):
            return int8_linear(x, wq, ws, None)

    ep = torch.export.export(OneOp(), (x, wq, ws))
    assert sum("opswap.int8_linear" in str(n.target) for n in ep.graph.nodes) == 1


def test_export_keeps_the_integer_gemm_and_reloads(tmp_path, monkeypatch):
    from opswap.backends.pt2 import load
    from opswap.kernels import int8_linear as k

    # the _int_mm path, as on a CPU with VNNI (small shapes: fast enough anywhere)
    monkeypatch.setattr(k, "cpu_int_mm_fast", lambda: True)
    torch.manual_seed(3)
    lin = torch.nn.Linear(96, 40)
    model = torch.nn.Sequential(Int8Linear(lin.weight, lin.bias), torch.nn.ReLU()).eval()
    x = torch.randn(4, 10, 96)
    batch = torch.export.Dim("batch", min=1, max=64)
    ep = torch.export.export(model, (x,), dynamic_shapes=({0: batch},))
    # the integer GEMM and int8 weights survive export: the file runs what was timed
    assert any(n.op == "call_function" and "_int_mm" in str(n.target) for n in ep.graph.nodes)
    assert any(t.dtype == torch.int8 for t in ep.state_dict.values()) or any(
        t.dtype == torch.int8 for t in ep.constants.values()
    )
    path = tmp_path / "m.pt2"
    torch.export.save(ep, path)
    loaded = load(path)
    for b in (1, 4, 7):
        xb = torch.randn(b, 10, 96)
        with torch.inference_mode():
            torch.testing.assert_close(loaded(xb), model(xb))


def test_state_dict_holds_int8_weights_a_quarter_the_size():
    lin = torch.nn.Linear(128, 64)
    sd = Int8Linear(lin.weight, lin.bias).state_dict()
    assert sd["weight_int8"].dtype == torch.int8 and sd["weight_int8"].shape == (128, 64)
    assert sd["weight_int8"].numel() * 1 == lin.weight.numel() * 4 // 4
    assert sd["weight_scale"].shape == (64,)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_input_dtypes_come_back_in_their_dtype(dtype):
    lin = torch.nn.Linear(64, 16)
    q = Int8Linear(lin.weight, lin.bias)
    x = torch.randn(9, 64, dtype=dtype)
    y = q(x)
    assert y.dtype == dtype
    assert float((y.double() - lin(x.float()).double()).norm() / lin(x.float()).norm()) < 0.05


def test_rounding_is_unbiased():
    """Rounding to nearest errs both ways: the error has no component along the output.
    A scale off by 0.3% (far inside the worst-case bound) would show as a slope of 3e-3."""
    torch.manual_seed(4)
    lin = torch.nn.Linear(512, 256)
    x = torch.randn(96, 512)
    want = lin(x).detach()
    got = Int8Linear(lin.weight, lin.bias)(x).detach()
    err = (got - want).flatten().double()
    w = want.flatten().double()
    slope = float((err @ w) / (w @ w))
    assert abs(slope) < 5e-4, slope
