"""opswap::int8_linear_fbgemm: FBGEMM's int8 Linear against the op's float32 reference
(the same quantisation) and against the float Linear it replaces, on odd shapes; the
prepacked weight's cache; torch.export save/load; the ONNX lowering in ONNX Runtime; and
precision.int8_linear choosing it on a CPU without VNNI, verified against the user's
module at other batch sizes."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from opswap.kernels import int8_fbgemm as fb
from opswap.kernels.int8_linear import quantize_weight
from opswap.rules.precision._int8_module import Int8Linear

needs_fbgemm = pytest.mark.skipif(
    not fb.available(), reason="this torch has no FBGEMM quantised CPU ops (x86 builds do)"
)


# odd shapes, with and without bias; inputs all positive, mixed and all negative
CASES = dict(
    lead=st.sampled_from([(1,), (5,), (37,), (2, 7), (1, 3, 9)]),
    k=st.sampled_from([9, 64, 123]),
    n=st.sampled_from([1, 17, 40]),
    bias=st.booleans(),
    shift=st.sampled_from([0.0, 3.0, -2.0]),
)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _step_bound(x2: torch.Tensor, w: torch.Tensor, b) -> torch.Tensor:
    """Largest |op - float Linear| the two roundings allow per output element: the input
    step s (per tensor) and the weight step per channel, half a step each."""
    lo, hi = min(float(x2.min()), 0.0), max(float(x2.max()), 0.0)
    s = max((hi - lo) / 127, 1e-12)
    sw = w.abs().amax(1).clamp_min(1e-12) / 127
    wq_abs = (w.abs() / sw[:, None]).round() * sw[:, None]
    bound = x2.abs() @ (sw[:, None] / 2).expand_as(w).t() + (s / 2) * wq_abs.sum(1)[None, :]
    return bound * (1 + 1e-3) + 1e-5 * (x2.abs() @ w.abs().t()) + 1e-6


@settings(max_examples=25, deadline=None)
@given(**CASES)
def test_reference_stays_inside_the_rounding_bound(lead, k, n, bias, shift):
    torch.manual_seed(k * 5 + n)
    x = torch.randn(*lead, k) + shift
    w = torch.randn(n, k) * 0.2
    b = torch.randn(n) if bias else None
    wq, ws = quantize_weight(w)
    got = fb.reference(x, wq, ws, b)
    want = F.linear(x, w, b)
    assert got.shape == want.shape and got.dtype == x.dtype
    err = (got - want).abs().reshape(-1, n)
    assert (err <= _step_bound(x.reshape(-1, k), w, b)).all()


@needs_fbgemm
@settings(max_examples=25, deadline=None)
@given(**CASES)
def test_fbgemm_matches_the_reference(lead, k, n, bias, shift):
    torch.manual_seed(k * 3 + n)
    x = torch.randn(*lead, k) + shift
    w = torch.randn(n, k) * 0.2
    b = torch.randn(n) if bias else None
    wq, ws = quantize_weight(w)
    with torch.inference_mode():
        got = fb.int8_linear_fbgemm(x, wq, ws, b)
    want = fb.reference(x, wq, ws, b)
    assert got.shape == want.shape
    # the same codes; FBGEMM requantises the scale in float: a small fraction of one step
    err = (got - want).abs().reshape(-1, n)
    assert (err <= 0.05 * _step_bound(x.reshape(-1, k), w, b) + 1e-5).all(), float(err.max())


@needs_fbgemm
def test_non_contiguous_and_empty_inputs():
    torch.manual_seed(0)
    w = torch.randn(24, 40)
    wq, ws = quantize_weight(w)
    x = torch.randn(40, 11).t()  # [11, 40], strided
    assert not x.is_contiguous()
    assert _rel(fb.direct(x, wq, ws, None), fb.reference(x, wq, ws, None)) < 1e-3
    empty = torch.randn(0, 40)
    assert fb.direct(empty, wq, ws, None).shape == (0, 24)


@needs_fbgemm
def test_an_in_place_weight_update_is_seen_and_a_dropped_weight_leaves_the_cache():
    torch.manual_seed(1)
    w, b = torch.randn(16, 32), torch.randn(16)
    wq, ws = quantize_weight(w)
    x = torch.randn(6, 32)
    fb.direct(x, wq, ws, b)
    with torch.no_grad():
        wq.mul_(-1)  # same tensor, new version
        b.add_(1.0)
    assert _rel(fb.direct(x, wq, ws, b), fb.reference(x, wq, ws, b)) < 1e-3
    assert wq in fb._PACKED
    before, gone = len(fb._PACKED), weakref.ref(wq)
    del wq
    gc.collect()
    assert gone() is None and len(fb._PACKED) == before - 1


def test_the_op_passes_torch_library_checks():
    torch.manual_seed(2)
    wq, ws = quantize_weight(torch.randn(8, 20))
    torch.library.opcheck(
        fb.int8_linear_fbgemm,
        (torch.randn(3, 20), wq, ws, torch.randn(8)),
        test_utils=(
            "test_schema",
            "test_faketensor",
        ),
    )


def test_export_keeps_the_op_and_the_saved_program_runs_at_other_batches(tmp_path):
    torch.manual_seed(3)
    lin = nn.Linear(48, 20)
    m = Int8Linear(lin.weight.data, lin.bias.data, kernel="fbgemm").eval()
    x = torch.randn(4, 48)
    ep = torch.export.export(m, (x,), dynamic_shapes=({0: torch.export.Dim.AUTO},), strict=False)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.opswap.int8_linear_fbgemm.default]
    torch.export.save(ep, tmp_path / "m.pt2")
    loaded = torch.export.load(tmp_path / "m.pt2").module()
    xb = torch.randn(9, 48)
    with torch.no_grad():
        torch.testing.assert_close(loaded(xb), m(xb))
        assert _rel(loaded(xb), lin(xb)) < 0.03


def test_the_onnx_lowering_runs_the_ops_math_in_ort(tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    import onnx

    from opswap.backends.ort import ort_artifact
    from opswap.graph.dynamic import Axis, Dynamic

    torch.manual_seed(4)
    lin = nn.Linear(40, 12)
    m = Int8Linear(lin.weight.data, lin.bias.data, kernel="fbgemm").eval()
    x = torch.randn(3, 5, 40) + 0.5
    batch = Dynamic([Axis("batch", ((0, 0),), 3, 4)])
    art = ort_artifact(m, (x,), batch, tmp_path)
    assert art.module is not None, art.error
    ops = {n.op_type for n in onnx.load(str(art.path)).graph.node}
    assert "MatMulInteger" in ops and "DynamicQuantizeLinear" not in ops
    xb = torch.randn(2, 5, 40) - 0.3
    with torch.no_grad():
        want = fb.reference(xb, m.weight_int8, m.weight_scale, m.bias)
    # the same codes (ONNX's Round is half to even where torch.round is too)
    assert _rel(art.module(xb), want) < 1e-5


RULE = "precision.int8_linear"


class _Block(nn.Module):
    """A Linear feeding an in-place activation and a stateful BatchNorm (eval), then a
    second Linear; the user's module, run at other batch sizes."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(384, 640)
        self.bn = nn.BatchNorm1d(640)
        self.down = nn.Linear(640, 264)

    def forward(self, x):
        h = self.up(x)
        h = F.relu_(h)
        return self.down(self.bn(h))


@needs_fbgemm
def test_the_rule_picks_fbgemm_without_vnni_and_the_result_follows_the_users_module(
    monkeypatch,
):
    import opswap
    from opswap.bench.timing import with_timer
    from opswap.graph.capture import capture
    from opswap.kernels import int8_linear as k8
    from opswap.planner import make_plan
    from opswap.rules.precision import int8_linear as rule
    from opswap.targets import get_target

    monkeypatch.setattr(k8, "cpu_int_mm_fast", lambda: False)
    assert rule.cpu_kernel() == "fbgemm"
    torch.manual_seed(5)
    model = _Block().eval()
    model.bn.running_mean.uniform_(-0.5, 0.5)
    model.bn.running_var.uniform_(0.5, 2.0)
    x = torch.randn(128, 384)
    # which sites pay is the benchmark's business: here this CPU's timing says int8 pays
    monkeypatch.setattr(rule, "time_on_this_cpu", lambda *a: (2e-3, 1e-3))
    here = with_timer(get_target("cpu"))
    plan = make_plan(capture(model, (x,)), target=here, rules=RULE, exactness="approx")
    assert [d.rule for d in plan.decisions] == [RULE] * 2, plan.skipped
    assert all("7 bits (FBGEMM)" in d.site.description for d in plan.decisions)
    fast = opswap.apply(model, (x,), plan, allow_looser=True)
    kernels = {m.kernel for m in fast.modules() if isinstance(m, Int8Linear)}
    assert kernels == {"fbgemm"}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for rows in (1, 7, 50):
        xb = torch.randn(rows, 384)
        with torch.no_grad():
            want = model(xb.clone())
            got = fast(xb.clone())
        assert _rel(got, want) < 0.04, rows
    for k, v in model.state_dict().items():  # the user's module is untouched
        assert torch.equal(v, state[k]), k
