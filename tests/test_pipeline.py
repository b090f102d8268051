"""The optimize flow: rollback of sites that break the budget, pruning of rules that
measure slower, and the result's contract."""

import pytest
import torch
from torch import nn

from opswap.config import OptimizeConfig
from opswap.graph import op_kind
from opswap.pipeline import optimize
from opswap.rules import registry
from opswap.rules.base import Found, Rule


class _Burn(nn.Module):
    """Identity that wastes ~100x the model's work: a rewrite no one should keep."""

    def __init__(self):
        super().__init__()
        self.register_buffer("a", torch.randn(384, 384))

    def forward(self, x):
        for _ in range(4):
            self.a @ self.a  # noqa: B018  (the waste is the point)
        return x


class _Slowdown(Rule):
    name = "test.slowdown"
    family = "test"
    chapter = 3
    exactness = "exact"

    anchors = ("relu",)

    def check(self, gm, n):
        return Found((n,), "wrap in a slow identity")

    def rewrite(self, gm, found):
        node = found.nodes[0]
        name = f"burn_{node.name}"
        gm.add_submodule(name, _Burn())
        with gm.graph.inserting_after(node):
            new = gm.graph.call_module(name, (node,))
        node.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new)


class _Wrong(Rule):
    """Claims to be exact but scales an activation: verification must catch it."""

    name = "test.wrong"
    family = "test"
    chapter = 3
    exactness = "exact"

    anchors = ("relu",)

    def check(self, gm, n):
        first = next(m for m in gm.graph.nodes if op_kind(m) == "relu")
        return Found((n,), "scale by 1.01") if n is first else None

    def rewrite(self, gm, found):
        node = found.nodes[0]
        with gm.graph.inserting_after(node):
            new = gm.graph.call_function(torch.mul, (node, 1.01))
        node.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new)


@pytest.fixture(autouse=True)
def toy_rules():
    for c in (_Slowdown, _Wrong):
        registry.register(c)
    yield
    for c in (_Slowdown, _Wrong):
        registry._RULES.pop(c.name, None)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval()


def test_rule_that_breaks_the_budget_is_rolled_back():
    m = _model()
    r = optimize(m, (torch.randn(3, 16),), OptimizeConfig(rules=["test.wrong"], bench=False))
    assert r.verification.passed
    assert not r.applied and len(r.rolled_back) == 1
    assert r.to_json()["rolled_back"][0]["rule"] == "test.wrong"


def test_rule_that_measures_slower_is_pruned():
    m = _model()
    r = optimize(
        m,
        (torch.randn(3, 16),),
        OptimizeConfig(rules=["test.slowdown"], layers=False, samples=1, compare="none"),
    )
    assert not r.applied, "the slow identity should have been dropped after measuring"
    assert any(s.rule == "test.slowdown" and "measured slower" in s.reason for s in r.plan.skipped)
    assert r.verification.passed


def test_result_json_contract():
    m = _model()
    data = optimize(m, (torch.randn(3, 16),), OptimizeConfig(bench=False)).to_json()
    for key in ("model", "target", "applied", "misses", "verification", "benchmark"):
        assert key in data
    for key in ("max_abs", "max_rel", "cosine", "sqnr_db", "passed"):
        assert key in data["verification"]


def test_rules_are_timed_one_by_one():
    m = _model()
    r = optimize(
        m,
        (torch.randn(3, 16),),
        OptimizeConfig(
            rules=["test.slowdown"], layers=False, samples=1, prune_slow=False, compare="none"
        ),
    )
    (t,) = r.rule_timings
    assert t.rule == "test.slowdown" and t.sites == 1
    assert t.without_ms < t.with_ms and not t.pays  # the slow identity costs time
    assert r.to_json()["rule_timings"][0]["pays"] is False
    assert r.applied  # kept: pruning was switched off


def test_print_of_a_result_is_a_short_summary_not_the_modules():
    m = _model()
    x = torch.randn(3, 16)
    r = optimize(m, (x,), OptimizeConfig(rules=["test.wrong"], bench=False, layers=False))
    text = repr(r)
    assert str(r) == text and "\n" not in text and len(text) < 300
    assert text.startswith("Result(model='Sequential', target='cpu'")
    assert "applied 0 of 0 decisions, 1 rolled back" in text
    assert f"verification PASSED (max_abs {r.verification.max_abs:.3g}" in text
    assert "not timed" in text and "Linear" not in text  # no module dump
    raced = optimize(
        _model(),
        (torch.randn(5, 16),),
        OptimizeConfig(layers=False, samples=1, compare="none", measure_rules=False),
    )
    best = next(v for v in raced.variants if v.name == raced.best)
    assert f"best {raced.best} {best.speedup_vs_input:.2f}x the input" in repr(raced)
    assert len(repr(raced)) < 300


@pytest.mark.parametrize(
    "settings, error, says",
    [
        (
            {"exactness": "loose"},
            "RuleError",
            "exactness must be exact, approx or lossy; got 'loose'.",
        ),
        ({"samples": 0}, "VerificationError", "samples must be at least 1"),
        ({"samples": True}, "VerificationError", "samples must be at least 1"),
        ({"samples": 2.5}, "VerificationError", "samples must be at least 1"),
        ({"budget": "cosine<=0.9"}, "VerificationError", "wrong side"),
        ({"budget": "speed>=2"}, "VerificationError", "Unknown metric 'speed'"),
        ({"compare": "compiled"}, "OpswapError", "Unknown baseline 'compiled'"),
        ({"device": "bogus"}, "OpswapError", "Unknown device 'bogus'; use cpu, cuda or cuda:N."),
    ],
)
def test_config_refuses_a_bad_setting_itself_in_one_sentence(settings, error, says):
    from opswap import errors

    with pytest.raises(getattr(errors, error)) as caught:
        OptimizeConfig(**settings)
    message = str(caught.value)
    assert says in message
    assert message.endswith(".") and "\n" not in message


def test_config_reads_rule_patterns_and_skips_the_baselines_without_timing():
    assert OptimizeConfig(rules=" fusion.*, ,layout.drop_*,").rules == ["fusion.*", "layout.drop_*"]
    assert OptimizeConfig(rules=["fusion.conv_bn,fusion.linear_bn"]).rules == [
        "fusion.conv_bn",
        "fusion.linear_bn",
    ]
    OptimizeConfig(bench=False, compare="compiled")  # no race, so no baseline to read
