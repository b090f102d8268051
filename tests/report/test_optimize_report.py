import re

import pytest

from opswap.models import load
from opswap.pipeline import OptimizeConfig, optimize
from opswap.report import build_report, write_reports
from opswap.report.document import Heading, Image, Table, to_html, to_markdown


@pytest.fixture(scope="module")
def result():
    m = load("zoo:bert")
    return optimize(m.module, m.example_inputs, OptimizeConfig(samples=2, compare="none"),
                    name="zoo:bert")


def test_report_sections(result):
    blocks = build_report(result)
    headings = [b.text for b in blocks if isinstance(b, Heading)]
    for h in ("Variants, timed in one run", "What changed and why", "Predicted next to measured", "Near misses",
              "Verification", "Error layer by layer", "Where the time goes (cost model)",
              "Environment"):
        assert h in headings
    changes = next(b for b in blocks if isinstance(b, Table) and "pred. bytes saved" in b.headers)
    assert len(changes.rows) == len(result.plan.decisions) > 0
    assert {img.filename for img in blocks if isinstance(img, Image)} >= {
        "latency.png", "layer_errors.png", "categories.png", "roofline.png"}


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
