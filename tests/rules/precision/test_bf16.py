"""precision.bf16 and precision.fp16: where they apply and why not, in both capture flavours;
that the result keeps the user's module's outputs within the half types' rounding at other
batch sizes, with an in-place op, a BatchNorm in eval and a registered buffer in the mix;
that the sensitive ops keep float32; that the cast cleanup between two half sites changes
no bit; that float16 is refused where the example's values approach its range; and that
the prediction says slower on a CPU without native half arithmetic and faster on an H200."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import opswap.rules.precision._half as half
from opswap.graph.capture import capture
from opswap.graph.ops import op_kind
from opswap.planner import apply_plan, make_plan
from opswap.targets import get_target
from opswap.targets.base import Target

from .._shapes import other_shapes

# A profile with fixed numbers, half at 10x the float32 rate and no dispatch cost, so that
# which sites the prediction takes does not depend on the machine running the tests.
HALF_GPU = Target(
    name="half-gpu",
    description="test profile",
    kind="cuda",
    peak_flops={"float32": 1e11, "bfloat16": 1e12, "float16": 1e12},
    mem_bandwidth=1e12,
    memory_bytes=2**34,
    dtypes=("float32", "bfloat16", "float16"),
)

#: relative L2 of the whole model's output against float32, a few layers deep
BOUND = {"precision.bf16": 2e-2, "precision.fp16": 3e-3}
DTYPE = {"precision.bf16": torch.bfloat16, "precision.fp16": torch.float16}


class Net(nn.Module):
    """Conv -> BatchNorm (eval) -> in-place ReLU -> two Linears joined by relu and dropout
    (the cast pair between them goes) -> a registered buffer added -> attention-like
    scores through a matmul of two activations -> softmax and log_softmax (float32)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.act = nn.ReLU(inplace=True)
        self.l1 = nn.Linear(6 * 5 * 7, 40)
        self.drop = nn.Dropout(0.2)
        self.l2 = nn.Linear(40, 24)
        self.register_buffer("shift", torch.randn(24))
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)

    def forward(self, x):
        h = self.act(self.bn(self.conv(x))).flatten(1)
        h = self.l2(self.drop(torch.relu(self.l1(h)))) + self.shift
        q = h.view(-1, 4, 6)
        scores = torch.matmul(q, q.transpose(1, 2)).softmax(-1)
        return scores.flatten(1).log_softmax(-1)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _plan(model, xs, method, rule, target=HALF_GPU):
    cap = capture(model, xs, method=method)
    plan = make_plan(cap, rules=[rule], exactness="approx", target=target)
    return cap, plan, apply_plan(cap, plan)


def _casts(gm):
    return [n for n in gm.graph.nodes if half.cast_dtype(n) is not None]


@pytest.mark.parametrize("method", ["fx", "export"])
@pytest.mark.parametrize("rule", ["precision.bf16", "precision.fp16"])
def test_the_compute_ops_run_in_half_and_the_model_keeps_its_outputs(method, rule):
    torch.manual_seed(0)
    model = Net().eval()
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(3, 3, 5, 7)
    cap, plan, applied = _plan(model, (x,), method, rule)
    assert not plan.failed and not applied.failed, (plan.failed, applied.failed)
    assert len(plan.decisions) == 4, plan.decisions  # conv, l1, l2 and the matmul
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    gm, dtype = applied.gm, DTYPE[rule]
    # weights are held in half, as buffers, converted once; none is left in float32 for them
    halves = [t for t in gm.buffers() if t.dtype == dtype]
    assert len(halves) == 6, [(k, t.dtype) for k, t in gm.named_buffers()]
    assert not [p for p in gm.parameters() if p.dim() >= 2], "a float32 weight stayed"
    # the sensitive ops read float32: softmax, log_softmax and the BatchNorm
    cap.propagate(gm)
    for n in gm.graph.nodes:
        if op_kind(n) in ("softmax", "log_softmax", "batch_norm"):
            assert n.args[0].meta["tensor_meta"].dtype == torch.float32, n.name
    # l1 -> relu -> dropout -> l2 runs in half without a cast pair between: casts down
    # into conv, l1 and both operands of the matmul, back out of conv, l2 and the matmul
    assert len(_casts(gm)) == 7, [n.name for n in _casts(gm)]
    checked = 0
    for label, xs in [("example", (x,)), *other_shapes(cap)]:
        with torch.inference_mode():
            want, got = model(*xs), gm(*xs)
        assert got.shape == want.shape and got.dtype == torch.float32, label
        assert 0 < _rel(got, want) < BOUND[rule], (label, _rel(got, want))
        checked += 1
    assert checked >= 3


@pytest.mark.parametrize("method", ["fx", "export"])
def test_removing_the_cast_pair_between_two_half_sites_changes_no_bit(method, monkeypatch):
    torch.manual_seed(1)
    model = Net().eval()
    x = torch.randn(4, 3, 5, 7)
    _, _, joined = _plan(model, (x,), method, "precision.bf16")
    monkeypatch.setattr(half, "chain_to_half", lambda x, reader, dtype: None)
    _, plan, apart = _plan(model, (x,), method, "precision.bf16")
    assert len(plan.decisions) == 4
    assert len(_casts(apart.gm)) == len(_casts(joined.gm)) + 2  # the l1 -> l2 pair
    for b in (1, 4, 6):
        xb = torch.randn(b, 3, 5, 7)
        with torch.inference_mode():
            assert torch.equal(joined.gm(xb), apart.gm(xb)), b


class AlreadyHalf(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16).to(torch.bfloat16)
        self.b = nn.Linear(16, 16).double()

    def forward(self, x):
        return self.a(x.to(torch.bfloat16)).float(), self.b(x.double())


def test_weights_already_half_and_other_dtypes_are_refused_with_reasons():
    _, plan, _ = _plan(AlreadyHalf().eval(), (torch.randn(3, 16),), "fx", "precision.bf16")
    assert not plan.decisions
    why = " | ".join(m.reason for m in plan.misses)
    assert "a already computes in bfloat16" in why and "float64" in why, why


def test_not_planned_at_exact():
    cap = capture(Net().eval(), (torch.randn(2, 3, 5, 7),), method="fx")
    plan = make_plan(cap, exactness="exact", target=HALF_GPU)
    assert not any(d.rule.startswith("precision.") for d in plan.decisions)


def test_predicted_slower_on_an_avx2_cpu_and_faster_on_an_h200(monkeypatch):
    """The prediction, not a timing: the `cpu` profile gives no bfloat16 rate, and without
    avx512_bf16 / amx_bf16 the rule prices the GEMM at float32 plus its casts."""
    monkeypatch.setattr(half, "_cpu_flags", lambda: frozenset({"avx2", "fma"}))
    model = nn.Sequential(nn.Linear(2048, 2048), nn.GELU(), nn.Linear(2048, 512)).eval()
    cap = capture(model, (torch.randn(8, 32, 2048),), method="fx")
    rules = ["precision.bf16", "precision.fp16"]
    cpu = make_plan(cap, rules=rules, exactness="approx", target=get_target("cpu"))
    assert not cpu.decisions and len(cpu.skipped) == 4, cpu.skipped
    assert all("no native" in s.reason for s in cpu.skipped), cpu.skipped
    h200 = make_plan(cap, rules=["precision.bf16"], exactness="approx", target="h200")
    # at 256 rows the 2048 -> 2048 GEMM pays for its casts; the 2048 -> 512 one does not:
    # two cast launches (10.2 us each on the H200 profile) cost more than its GEMM saves
    assert [d.site.key for d in h200.decisions] == ["_0"]
    assert h200.decisions[0].estimate.time_saved_s > 0
    assert [s.where for s in h200.skipped] == ["_2"], h200.skipped
    assert "predicted slower on h200" in h200.skipped[0].reason
    monkeypatch.setattr(half, "_cpu_flags", lambda: frozenset({"amx_bf16"}))
    ok, why = half.native(get_target("cpu"), torch.bfloat16)
    assert ok and "amx_bf16" in why
