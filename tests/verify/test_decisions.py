"""Class-score outputs: read as such, compared centred per row, judged by the rows whose
top-1 (top-5) class changes; other outputs left to the plain metrics."""

import json
import math

import pytest
import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

import opswap
from opswap.graph.dynamic import Axis, Dynamic
from opswap.targets.base import Target
from opswap.verify.decisions import agreement, graph_heads, read_scores
from opswap.verify.outputs import verify
from opswap.verify.samples import DECISION_BATCH, row_samples
from opswap.verify.tolerance import Tolerance


class Clf(nn.Module):
    """An MLP classifier: log-probabilities, or logits whose head carries a bias offset."""

    def __init__(self, d=24, h=48, c=20, offset=0.0, log_probs=True):
        super().__init__()
        self.l1, self.head = nn.Linear(d, h), nn.Linear(h, c)
        self.log_probs = log_probs
        with torch.no_grad():
            self.head.bias += offset

    def forward(self, x):
        y = self.head(torch.relu(self.l1(x)))
        return torch.log_softmax(y, -1) if self.log_probs else y


def _bf16(model):
    """The model with its matmuls in bfloat16, as precision.autocast runs it."""

    def run(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return pytree.tree_map(lambda t: t.float(), model(x))

    return run


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    return Clf(**kw).eval()


def _true_agreement(ref, cand, d=24, n=4096):
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(123))
    with torch.no_grad():
        return (ref(x).argmax(-1) == cand(x).argmax(-1)).float().mean().item()


# ------------------------------------------------------------------------- which outputs


def test_read_scores_from_the_values():
    x = torch.randn(6, 11)
    assert read_scores("output", torch.log_softmax(x, -1)).kind == "log_probs"
    assert read_scores("output", torch.softmax(x, -1)).kind == "probs"
    assert read_scores("output", torch.log_softmax(x, -1).to(torch.bfloat16)).kind == "log_probs"
    assert read_scores("output", torch.log_softmax(torch.randn(2, 5, 7), -1)).kind == "log_probs"
    big = torch.randn(3, 50_000) * 4  # a vocabulary's worth of classes, in float32
    assert read_scores("output", torch.softmax(big, -1)).kind == "probs"
    assert read_scores("output", torch.log_softmax(big, -1)).kind == "log_probs"
    # masked classes (-inf) keep log-probabilities log-probabilities
    masked = torch.log_softmax(x.masked_fill(torch.arange(11) > 7, -math.inf), -1)
    assert read_scores("output", masked).kind == "log_probs"
    assert read_scores("output['logits']", x).kind == "logits"
    assert read_scores("output.logits", x).kind == "logits"
    assert read_scores("output", x, head="fc").why == "it comes from a linear head (fc)"
    # not rows of class scores: plain values, multi-label sigmoids, the classes off the last
    # dim, one column, maps of 4 dims, integers
    assert read_scores("output", x) is None
    assert read_scores("output", torch.sigmoid(x)) is None
    assert read_scores("output", torch.log_softmax(x, 0)) is None
    assert read_scores("output", torch.randn(6, 1), head="fc") is None
    assert read_scores("output", torch.softmax(torch.randn(1, 2, 4, 4), -1)) is None
    assert read_scores("output", x.argmax(-1)) is None
    assert not read_scores("output", torch.softmax(x, -1)).offset_free
    assert read_scores("output", x, head="fc").offset_free


class Heads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.cls = nn.Linear(8, 5)
        self.box = nn.Linear(8, 4)
        self.norm = nn.LayerNorm(8)
        self.drop = nn.Dropout(0.1)
        self.w = nn.Parameter(torch.randn(3, 8))

    def forward(self, x):
        h = torch.relu(self.body(x))
        return {
            "scores": self.drop(self.cls(h)).view(-1, 5) * 2.0,  # still the head's rows
            "tied": h @ self.w.t(),  # a matmul with a weight
            "box": torch.tanh(self.box(h)),  # bounded regression
            "hidden": self.norm(h),
            "folded": self.cls(h).reshape(-1, 1),  # the classes moved off the last dim
            "negated": self.cls(h) * -1.0,  # the order reversed
            "inverted": 1.0 / self.cls(h),
        }


@pytest.mark.parametrize("how", ["fx", "export"])
def test_graph_heads_through_value_keeping_ops(how):
    m = Heads().eval()
    x = torch.randn(3, 6)
    if how == "fx":
        gm = fx.symbolic_trace(m)
        from opswap.graph.shapes import propagate

        propagate(gm, (x,), [])
    else:
        gm = torch.export.export(m, (x,), strict=False).module()
    heads = graph_heads(gm)
    assert heads is not None and len(heads) == 7
    scores, tied, box, hidden, folded, negated, inverted = heads
    assert scores is not None and tied is not None
    assert box is None and hidden is None and folded is None
    assert negated is None and inverted is None
    assert graph_heads(m) is None  # not a graph


# ---------------------------------------------------------------------------- agreement


def test_agreement_counts_changes_and_leaves_ties():
    ref = torch.tensor([[3.0, 1.0, 0.0], [2.0, 2.0 + 1e-7, 0.0], [5.0, 4.0, -1.0]])
    cand = torch.tensor([[1.0, 3.0, 0.0], [2.0 + 2e-7, 2.0, 0.0], [4.0, 4.5, 3.0]])
    a = agreement(ref, cand, 1, 5e-7)
    assert (a.rows, a.changed) == (3, 2)  # row 1 swaps two scores the rounding cannot order
    assert a.agreement == pytest.approx(1 / 3)
    # top-5 (here top-2): the reference's class is still second on the candidate's short
    # list in rows 0 and 2, so nothing left it
    assert agreement(ref, cand, 2, 5e-7).changed == 0
    nan = torch.tensor([[math.nan, 1.0], [1.0, 0.0]])
    assert agreement(nan, nan.flip(-1), 1, 5e-7).rows == 1  # NaN rows are left out


# ---------------------------------------------------------------- log-probs and bfloat16


def test_log_probs_in_bfloat16_fail_approx_on_the_rows_that_change():
    """The t36 case: plain metrics pass approx at ~50 dB, but the class changes on a few
    percent of rows; judged on 1000 rows, drawn at a larger batch."""
    m = _model()
    x = torch.randn(8, 24)
    dyn = Dynamic([Axis("batch", ((0, 0),), 8, 9)])
    v = verify(m, _bf16(m), (x,), tolerance="approx", graph=fx.symbolic_trace(m), dynamic=dyn)
    assert Tolerance.for_exactness("approx").check(v.metrics)[0]  # the plain view passes
    assert v.sqnr_db > 40
    assert not v.passed
    check = v.outputs[0]
    assert check.decisions is not None and check.decisions.scores.kind == "log_probs"
    assert any(r.startswith("output: top-1 class changed on ") for r in v.reasons)
    assert "rows (budget 1%)" in v.reasons[-1]
    assert v.decision_rows >= 1000
    true = _true_agreement(m, _bf16(m))
    assert true < 0.99 and abs(v.top1_agreement - true) < 0.02
    assert "top-1 agreement" in str(v)


def test_t36_autocast_on_log_probs_is_rolled_back():
    torch.manual_seed(0)
    m = Clf(d=64, h=128, c=32).eval()
    fast = Target(
        name="bf16fast",
        description="a profile where bfloat16 pays",
        kind="cpu",
        peak_flops={"float32": 1e11, "bfloat16": 1e14, "float16": 1e14, "int8": 1e15},
        mem_bandwidth=1e13,
        memory_bytes=1 << 34,
        dtypes=("float32", "bfloat16", "float16", "int8"),
    )
    r = opswap.optimize(
        m,
        (torch.randn(16, 64),),
        rules=["precision.autocast"],
        exactness="approx",
        target=fast,
        bench=False,
    )
    assert [b.decision.rule for b in r.rolled_back] == ["precision.autocast"]
    assert "top-1 class changed" in r.rolled_back[0].reason
    assert r.verification.passed and r.verification.top1_agreement == 1.0
    assert _true_agreement(m, r.candidate, d=64) >= 0.99


# ------------------------------------------------------------ logits with a bias offset


def _int8_logits(model):
    """The model with its head's output stored in int8, one scale for the tensor
    (symmetric): the bias offset takes the range, the classes' differences the rounding."""

    def run(x):
        y = model(x)
        scale = y.abs().amax() / 127
        return (y / scale).round().clamp(-127, 127) * scale

    return run


def test_int8_head_with_a_bias_offset_fails_by_its_centred_error_and_top1():
    m = _model(log_probs=False, offset=30.0)
    x = torch.randn(8, 24)
    cand = _int8_logits(m)
    # the plain metrics pass even the exact level's SQNR floor of 30 dB many times over
    blind = verify(m, cand, (x,), tolerance="approx")
    assert blind.passed and blind.sqnr_db > 45 and blind.outputs[0].decisions is None
    v = verify(m, cand, (x,), tolerance="approx", graph=fx.symbolic_trace(m))
    assert not v.passed
    assert v.outputs[0].decisions.scores.kind == "logits"
    assert any("centred per row, rel_l2" in r and "hides it" in r for r in v.reasons)
    assert any("top-1 class changed" in r for r in v.reasons)
    assert v.centred_rel_l2 > 0.03 > v.rel_l2
    # the same through opswap.verify, which traces the reference to read its head
    assert not opswap.verify(m, cand, (x,), exactness="approx").passed


def test_int8_head_through_optimize_keeps_the_decisions():
    """precision.int8_linear on a 256-class head with a bias offset: the head's int8 error
    changes ~1.5% of classes at 90 dB; what optimize keeps changes at most ~1%."""
    torch.manual_seed(0)
    m = Clf(d=32, h=64, c=256, offset=30.0, log_probs=False).eval()
    cheap_int8 = Target(
        name="int8fast",
        description="a profile where int8 pays",
        kind="cpu",
        peak_flops={"float32": 1e11, "int8": 1e15},
        mem_bandwidth=1e13,
        memory_bytes=1 << 34,
        dtypes=("float32", "int8"),
    )
    r = opswap.optimize(
        m,
        (torch.randn(16, 32),),
        rules=["precision.int8_linear"],
        exactness="approx",
        target=cheap_int8,
        bench=False,
    )
    v = r.verification
    assert v.passed and v.decision_rows >= 300 and v.top1_agreement >= 0.99
    assert "head" in {b.decision.site.key for b in r.rolled_back}
    assert _true_agreement(m, r.candidate, d=32) >= 0.985


# -------------------------------------------------------------- centring, regression, exact


def test_centring_matters_only_where_an_offset_hides_the_error():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 10, generator=g)
    noise = 0.05 * torch.randn(64, 10, generator=g)  # 5% of the classes' spread

    def pair(offset):
        return (
            lambda x: {"logits": logits[: len(x)] + offset},
            lambda x: {"logits": logits[: len(x)] + offset + noise[: len(x)]},
        )

    x = (torch.randn(64, 3),)
    plain = verify(*pair(0.0), x, samples=1, tolerance="approx")
    assert not plain.passed and plain.rel_l2 > 0.03  # the plain rel_l2 already sees it
    assert plain.centred_rel_l2 == pytest.approx(plain.rel_l2, rel=0.2)
    hidden = verify(*pair(100.0), x, samples=1, tolerance="approx")
    assert hidden.rel_l2 < 1e-3 and hidden.sqnr_db > 60  # the offset hides it ...
    assert not hidden.passed  # ... from the plain metrics only
    assert hidden.centred_rel_l2 == pytest.approx(plain.centred_rel_l2, rel=1e-6)
    assert any("centred per row, rel_l2 0.05" in r for r in hidden.reasons)
    # probabilities are not centred: the sum fixes their offset
    probs = verify(torch.softmax, torch.softmax, (logits, -1), samples=1, tolerance="approx")
    assert probs.passed and probs.centred_rel_l2 is None and probs.top1_agreement == 1.0


class Regressor(nn.Module):
    """A regression model: bounded coordinates (tanh) and a layer-normed embedding."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(12, 32)
        self.box = nn.Linear(32, 6)
        self.emb = nn.Linear(32, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return torch.tanh(self.box(h)) * 100 + 300, self.norm(self.emb(h))


def test_regression_outputs_are_not_judged_by_top1():
    torch.manual_seed(0)
    m = Regressor().eval()
    x = torch.randn(8, 12)
    v = verify(m, _bf16(m), (x,), tolerance="approx", graph=fx.symbolic_trace(m))
    assert v.passed, v.reasons
    assert all(o.decisions is None for o in v.outputs)
    assert v.top1_agreement is None and v.centred_rel_l2 is None and v.decision_rows is None
    # yet bfloat16 does move their argmax: judged as class scores, they would fail
    with torch.no_grad():
        big = torch.randn(512, 12)
        moved = agreement(m(big)[0], _bf16(m)(big)[0], 1, 5e-7)
    assert Tolerance.for_exactness("approx").check_agreement(moved)
    data = json.loads(json.dumps(v.to_json()))
    assert data["top1_agreement"] is None and data["outputs"][0]["class_scores"] is None


def test_a_bare_linear_regression_head_can_opt_out_through_the_budget():
    m = _model(log_probs=False, offset=30.0)  # read as logits: a linear head
    x = torch.randn(8, 24)
    cand = _int8_logits(m)
    graph = fx.symbolic_trace(m)
    assert not verify(m, cand, (x,), tolerance="approx", graph=graph).passed
    plain_only = Tolerance.for_exactness("approx").with_budget(
        "top1>=0,top5>=0,centred_rel_l2<=inf"
    )
    v = verify(m, cand, (x,), tolerance=plain_only, graph=graph)
    assert v.passed and v.decision_rows == 24  # nothing to judge on more rows


def test_exact_level_ignores_what_its_rounding_allows():
    """Scores moved by 2e-6 of a bias offset of 50 (within the exact level's 1e-5): the
    classes' differences move by far more than 1e-5 of their own size, and some close
    classes swap, yet both are rounding at this level, not a changed decision."""
    m = _model(log_probs=False, offset=50.0)
    graph = fx.symbolic_trace(m)
    x = torch.randn(64, 24)
    g = torch.Generator().manual_seed(0)
    noise = 1e-4 * torch.randn(64, 20, generator=g)

    def cand(x):
        return m(x) + noise[: len(x)]

    v = verify(m, cand, (x,), samples=1, tolerance="exact", graph=graph)
    assert v.passed, v.reasons
    assert 1e-6 < v.rel_l2 < 1e-5 and v.centred_rel_l2 > 1e-4  # 10x the level's rel_l2
    assert v.decision_rows == 64  # the samples only: exact draws no extra rows
    # the same error on logits without the offset is a real change, and exact says so
    flat = _model(log_probs=False)
    v = verify(flat, lambda x: flat(x) + noise[: len(x)] * 50, (x,), samples=1, graph=graph)
    assert not v.passed


class ConvClf(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 12)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x))).mean((2, 3))
        return torch.log_softmax(self.fc(h), -1)


def test_exact_plan_is_unaffected():
    torch.manual_seed(0)
    m = ConvClf().eval()
    with torch.no_grad():  # running statistics that make the fold do something
        m.bn.running_mean.uniform_(-0.5, 0.5)
        m.bn.running_var.uniform_(0.5, 2.0)
    r = opswap.optimize(m, (torch.randn(4, 3, 9, 11),), exactness="exact", bench=False)
    assert r.applied and not r.rolled_back
    v = r.verification
    assert v.passed and v.outputs[0].decisions.scores.kind == "log_probs"
    assert v.top1_agreement == 1.0 and v.centred_rel_l2 < 1e-5
    assert v.decision_rows <= 4 * v.samples  # the samples' rows only (batch 1 at some)


def test_verification_json_carries_the_figures():
    m = _model()
    v = verify(m, _bf16(m), (torch.randn(4, 24),), tolerance="approx")
    data = json.loads(json.dumps(v.to_json()))
    for key in ("centred_rel_l2", "top1_agreement", "top5_agreement", "decision_rows"):
        assert isinstance(data[key], float | int)
    scores = data["outputs"][0]["class_scores"]
    assert scores["kind"] == "log_probs" and scores["top1"]["rows"] == data["decision_rows"]
    assert scores["top5"]["k"] == 5 and data["tolerance"]["top1_min"] == 0.99


# --------------------------------------------------------------------------- row samples


def test_row_samples_grow_a_dynamic_batch_and_keep_a_static_one():
    x = (torch.randn(3, 5), torch.randint(0, 9, (3, 4)))
    dyn = Dynamic([Axis("batch", ((0, 0), (1, 0)), 3, 4)])
    label, calls, draws = row_samples(x, rows=3, numel=30, needed=1000, seed=0, dynamic=dyn)
    got = list(draws)
    assert label == f"batch {DECISION_BATCH}" and calls == len(got) == math.ceil(1000 / 64)
    assert got[0][0].shape == (64, 5) and got[0][1].shape == (64, 4)
    assert not torch.equal(got[0][1][-1], got[0][1][-2])  # fresh ids, not the last row repeated
    label, calls, _ = row_samples(x, rows=3, numel=30, needed=1000, seed=0)
    assert label == "example shape" and calls == 256  # capped
    assert row_samples(x, rows=3, numel=30, needed=0, seed=0)[1] == 0
