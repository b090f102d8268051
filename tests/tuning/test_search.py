"""The joint search (tuning.search, stages.joint_plan): it finds the pair of rewrites
greedy's rule order misses, never takes a plan beyond the budget, keeps greedy when
nothing beats it, and its front is non-dominated. Timings are a deterministic stand-in
(each plan's seconds from its decisions) except in the one real-timer smoke test."""

from __future__ import annotations

import random

import pytest
import torch

from opswap.api import load
from opswap.config import OptimizeConfig
from opswap.errors import OpswapError
from opswap.graph import op_kind
from opswap.rules import registry
from opswap.rules.base import Estimate, Found, Rule
from opswap.stages import capture_stage, joint_plan
from opswap.tuning.search import (
    Candidate,
    Measurement,
    Point,
    SearchError,
    joint_search,
    pareto_front,
)


def _to(fn, *args):  # type: ignore[no-untyped-def]
    """A rewrite putting fn(x, *args) where the anchor ReLU was."""

    def rewrite(self, gm, found):  # type: ignore[no-untyped-def]
        node = found.nodes[0]
        with gm.graph.inserting_after(node):
            new = gm.graph.call_function(fn, (node.args[0], *args))
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)

    return rewrite


class _First(Rule):
    """Runs first, takes every ReLU; the stand-in timer makes each worth little."""

    name = "test.search_first"
    family = "test"
    chapter = 2
    exactness = "exact"
    anchors = ("relu",)

    def check(self, gm, n):  # type: ignore[no-untyped-def]
        return Found((n,), "relu as clamp")

    rewrite = _to(torch.clamp, 0.0)


class _Second(Rule):
    """Runs after, finds no ReLU left; the stand-in timer makes each worth more."""

    name = "test.search_second"
    family = "test"
    chapter = 3
    exactness = "exact"
    anchors = ("relu",)

    def check(self, gm, n):  # type: ignore[no-untyped-def]
        return Found((n,), "relu as clamp_min")

    rewrite = _to(torch.clamp_min, 0.0)


class _Lossy(Rule):
    """Claims exact, scales the ReLU by 1.01: beyond the exact budget; the fastest."""

    name = "test.search_lossy"
    family = "test"
    chapter = 1
    exactness = "exact"
    anchors = ("relu",)

    def check(self, gm, n):  # type: ignore[no-untyped-def]
        first = next(m for m in gm.graph.nodes if op_kind(m) == "relu")
        return Found((n,), "relu times 1.01") if n is first else None

    def rewrite(self, gm, found):  # type: ignore[no-untyped-def]
        node = found.nodes[0]
        with gm.graph.inserting_after(node):
            new = gm.graph.call_function(torch.mul, (node, 1.01))
        node.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new)


class _Slow(Rule):
    """Predicted slower at every site (so greedy skips it); the stand-in timer disagrees."""

    name = "test.search_slow"
    family = "test"
    chapter = 4
    exactness = "exact"
    anchors = ("relu",)

    def check(self, gm, n):  # type: ignore[no-untyped-def]
        return Found((n,), "relu as clamp, predicted slower")

    rewrite = _to(torch.clamp, 0.0, None)

    def predict(self, gm, found, target):  # type: ignore[no-untyped-def]
        return Estimate(time_saved_s=-1e-6, note="the model says so")


WORTH = {_First.name: 1.0, _Second.name: 5.0, _Lossy.name: 50.0, _Slow.name: 8.0}


def _fake_timer(gm, plan):  # type: ignore[no-untyped-def]
    """100 ms less what each decision is worth: the same every time."""
    return (100.0 - sum(WORTH[d.rule] for d in plan.decisions)) * 1e-3


@pytest.fixture(autouse=True)
def toy_rules():  # type: ignore[no-untyped-def]
    for cls in (_First, _Second, _Lossy, _Slow):
        registry.register(cls)
    yield
    for cls in (_First, _Second, _Lossy, _Slow):
        registry._RULES.pop(cls.name, None)


def _run(spec: str, rules: list[str], budget: int = 16, exactness: str = "exact", **sizes):  # type: ignore[no-untyped-def]
    m = load(spec, **sizes)
    config = OptimizeConfig(
        exactness=exactness,  # type: ignore[arg-type]
        rules=rules,
        bench=False,
        layers=False,
        search="joint",
        search_budget=budget,
        samples=1,
        dynamic="none",
        tuning_db="off",
    )
    return capture_stage(m.module, m.example_inputs, config, spec, lambda stage: None)


def _relus(run) -> int:  # type: ignore[no-untyped-def]
    return sum(op_kind(n) == "relu" for n in run.captured.gm.graph.nodes)


def test_finds_the_pair_greedy_order_misses_on_a_small_resnet():
    run = _run("zoo:resnet", [_First.name, _Second.name], budget=6, width=4, image_size=8)
    greedy = run.replan()
    assert _relus(run) >= 4 and {d.rule for d in greedy.decisions} == {_First.name}
    plan = joint_plan(run, greedy, timer=_fake_timer)
    found = plan.search
    assert found is not None and not found["kept_greedy"]
    # each accepted flip hands one relu to the better rule: 5 measured plans after greedy's
    assert found["evaluations"] == 6
    assert sum(d.rule == _Second.name for d in plan.decisions) == 5
    assert found["chosen"]["latency_ms"] == pytest.approx(100 - len(plan.decisions) - 4 * 5)
    # later plans (rollback, pruning) keep the search's choices
    assert [(d.rule, d.site.key) for d in run.replan().decisions] == [
        (d.rule, d.site.key) for d in plan.decisions
    ]


def test_with_budget_for_every_flip_it_finds_the_best_combination():
    run = _run("zoo:mobilenet", [_First.name, _Second.name], budget=8, width=4, image_size=8)
    n = _relus(run)
    plan = joint_plan(run, run.replan(), timer=_fake_timer)
    assert n >= 2 and [d.rule for d in plan.decisions] == [_Second.name] * n
    assert plan.search is not None and plan.search["chosen"]["within_budget"]


def test_a_site_predicted_slower_is_forced_when_measured_faster():
    run = _run("zoo:mobilenet", [_Slow.name], budget=4, width=4, image_size=8)
    greedy = run.replan()
    assert not greedy.decisions and all(
        s.reason.startswith("predicted slower") for s in greedy.skipped
    )
    plan = joint_plan(run, greedy, timer=_fake_timer)  # greedy: nothing to apply
    assert plan.search is not None and not plan.search["kept_greedy"]
    assert plan.decisions and all(d.rule == _Slow.name for d in plan.decisions)
    assert plan.search["chosen"]["choices"].startswith(f"+{_Slow.name}@")


def test_a_decision_beyond_the_budget_is_never_chosen():
    rules = [_Lossy.name, _First.name, _Second.name]
    run = _run("zoo:resnet", rules, budget=5, width=4, image_size=8)
    greedy = run.replan()
    assert any(d.rule == _Lossy.name for d in greedy.decisions)  # fastest, but fails
    plan = joint_plan(run, greedy, timer=_fake_timer)
    assert plan.search is not None
    assert plan.search["chosen"]["within_budget"] and not plan.search["greedy"]["within_budget"]
    assert all(d.rule != _Lossy.name for d in plan.decisions)
    assert any(not p["within_budget"] for p in plan.search["points"])


def test_nothing_faster_keeps_greedy_and_says_so():
    flat = {_First.name: 0.0, _Second.name: 0.0, _Lossy.name: 0.0}

    def timer(gm, plan):  # type: ignore[no-untyped-def]
        return 1e-3 * (1.0 - 0.001 * sum(flat[d.rule] + 1 for d in plan.decisions))

    run = _run("zoo:resnet", [_First.name, _Second.name], budget=3, width=4, image_size=8)
    greedy = run.replan()
    plan = joint_plan(run, greedy, timer=timer)
    assert plan is greedy and plan.search is not None and plan.search["kept_greedy"]
    assert any("greedy's plan is kept" in note for note in run.notes)


def test_the_front_is_non_dominated():
    rng = random.Random(3)
    pts = [
        Point(Candidate(), (), Measurement(rng.random(), rng.random(), True), None, "local")
        for _ in range(40)
    ]
    front = pareto_front(pts)
    for p in front:
        assert not any(
            q.latency_s <= p.latency_s
            and q.error <= p.error
            and (q.latency_s, q.error) != (p.latency_s, p.error)
            for q in pts
        )
    for q in pts:
        if q not in front:
            assert any(p.latency_s <= q.latency_s and p.error <= q.error for p in front)
    assert [p.latency_s for p in front] == sorted(p.latency_s for p in front)


def test_plans_that_come_out_the_same_are_measured_once():
    measured = []

    def measure(plan):  # type: ignore[no-untyped-def]
        measured.append(plan)
        return Measurement(1.0, 0.0, True)

    class _Plan:
        decisions: list = []
        skipped: list = []
        misses: list = []

    out = joint_search(lambda c: _Plan(), measure, evaluations=5)
    assert len(measured) == 1 and out.kept_greedy and out.evaluations == 1


def test_a_bad_budget_is_one_sentence():
    with pytest.raises(SearchError, match="at least 1"):
        joint_search(lambda c: None, lambda p: Measurement(1, 0, True), evaluations=0)
    with pytest.raises(OpswapError, match="search must be greedy or joint"):
        OptimizeConfig(search="random")  # type: ignore[arg-type]
    with pytest.raises(OpswapError, match="search_budget"):
        OptimizeConfig(search_budget=0)


def test_real_timer_smoke_through_optimize_into_result_json_and_the_report(tmp_path):
    import json

    from opswap.pipeline import optimize

    m = load("zoo:resnet", width=4, image_size=8, batch=1)
    config = OptimizeConfig(
        rules=[_First.name, _Second.name],
        samples=1,
        dynamic="none",
        bench=False,
        layers=False,
        search="joint",
        search_budget=3,
    )
    result = optimize(m.module, m.example_inputs, config)
    assert result.verification.passed
    result.save(tmp_path)
    found = json.loads((tmp_path / "result.json").read_text())["search"]
    assert found is not None and 1 <= found["evaluations"] <= 3
    assert all(p["latency_ms"] > 0 for p in found["points"])
    # never slower than greedy beyond the noise the search allows
    assert found["chosen"]["latency_ms"] <= found["greedy"]["latency_ms"]
    report = (tmp_path / "report.md").read_text()
    assert "## Joint search" in report and (tmp_path / "pareto_front.png").stat().st_size > 1000
    assert json.loads((tmp_path / "plan.json").read_text())["search"] == found


def test_the_api_takes_the_search_settings():
    import opswap

    m = load("zoo:resnet", width=4, image_size=8, batch=1)
    with pytest.raises(OpswapError, match="search must be greedy or joint"):
        opswap.optimize(m.module, m.example_inputs, search="annealing")


def test_the_cli_runs_the_joint_search_and_refuses_a_bad_word(tmp_path, capsys):
    import json

    from opswap.cli import main

    def cli(*args: str) -> int:
        try:
            main(list(args))
        except SystemExit as e:
            return int(e.code or 0)
        return 0

    small = ("--set", "width=4", "--set", "image_size=8", "--set", "batch=1")
    out = tmp_path / "run"
    code = cli(
        "optimize", "zoo:resnet", *small, "--rules", "fusion.*", "--samples", "1",
        "--no-bench", "--search", "joint", "--search-budget", "2", "--out", str(out),
    )  # fmt: skip
    assert code == 0
    assert "joint search: " in capsys.readouterr().out
    assert json.loads((out / "result.json").read_text())["search"]["evaluations"] <= 2
    assert cli("optimize", "zoo:resnet", *small, "--search", "random", "--out", str(out)) != 0
    assert "search must be greedy or joint" in capsys.readouterr().err


def test_the_first_moves_leave_out_the_decisions_that_took_a_node_another_rule_missed_at():
    from types import SimpleNamespace as NS

    from opswap.rules.base import Miss, Site, Skipped
    from opswap.tuning.search import _neighbours

    def decision(rule: str, key: str, nodes: tuple[str, ...]) -> NS:
        return NS(rule=rule, site=Site(rule, key, nodes, ""))

    plan = NS(
        decisions=[
            decision("fusion.conv_bn", "c1+bn1", ("c1", "bn1")),
            decision("layout.drop_dropout", "drop", ("drop",)),
            decision("fusion.conv_relu", "c2+r2", ("c2", "r2")),
        ],
        # conv.algorithm found c2 taken by the fused relu; a miss at c9 names no decision
        misses=[
            Miss("conv.algorithm", "c2", "c2 already applies a fused relu"),
            Miss("conv.algorithm", "c9", "no constant weight"),
            Miss("fusion.conv_relu", "c2", "its own site"),  # a rule never blocks itself
        ],
        skipped=[Skipped("precision.bf16", "c1", "predicted slower on cpu")],
    )
    keys = tuple((d.rule, d.site.key) for d in plan.decisions)
    point = Point(Candidate(), keys, Measurement(1.0, 0.0, True), plan, "greedy")
    moves = _neighbours(point)
    assert moves[0] == (("fusion.conv_relu", "c2+r2"), "excluded")
    assert len(moves) == len(set(moves)) == 4  # three exclusions and one forced site
    assert moves[-1] == (("precision.bf16", "c1"), "forced")


@pytest.mark.parametrize("length, kernel", [(48, 15), (70, 9)])
def test_a_long_conv_the_fused_relu_took_goes_to_the_algorithm_race(length, kernel):
    """fusion.conv_relu (earlier in the rules' order) takes the long conv + ReLU, so
    greedy never offers the conv to conv.algorithm; with a stand-in timer where the
    conv's algorithm pays more than the fused ReLU, the joint search finds it, whether
    the site race on this machine picks a variant or skips each as predicted slower."""
    run = _run(
        "zoo:longconv",
        ["fusion.conv_relu", "conv.algorithm"],
        budget=6,
        exactness="approx",
        batch=1,
        length=length,
        width=4,
        kernel=kernel,
        depth=1,
        num_classes=1,  # one score: no class-score rows for verification to draw
    )
    greedy = run.replan()
    long = "blocks_0_long"

    def at_long(plan, rule):  # type: ignore[no-untyped-def]
        return [d for d in plan.decisions if d.rule == rule and long in d.site.nodes]

    def timer(gm, plan):  # type: ignore[no-untyped-def]
        fused, algo = at_long(plan, "fusion.conv_relu"), at_long(plan, "conv.algorithm")
        return (100.0 - 1.0 * len(fused) - 5.0 * len(algo)) * 1e-3

    assert at_long(greedy, "fusion.conv_relu") and not at_long(greedy, "conv.algorithm")
    assert any(m.rule == "conv.algorithm" and m.where == long for m in greedy.misses)
    plan = joint_plan(run, greedy, timer=timer)
    assert plan.search is not None and not plan.search["kept_greedy"]
    assert at_long(plan, "conv.algorithm") and not at_long(plan, "fusion.conv_relu")
    assert plan.search["chosen"]["latency_ms"] == pytest.approx(95.0)
    assert plan.search["chosen"]["choices"].startswith(f"-fusion.conv_relu@{long}")
