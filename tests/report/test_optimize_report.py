import re

import pytest

from opswap.config import OptimizeConfig
from opswap.pipeline import optimize
from opswap.report import build_report, write_reports
from opswap.report.document import Heading, Image, Table, to_html, to_markdown

pytestmark = pytest.mark.xdist_group("bert_report")  # bert_result is made once (conftest)


@pytest.fixture(scope="module")
def result(bert_result):
    return bert_result


def test_report_sections(result):
    blocks = build_report(result)
    headings = [b.text for b in blocks if isinstance(b, Heading)]
    for h in (
        "Variants, timed in one run",
        "What changed and why",
        "Predicted next to measured",
        "Near misses",
        "Verification",
        "Error layer by layer",
        "Where the time goes (cost model)",
        "Environment",
    ):
        assert h in headings
    changes = next(b for b in blocks if isinstance(b, Table) and "module: site" in b.headers)
    assert len(changes.rows) == len(result.plan.decisions) > 0
    assert {img.filename for img in blocks if isinstance(img, Image)} >= {
        "latency.png",
        "layer_errors.png",
        "categories.png",
        "roofline.png",
    }


def test_markdown_and_html_agree(result, tmp_path):
    paths = write_reports(result, tmp_path)
    md = paths["report_md"].read_text()
    html = paths["report_html"].read_text()
    for m in result.plan.misses:
        assert m.reason in md
    assert html.count("data:image/png;base64,") == len(re.findall(r"!\[", md))
    for name in ("latency.png", "layer_errors.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    assert "<script" not in html  # a static page: nothing runs when it is opened


def test_document_escapes_html():
    blocks = [Heading("a <b> & c"), Table(["x"], [["<script>alert(1)</script>"]])]
    html = to_html(blocks, "t")
    assert "<script>alert" not in html and "&lt;script&gt;" in html
    md, files = to_markdown(blocks)
    assert "a <b> & c" in md and not files


class _ConvBN(__import__("torch").nn.Module):
    def __init__(self):
        from torch import nn

        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        import torch

        return self.c2(torch.relu(self.b1(self.c1(x))))


def _small():
    import torch

    torch.manual_seed(0)
    m = _ConvBN().eval()
    m.b1.running_mean.uniform_(-1, 1)
    m.b1.running_var.uniform_(0.5, 2)
    return m, (torch.randn(2, 3, 10, 10),)


@pytest.fixture(scope="module")
def busy_result():
    """A run on a machine too busy for any interval to narrow (bench.noisy)."""
    from opswap.bench import timing
    from opswap.bench.noisy import busy

    mp = pytest.MonkeyPatch()
    mp.setattr(timing, "_Timer", busy(seed=5))
    try:
        m, x = _small()
        yield optimize(
            m,
            x,
            OptimizeConfig(samples=1, layers=False, compare="none", prune_slow=False),
            name="small",
        )
    finally:
        mp.undo()


def test_a_busy_machine_is_said_and_the_lower_end_leads(busy_result, tmp_path):
    md = write_reports(busy_result, tmp_path)["report_md"].read_text()
    assert "timings did not settle: the machine is busy" in md
    data = busy_result.to_json()
    assert data["timings_settled"] is False
    (table,) = [
        b
        for b in build_report(busy_result)
        if isinstance(b, Table) and "vs input [95%]" in b.headers
    ]
    col = table.headers.index("vs input [95%]")
    for v, row in zip(data["variants"], table.rows, strict=True):
        if v["name"] == "input" or v["ms"] is None:
            continue
        lo, hi = v["speedup_ci"]
        # the end the interval supports comes first (or "within noise"), the median after it
        lead = rf"(at least {lo:.2f}x|at most {hi:.2f}x|within noise)"
        assert re.match(rf"{lead} \[{lo:.2f}-{hi:.2f}\]", row[col]), row[col]
        assert f"median {v['speedup_vs_input']:.2f}x" in row[col]


def test_measured_over_predicted_is_shown_wherever_both_exist(busy_result):
    att = busy_result.attribution
    assert att is not None and att.rules
    (table,) = [
        b
        for b in build_report(busy_result)
        if isinstance(b, Table) and "measured / predicted" in b.headers
    ]
    col = table.headers.index("measured / predicted")
    for t, row in zip(att.rules, table.rows, strict=False):
        if t.predicted_saved_s and not getattr(t, "pruned", False):
            assert row[col] != "-" and row[col].startswith(
                f"{t.measured_saved_s / t.predicted_saved_s:.1f}x"
            ), row


def test_the_tolerance_prints_as_set(tmp_path):
    m, x = _small()
    r = optimize(
        m,
        x,
        OptimizeConfig(samples=1, layers=False, bench=False, budget="cosine>=0.9999999999"),
        name="small",
    )
    md = write_reports(r, tmp_path)["report_md"].read_text()
    assert "cosine>=0.9999999999" in md and not re.search(r"cosine>=1\b", md)


def test_the_figure_read_first_is_the_one_the_interval_supports():
    from opswap.bench.stats import describe_speedup
    from opswap.report.optimize_report import versus

    assert describe_speedup(1.40, (0.80, 2.69), False) == "within noise [0.80-2.69], median 1.40x"
    assert describe_speedup(0.7, (0.41, 0.93), False) == "at most 0.93x [0.41-0.93], median 0.70x"
    assert describe_speedup(14.48, (1.07, 38.37), False).startswith("at least 1.07x")
    assert describe_speedup(1.42, (1.37, 1.48)) == "1.42x [1.37-1.48]"
    # against another baseline: a bound from both intervals, not a bare ratio
    mine = {"name": "opswap+compile", "speedup_ci": (5.0, 7.0), "settled": False}
    peer = {"name": "compile", "speedup_ci": (0.9, 1.3), "settled": True}
    text = versus(6.0 / 1.1, mine, peer)
    assert text.startswith("at least 3.85x [3.85-7.78]"), text
    level = versus(1.1, {**mine, "speedup_ci": (1.0, 1.2)}, {**peer, "speedup_ci": (0.95, 1.1)})
    assert level.startswith("within noise"), level


def test_a_rule_with_no_measured_saving_does_not_pay():
    from types import SimpleNamespace

    from opswap.report.optimize_report import _pays

    rule = SimpleNamespace(verdict="pays", pruned=False, measured_saved_s=-5e-5, loo_saved_s=None)
    assert _pays(rule) == "within noise"
    assert _pays(SimpleNamespace(**{**vars(rule), "measured_saved_s": 2e-4})) == "yes"
    assert _pays(SimpleNamespace(**{**vars(rule), "verdict": "slower"})).startswith("**no**")
