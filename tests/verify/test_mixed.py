"""The mixed-precision debugger: per-site sensitivity, and the search for the float32 sites,
on a model with one planted sensitive layer (a Linear whose weights put its output near
float16's limit, and an input scale that int8's per-row quantisation of a spiky row breaks)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from opswap.graph.capture import capture
from opswap.targets.base import Target
from opswap.verify.mixed import debug_precision
from opswap.verify.tolerance import Tolerance

HALF_GPU = Target(
    name="half-gpu",
    description="test profile",
    kind="cuda",
    peak_flops={"float32": 1e11, "bfloat16": 1e12, "float16": 1e12},
    mem_bandwidth=1e12,
    memory_bytes=2**34,
    dtypes=("float32", "bfloat16", "float16"),
)
# int8 far faster than float32 and memory free: the roofline says int8_linear pays even on
# these tiny layers, so that the test is about accuracy alone
INT8_CPU = Target(
    name="int8-cpu",
    description="test profile",
    kind="cpu",
    peak_flops={"float32": 1e9, "int8": 1e12},
    mem_bandwidth=1e13,
    memory_bytes=2**34,
    dtypes=("float32", "int8"),
)


class Planted(nn.Module):
    """Five Linears; `loud` (the third) adds one large value, common to all its outputs
    (a weight row shared by every output, and a bias of 1e3), to a small useful part; the
    LayerNorm after it removes the common part, so that what is left is mostly the
    rounding of the large one in low precision. The others are ordinary."""

    def __init__(self, width: int = 48):
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.loud = nn.Linear(width, width)
        self.c = nn.Linear(width, width)
        self.d = nn.Linear(width, 10)
        self.norm = nn.LayerNorm(width)
        with torch.no_grad():
            self.loud.weight.normal_(0, 0.02)
            self.loud.weight.add_(torch.randn(1, width) * 30)
            self.loud.bias.fill_(1e3)

    def forward(self, x):
        h = torch.relu(self.a(x))
        h = torch.relu(self.b(h))
        h = self.norm(self.loud(h) - 1e3)  # the norm removes the common part
        h = torch.relu(self.c(h))
        return self.d(h).softmax(-1)


def test_sensitivity_table_and_the_search_keep_only_the_planted_layer_for_bf16():
    torch.manual_seed(0)
    model = Planted().eval()
    x = torch.randn(6, 48)
    out = debug_precision(
        model,
        (x,),
        rules=["precision.bf16"],
        tolerance="rel_l2<=0.01",
        samples=3,
        target=HALF_GPU,
    )
    by = {s.site: s for s in out.layers}
    assert list(by) == ["a", "b", "loud", "c", "d"], list(by)
    assert max(out.layers, key=lambda s: s.alone.rel_l2).site == "loud"
    assert (
        by["loud"].alone.rel_l2 > 0.01 > max(s.alone.rel_l2 for s in out.layers if s.site != "loud")
    )
    assert all(0 < s.alone.rel_l2 and s.alone.cosine < 1 for s in out.layers)
    assert out.everywhere.rel_l2 > 0.01
    assert [s.site for s in out.kept] == ["loud"]
    assert out.result.rel_l2 <= 0.01 and out.passed, out.verification
    assert [d.site.key for d in out.plan.decisions] == ["a", "b", "c", "d"]
    j = out.to_json()
    assert j["kept_fp32"] == ["loud"] and len(j["layers"]) == 5 and j["passed"]
    assert j["layers"][2]["kept_fp32"] and not j["layers"][0]["kept_fp32"]


def test_nothing_is_kept_when_the_scheme_meets_the_tolerance_everywhere():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    out = debug_precision(
        model, (torch.randn(4, 32),), rules=["precision.fp16"], samples=2, target=HALF_GPU
    )
    assert len(out.layers) == 2 and not out.kept and out.passed
    assert out.trials == 3  # two sites alone and the scheme everywhere: no search
    assert out.tolerance.to_json() == Tolerance.for_exactness("approx").to_json()


def test_int8_scheme_on_a_capture_keeps_the_layer_a_spiky_input_breaks():
    """Any approx rule works: int8_linear quantises each input row by its largest value, so
    a Linear reading rows with one huge entry loses the rest of the row."""

    class Spiky(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(64, 96)
            self.mid = nn.Linear(96, 96)
            self.down = nn.Linear(96, 64)
            self.register_buffer("spike", torch.zeros(96))
            self.spike[5] = 5e3

        def forward(self, x):
            h = torch.relu(self.up(x))
            h = self.mid(h + self.spike) - self.mid.weight[:, 5] * 5e3  # the spike cancelled
            return self.down(torch.relu(h))

    torch.manual_seed(2)
    model = Spiky().eval()
    x = torch.randn(4, 8, 64)
    cap = capture(model, (x,))
    out = debug_precision(
        model,
        captured=cap,
        rules=["precision.int8_linear"],
        tolerance="rel_l2<=0.05",
        samples=2,
        target=INT8_CPU,
    )
    assert [s.site for s in out.layers] == ["up", "mid", "down"]
    assert [s.site for s in out.kept] == ["mid"], [(s.site, s.alone.rel_l2) for s in out.layers]
    assert out.passed and math.isfinite(out.result.rel_l2)


def test_a_rule_pattern_that_matches_nothing_is_refused_in_one_sentence():
    from opswap.errors import RuleError

    with pytest.raises(RuleError, match="No rule matches 'precision.nope'"):
        debug_precision(nn.Linear(4, 4), (torch.randn(2, 4),), rules=["precision.nope"])


def test_the_report_holds_the_table_the_plot_and_the_json(tmp_path):
    from opswap.report.mixed_report import write_report

    torch.manual_seed(0)
    out = debug_precision(
        Planted().eval(),
        (torch.randn(6, 48),),
        rules=["precision.bf16"],
        tolerance="rel_l2<=0.01",
        samples=2,
        target=HALF_GPU,
    )
    paths = write_report(out, tmp_path)
    md = paths["report_md"].read_text()
    assert "| `loud` | loud | linear |" in md and md.count("| kept |") == 1, md
    assert (tmp_path / "sensitivity.png").read_bytes()[:4] == b"\x89PNG"
    assert "data:image/png;base64" in paths["report_html"].read_text()
    data = json.loads(paths["debug"].read_text())
    assert data["kept_fp32"] == ["loud"] and data["layers"][2]["rel_l2"] > 0.01
    assert [d["site"]["key"] for d in json.loads(paths["plan"].read_text())["decisions"]] == [
        "a",
        "b",
        "c",
        "d",
    ]


def test_the_cli_command_debugs_sites_the_speed_model_rules_out_and_agrees_with_its_check(
    tmp_path,
):
    """`opswap debug-precision` end to end on the zoo's small BERT for the H200: its GEMMs are
    too small there for bfloat16 to pay for the casts, yet precision debugging measures every
    site (it is not gated by speed), and the set it keeps in float32 passes the same
    verification that judges the result (class scores centred and by top-1), so the command
    never ends FAILED with a kept set it calls sufficient."""
    from opswap.cli import main

    out, js = tmp_path / "dp", tmp_path / "dp.json"
    args = ["debug-precision", "zoo:bert", "--target", "h200", "--samples", "1"]
    try:
        main([*args, "--out", str(out), "--json", str(js)])
    except SystemExit as e:
        assert not e.code
    data = json.loads(js.read_text())
    assert data["rules"] == ["precision.bf16"] and data["sites"] > 0
    assert data["passed"] and data["verification"]["passed"], data["verification"]["reasons"]
    assert (out / "report.md").exists()
