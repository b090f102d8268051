"""analyze(): per-op rows, totals, shares, bounds, JSON, rendering; whole-model FLOPs."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from opswap.cost import Analysis, analyze, render
from opswap.graph.capture import capture
from opswap.report.advice import advised
from opswap.targets import Target, get_target

HEAVY = ("conv", "matmul", "attention", "rnn")

# ridge point: 100 GFLOP/s / 10 GB/s = 10 FLOP per byte
FAKE = Target(
    name="fake",
    description="test target",
    kind="cpu",
    peak_flops={"float32": 100e9, "float16": 400e9},
    mem_bandwidth=10e9,
    memory_bytes=2**30,
    dtypes=("float32", "float16"),
    source="made up for tests",
)


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.block = nn.Sequential(
            nn.Conv2d(16, 16, 3, padding=1, groups=16),
            nn.Conv2d(16, 32, 1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.up = nn.ConvTranspose2d(32, 8, 2, stride=2)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        x = self.up(self.block(self.stem(x)))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.head(x)


class TinyEncoderLayer(nn.Module):
    """A pre-norm transformer layer written out so FX can trace it."""

    def __init__(self, d=32, heads=4, ff=80):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, ff)
        self.fc2 = nn.Linear(ff, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, d))
        scores = torch.matmul(x, x.transpose(1, 2)).softmax(-1)  # an explicit bmm as well
        x = x + torch.bmm(scores, x)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


def flop_counter_total(model: nn.Module, inputs: tuple) -> int:
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc, torch.no_grad():
        model(*inputs)
    return fc.get_total_flops()


def heavy_flops(a: Analysis) -> int:
    return sum(r.flops for r in a.rows if r.category in HEAVY)


@pytest.fixture(scope="module")
def cnn_analysis() -> Analysis:
    torch.manual_seed(0)
    return analyze(capture(SmallCNN().eval(), (torch.randn(2, 3, 12, 10),), method="fx"), FAKE)


# --------------------------------------------------------------------------- whole models


@pytest.mark.parametrize("method", ("fx", "export"))
@pytest.mark.parametrize(
    "make,shape",
    [(SmallCNN, (2, 3, 12, 10)), (TinyEncoderLayer, (3, 9, 32))],
    ids=["cnn", "encoder-layer"],
)
def test_model_flops_agree_with_flop_counter(make, shape, method):
    model = make().eval()
    x = torch.randn(*shape)
    a = analyze(capture(model, (x,), method=method), FAKE)
    assert a.method == method
    expected = flop_counter_total(model, (x,))
    assert expected > 0
    assert heavy_flops(a) == pytest.approx(expected, rel=0.01)


@pytest.mark.hf
def test_bert_flops_agree_with_flop_counter_via_export():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        vocab_size=97,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=40,
    )
    model = transformers.BertModel(cfg).eval()
    ids = torch.randint(0, 97, (2, 11))
    captured = capture(model, (ids,))
    assert captured.method == "export"
    a = analyze(captured, FAKE, model_name="bert-tiny")
    assert heavy_flops(a) == pytest.approx(flop_counter_total(model, (ids,)), rel=0.01)
    query = [r for r in a.rows if r.module == "encoder.layer.0.attention.self.query"]
    assert [r.op for r in query] == ["aten.linear"]
    assert query[0].flops == 2 * 2 * 11 * 32 * 32
    assert {r.category for r in a.rows} >= {"embedding", "attention", "normalization", "matmul"}


# --------------------------------------------------------------------------- rows and totals


def test_totals_are_sums_and_shares_sum_to_one(cnn_analysis):
    a = cnn_analysis
    assert a.total_flops == sum(r.flops for r in a.rows) > 0
    assert a.total_bytes == sum(r.bytes for r in a.rows) > 0
    assert a.est_time_s == pytest.approx(sum(r.est_time_s for r in a.rows))
    assert sum(r.share for r in a.rows) == pytest.approx(1.0)
    assert sum(c.share for c in a.categories.values()) == pytest.approx(1.0)
    assert sum(c.count for c in a.categories.values()) == len(a.rows)
    assert sum(c.flops for c in a.categories.values()) == a.total_flops


def test_rows_name_ops_and_modules(cnn_analysis):
    a = cnn_analysis
    conv = a.row("stem.0")
    assert (conv.op, conv.kind, conv.category) == ("Conv2d", "conv", "conv")
    assert conv.input_shapes == [(2, 3, 12, 10)] and conv.output_shapes == [(2, 16, 12, 10)]
    assert conv.flops == 2 * 2 * 16 * 12 * 10 * 3 * 9
    assert a.row("up").op == "ConvTranspose2d"


def test_bound_follows_the_ridge_point(cnn_analysis):
    ridge = FAKE.ridge_point("float32")
    assert ridge == 10
    seen = set()
    for r in cnn_analysis.rows:
        if not (r.flops or r.bytes):
            assert r.bound == "none"
            continue
        expect = "compute" if r.intensity >= ridge else "memory"
        assert r.bound == expect, r.name
        assert r.est_time_s == pytest.approx(max(r.flops / 100e9, r.bytes / 10e9))
        seen.add(r.bound)
    assert seen == {"compute", "memory"}  # the 3x3 conv is compute-bound, ReLU is not
    assert cnn_analysis.row("stem.0").bound == "compute"
    assert cnn_analysis.row("stem.2").bound == "memory"


def test_dtype_picks_the_peak():
    lin = nn.Sequential(nn.Linear(64, 64)).half()
    x = torch.randn(256, 64).half()
    a = analyze(capture(lin, (x,), method="fx"), FAKE)
    (row,) = a.rows
    assert row.dtype == "float16"
    assert row.est_time_s == pytest.approx(max(row.flops / 400e9, row.bytes / 10e9))


def test_bottleneck_sentences(cnn_analysis):
    lines = cnn_analysis.bottlenecks(3)
    assert len(lines) == 3
    top = cnn_analysis.top(3)
    pattern = re.compile(
        r"^(?P<label>\S+) \((?P<op>[^)]+)\) is (compute|memory)-bound: (?P<pct>\d+)% of the "
        r"estimated time, [\d.]+ ?\w*FLOP at [\d.]+ FLOP/byte .*; .+\.$"
    )
    for line, row in zip(lines, top, strict=True):
        m = pattern.match(line)
        assert m, line
        assert m["label"] == row.label and m["op"] == row.op
        assert int(m["pct"]) == round(row.share * 100)
    assert [r.est_time_s for r in top] == sorted((r.est_time_s for r in top), reverse=True)


def test_to_json(cnn_analysis):
    d = cnn_analysis.to_json()
    assert {
        "model",
        "target",
        "total_flops",
        "total_bytes",
        "ops",
        "categories",
        "bottlenecks",
    } <= set(d)
    assert d["model"] == "SmallCNN" and d["target"] == "fake"
    assert analyze(capture(nn.ReLU(), (torch.randn(3),)), FAKE, model_name="x").model == "x"
    for op in d["ops"]:
        assert {"name", "op", "category", "flops", "bytes", "intensity", "bound", "share"} <= set(
            op
        )
    assert sum(op["flops"] for op in d["ops"]) == d["total_flops"]
    text = json.dumps(d, allow_nan=False)  # strict JSON: no inf / nan
    assert json.loads(text)["categories"]["conv"]["count"] == 4  # 3 convs + 1 transposed


def test_render_prints_tables_and_bottlenecks(cnn_analysis):
    console = Console(record=True, width=220)
    render(cnn_analysis, console)
    out = console.export_text()
    header = next(line for line in out.splitlines() if "intensity" in line)
    for col in (
        "name",
        "op",
        "category",
        "shapes",
        "FLOPs",
        "bytes",
        "intensity",
        "bound",
        "share",
    ):
        assert col in header
    assert "stem.0" in out and "Conv2d" in out and "2x3x12x10 -> 2x16x12x10" in out
    assert "By category" in out and "Bottlenecks" in out
    assert cnn_analysis.bottlenecks(1)[0][:40] in out.replace("\n", " ")
    assert re.search(r"\d+\.\dk", out)  # human units


def test_render_top_rows():
    a = analyze(capture(SmallCNN().eval(), (torch.randn(1, 3, 8, 8),), method="fx"), FAKE)
    console = Console(record=True, width=220)
    render(a, console, top=2)
    out = console.export_text()
    assert "not shown" in out
    assert a.top(1)[0].label in out


def test_analyze_accepts_graph_module_and_target_name():
    c = capture(nn.Sequential(nn.Linear(4, 3)), (torch.randn(2, 4),), method="fx")
    a = analyze(c.gm, "h100")
    assert a.target.name == "h100"
    assert a.total_flops == 2 * 2 * 3 * 4
    with pytest.raises(TypeError):
        analyze(nn.Linear(2, 2), FAKE)


def test_free_ops_have_no_share():
    class Reshaper(nn.Module):
        def forward(self, x):
            return torch.relu(x.view(4, 6).transpose(0, 1))

    a = analyze(capture(Reshaper(), (torch.randn(24),), method="fx"), FAKE)
    free = [r for r in a.rows if r.kind in ("view", "transpose")]
    assert len(free) == 2 and all(r.share == 0 and r.bound == "none" for r in free)
    assert math.isclose(a.row("relu").share, 1.0)


def test_graph_without_shapes_is_repropagated_or_refused():
    c = capture(nn.Sequential(nn.Linear(4, 3)), (torch.randn(2, 4),), method="fx")
    for n in c.gm.graph.nodes:
        n.meta.pop("tensor_meta", None)
        n.meta.pop("val", None)
    with pytest.raises(ValueError, match="propagate"):
        analyze(c.gm, FAKE)
    assert analyze(c, FAKE).total_flops == 2 * 2 * 3 * 4  # a Captured re-runs propagation


def test_shape_arithmetic_costs_nothing():
    class UsesShape(nn.Module):
        def forward(self, x):
            return x.view(x.shape[0] * x.shape[1], -1).relu()

    a = analyze(capture(UsesShape(), (torch.randn(3, 4, 5),), method="fx"), FAKE)
    costed = [r for r in a.rows if r.flops or r.bytes]
    assert [r.kind for r in costed] == ["relu"]


def test_fx_and_export_agree_op_by_op():
    model, x = SmallCNN().eval(), torch.randn(2, 3, 12, 10)
    fx_rows = analyze(capture(model, (x,), method="fx"), FAKE).rows
    ex_rows = analyze(capture(model, (x,), method="export"), FAKE).rows
    for kind in ("conv", "conv_transpose", "batch_norm", "relu", "max_pool", "linear"):
        a = [(r.module, r.flops, r.bytes) for r in fx_rows if r.kind == kind]
        b = [(r.module, r.flops, r.bytes) for r in ex_rows if r.kind == kind]
        assert a == b and a, kind


def test_tf32_rates_fp32_matmuls_at_the_tensor_core_peak():
    lin = nn.Sequential(nn.Linear(512, 512))
    c = capture(lin, (torch.randn(512, 512),), method="fx")
    plain, tf32 = analyze(c, "h100").rows[0], analyze(c, "h100", tf32=True).rows[0]
    launch = get_target("h100").dispatch_s  # every op also pays its launch
    assert launch > 0
    assert plain.est_time_s == pytest.approx(plain.flops / 67e12 + launch)
    assert tf32.est_time_s == pytest.approx(
        max(tf32.flops / 494.5e12, tf32.bytes / 3.35e12) + launch
    )


def test_predicted_time_follows_the_ops_a_rewrite_removes():
    # merging three sibling Linears keeps their FLOPs, reads x once instead of three times
    # and trades two kernel dispatches for three views: the prediction and the whole-model
    # estimate must agree on the sign, with both counted
    from opswap.planner import apply_plan, make_plan

    class QKV(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x):
            return self.q(x) + self.k(x) * self.v(x)

    c = capture(QKV(), (torch.randn(512, 16),), method="fx")
    target = get_target("cpu")
    assert target.dispatch_s > 0  # measured with the rest of the CPU target
    plan = make_plan(c, target=target, rules=["fusion.parallel_linear"])
    (d,) = plan.decisions
    assert d.estimate.time_saved_s > 0
    before, after = analyze(c, target), analyze(apply_plan(c, plan).captured, target)
    assert before.est_time_s - after.est_time_s == pytest.approx(d.estimate.time_saved_s, rel=0.05)


# --------------------------------------------------------------------------- advice


def _advice(a: Analysis, module: str) -> str:
    """The bottleneck sentence of the row that calls nn.`module` (aten.`module` in export),
    with the rules that relieve it joined in (report.advice)."""
    lines = dict(
        zip((r.name for r in a.top(len(a.rows))), advised(a).bottlenecks(len(a.rows)), strict=True)
    )
    row = next(r for r in a.rows if r.op in (module, f"aten.{module.lower()}") and r.name in lines)
    return lines[row.name]


class _ConvAct(nn.Module):
    """A cheap conv feeding a memory-bound activation; `tap` also reads the conv output."""

    def __init__(self, act: nn.Module, tap: bool = False):
        super().__init__()
        self.conv, self.act, self.tap = nn.Conv2d(4, 4, 1), act, tap

    def forward(self, x):
        y = self.conv(x)
        return (self.act(y), y.sum()) if self.tap else self.act(y)


@pytest.mark.parametrize("method", ("fx", "export"))
@pytest.mark.parametrize("shape", [(2, 4, 33, 35), (1, 4, 17, 9)])
def test_advice_names_only_rules_whose_match_takes_the_node(method, shape):
    x = torch.randn(*shape)
    prelu = _advice(
        analyze(capture(_ConvAct(nn.PReLU()).eval(), (x,), method=method), FAKE), "PReLU"
    )
    assert "conv_relu" not in prelu and "no opswap rule does this" in prelu, prelu
    relu = _advice(analyze(capture(_ConvAct(nn.ReLU()).eval(), (x,), method=method), FAKE), "ReLU")
    assert "opswap rules that do this where they match: fusion.conv_relu" in relu, relu


@pytest.mark.parametrize("method", ("fx", "export"))
def test_advice_says_why_a_near_miss_does_not_take_the_node(method):
    model = _ConvAct(nn.ReLU(), tap=True).eval()
    a = analyze(capture(model, (torch.randn(3, 4, 21, 19),), method=method), FAKE)
    relu = _advice(a, "ReLU")
    assert "no opswap rule does this here: fusion.conv_relu does not take it" in relu, relu
    assert "also read by" in relu, relu


def test_a_saved_model_pt2_has_no_hooks_of_the_users(tmp_path):
    # torch.export's loader puts its own input checks and state handling on the module it
    # hands back as hooks; analyzing a model.pt2 must not report them as the user's
    from opswap.backends.pt2 import export_artifact
    from opswap.models import load

    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
    export_artifact(m, (torch.randn(2, 3, 8, 8),), None, tmp_path)
    loaded = load(str(tmp_path / "model.pt2"))
    a = analyze(capture(loaded.module, loaded.example_inputs), "cpu")
    assert a.rows and not [n for n in a.notes if "hook" in n], a.notes
    # a hook the user adds is still named
    loaded.module.register_forward_hook(lambda mod, args, out: None)
    a = analyze(capture(loaded.module, loaded.example_inputs), "cpu")
    assert [n for n in a.notes if "a forward hook on the model" in n], a.notes
