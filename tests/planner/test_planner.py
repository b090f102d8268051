"""Plans and their replay, with toy rules registered only for these tests."""

import json
import re

import pytest
import torch
from torch import nn

from opswap.errors import PlanError, RuleError
from opswap.graph import capture, op_kind
from opswap.planner import Plan, apply_plan, make_plan, plan_with_graph
from opswap.rules import registry
from opswap.rules.base import Estimate, Found, Refused, Rule


class _DoubleRelu(Rule):
    """relu(relu(x)) -> relu(x): the second relu is a no-op."""

    name = "test.double_relu"
    family = "test"
    chapter = 3
    exactness = "exact"

    anchors = ("relu",)

    def check(self, gm, n):
        if n.args and isinstance(n.args[0], torch.fx.Node) and op_kind(n.args[0]) == "relu":
            inner = n.args[0]
            if len(inner.users) > 1:
                return Refused(f"{inner.name} is also read elsewhere", inner)
            return Found((inner, n), "drop a relu")
        return None

    def rewrite(self, gm, found):
        outer = found.nodes[1]
        outer.replace_all_uses_with(outer.args[0])
        gm.graph.erase_node(outer)

    def predict(self, gm, found, target):
        return Estimate(bytes_saved=8.0, time_saved_s=1e-9)


class _Broken(Rule):
    """Matches every relu and raises half-way through the rewrite."""

    name = "test.broken"
    family = "test"
    chapter = 3
    exactness = "exact"

    anchors = ("relu",)

    def check(self, gm, n):
        return Found((n,), "break it")

    def rewrite(self, gm, found):
        node = found.nodes[0]
        node.replace_all_uses_with(node.args[0])  # change the graph, then fail
        raise RuntimeError("kernel exploded")


class _Slower(_DoubleRelu):
    name = "test.slower"

    def predict(self, gm, found, target):
        return Estimate(time_saved_s=-1e-6, note="an extra copy")


class _Lossy(_DoubleRelu):
    name = "test.lossy"
    exactness = "lossy"


@pytest.fixture(autouse=True)
def toy_rules():
    classes = [_DoubleRelu, _Broken, _Slower, _Lossy]
    for c in classes:
        registry.register(c)
    yield
    for c in classes:
        registry._RULES.pop(c.name, None)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(7, 7)
        self.b = nn.Linear(7, 3)

    def forward(self, x):
        y = torch.relu(torch.relu(self.a(x)))
        z = torch.relu(x)
        w = torch.relu(z)  # z is also read below: a miss
        return self.b(y + w + z)


def _cap():
    torch.manual_seed(0)
    return Net().eval(), capture(Net().eval(), (torch.randn(5, 7),))


def test_plan_finds_sites_and_misses():
    _, c = _cap()
    p = make_plan(c, rules=["test.double_relu"])
    assert [d.site.key for d in p.decisions] == ["relu+relu_1"]
    assert len(p.misses) == 1 and "also read elsewhere" in p.misses[0].reason
    assert p.decisions[0].estimate.bytes_saved == 8.0


def test_apply_replays_plan_without_touching_the_capture(tmp_path):
    _, c = _cap()
    before = [n.name for n in c.gm.graph.nodes]
    p = make_plan(c, rules="test.double_relu")
    path = p.save(tmp_path / "plan.json")
    p2 = Plan.load(path)
    out = apply_plan(c, p2)
    assert [s.key for s in out.applied] == ["relu+relu_1"] and not out.failed
    assert [n.name for n in c.gm.graph.nodes] == before
    x = torch.randn(4, 7)
    torch.testing.assert_close(out.gm(x), c.gm(x))
    assert sum(op_kind(n) == "relu" for n in out.gm.graph.nodes) == 3  # of 4


def test_raising_rule_is_rolled_back_and_reported():
    _, c = _cap()
    p = make_plan(c, rules=["test.broken"])
    assert not p.decisions
    assert len(p.failed) == 4 and all("kernel exploded" in f.reason for f in p.failed)
    # force the decision into a plan: apply must leave the graph as it was
    p.decisions = make_plan(c, rules=["test.double_relu"]).decisions
    p.decisions[0].rule = "test.broken"
    p.decisions[0].site = p.decisions[0].site.__class__("test.broken", "relu", ("relu",), "x")
    out = apply_plan(c, p)
    assert not out.applied and "kernel exploded" in out.failed[0].reason
    x = torch.randn(3, 7)
    torch.testing.assert_close(out.gm(x), c.gm(x))


def test_missing_site_is_reported_not_guessed():
    _, c = _cap()
    p = make_plan(c, rules=["test.double_relu"])
    p.decisions[0].site = p.decisions[0].site.__class__("test.double_relu", "nope+nada", (), "")
    out = apply_plan(c, p)
    assert not out.applied and out.failed[0].reason == "site not found in this model"


def test_predicted_slower_is_skipped_with_reason():
    _, c = _cap()
    p = make_plan(c, rules=["test.slower"])
    assert not p.decisions
    assert "predicted slower" in p.skipped[0].reason and "extra copy" in p.skipped[0].reason


def test_exactness_filters_rules():
    _, c = _cap()
    with pytest.raises(RuleError, match="selects only lossy rules.*--exactness lossy"):
        make_plan(c, rules=["test.lossy"], exactness="exact")
    with pytest.raises(RuleError, match="No rule matches"):
        make_plan(c, rules=["test.no_such_rule"], exactness="lossy")
    assert make_plan(c, rules=["test.lossy"], exactness="lossy").decisions


def test_plan_json_round_trip_and_errors(tmp_path):
    _, c = _cap()
    p = make_plan(c, rules=["test.double_relu"])
    data = json.loads(json.dumps(p.to_json()))
    q = Plan.from_json(data)
    assert q.to_json() == p.to_json()
    with pytest.raises(PlanError, match="decision 0: rule must be a string, but it is missing"):
        Plan.from_json({"decisions": [{"site": {}}]})
    with pytest.raises(PlanError, match="No plan file"):
        Plan.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.load(bad)
    with pytest.raises(PlanError, match="version"):
        Plan.from_json({**data, "version": 99})


def _edited(**changes):
    """A valid plan's JSON with hand edits: {"decisions.0.site.key": 7} sets that field."""
    _, c = _cap()
    data = json.loads(json.dumps(make_plan(c, rules=["test.double_relu"]).to_json()))
    for path, value in changes.items():
        *outer, last = (int(k) if k.isdigit() else k for k in path.split("."))
        obj = data
        for key in outer:
            obj = obj[key]
        obj[last] = value
    return data


@pytest.mark.parametrize(
    "changes, says",
    [
        (
            {"settings.exactness": "bogus"},
            'settings.exactness must be one of exact, approx, lossy, got "bogus"',
        ),
        ({"decisions.0.site.data": [1, 2]}, "decision 0: site data must be an object, got a list"),
        ({"decisions": {"0": "x"}}, "decisions must be a list, got an object"),
        ({"decisions": None}, "decisions must be a list, got null"),
        ({"version": "1"}, 'version must be an integer, got "1"'),
        ({"settings.target": 3}, "settings.target must be a string, got 3"),
        ({"settings.rules": "fusion.*"}, "settings.rules must be a list of strings"),
        ({"decisions.0": "test.double_relu"}, "decision 0 must be an object"),
        ({"decisions.0.rule": None}, "decision 0: rule must be a string, got null"),
        ({"decisions.0.site": "relu"}, "decision 0: site must be an object"),
        ({"decisions.0.site.key": 7}, "decision 0: site key must be a string, got 7"),
        (
            {"decisions.0.site.nodes": ["relu", 1]},
            "decision 0: site nodes must be a list of strings",
        ),
        ({"decisions.0.site.description": {}}, "decision 0: site description must be a string"),
        ({"decisions.0.estimate": []}, "decision 0: estimate must be an object, got a list"),
        ({"decisions.0.estimate.flops_saved": "lots"}, "flops_saved must be a number"),
        ({"decisions.0.estimate.bytes_saved": True}, "bytes_saved must be a number, got true"),
        ({"decisions.0.estimate.time_saved_s": "1ms"}, "time_saved_s must be a number or null"),
    ],
)
def test_hand_edited_plan_names_the_bad_field(tmp_path, changes, says):
    data = _edited(**changes)
    with pytest.raises(PlanError, match=re.escape(says)) as info:
        Plan.from_json(data)
    assert str(info.value).endswith("regenerate the plan with `opswap plan`.")
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(
        PlanError, match=re.escape(f"{path}: ")
    ):  # Plan.load: same check, with the file
        Plan.load(path)


def test_a_later_decision_is_named_by_its_index():
    data = _edited()
    data["decisions"] = [
        data["decisions"][0],
        {**data["decisions"][0], "site": {**data["decisions"][0]["site"], "data": "conv"}},
    ]
    with pytest.raises(PlanError, match='decision 1: site data must be an object, got "conv"'):
        Plan.from_json(data)


# a plan.json as opswap wrote it before misses, failures and skips shared one record
_OLD_PLAN = {
    "version": 1,
    "model": "m",
    "capture_method": "fx",
    "fingerprint": "",
    "settings": {"target": "cpu", "rules": [], "exactness": "exact"},
    "decisions": [
        {
            "rule": "test.double_relu",
            "site": {
                "rule": "test.double_relu",
                "key": "relu+relu_1",
                "nodes": ["relu", "relu_1"],
                "description": "drop a relu",
                "data": {},
            },
            "estimate": {"flops_saved": 0.0, "bytes_saved": 0.0, "time_saved_s": None, "note": ""},
            "module": "",
        }
    ],
    "misses": [{"rule": "test.double_relu", "where": "relu_2", "reason": "read elsewhere"}],
    "failed": [{"rule": "test.raises", "key": "relu_3", "reason": "kernel exploded"}],
    "skipped": [
        {"rule": "test.slower", "key": "relu_4", "reason": "predicted slower on cpu"},
        {
            "rule": "fusion.conv_relu",
            "key": "all 2 sites",
            "reason": "measured slower on cpu: 1.000 ms with it, 0.900 ms without",
        },
    ],
    "notes": [],
}


def test_a_plan_json_of_the_earlier_shape_loads_and_is_written_alike(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_OLD_PLAN))
    p = Plan.load(path)
    assert [(m.kind, m.rule, m.where) for m in p.misses] == [("miss", "test.double_relu", "relu_2")]
    assert [(f.kind, f.where, f.reason) for f in p.failed] == [
        ("failure", "relu_3", "kernel exploded")
    ]
    assert [(s.kind, s.rule, s.where) for s in p.skipped] == [
        ("skipped", "test.slower", "relu_4"),
        ("skipped", "fusion.conv_relu", "all 2 sites"),
    ]
    assert p.to_json() == _OLD_PLAN  # the same file back, key for key
    bad = {**_OLD_PLAN, "skipped": [{"rule": "test.slower", "reason": "no key"}]}
    with pytest.raises(PlanError, match="malformed"):
        Plan.from_json(bad)


def test_optional_fields_may_be_absent():
    p = Plan.from_json(
        {"decisions": [{"rule": "test.double_relu", "site": {"key": "relu+relu_1"}}]}
    )
    assert p.settings.exactness == "exact" and p.decisions[0].site.nodes == ()
    assert p.decisions[0].estimate.time_saved_s is None


def test_unknown_rule_name():
    with pytest.raises(RuleError, match="No rule named"):
        registry.get("fusion.nonexistent")


def test_a_plan_made_for_another_model_is_refused_in_one_sentence(tmp_path):
    import pytest

    from opswap.errors import PlanError
    from opswap.graph.capture import capture
    from opswap.models import load
    from opswap.planner import Plan, apply_plan, make_plan

    cnn, other = load("zoo:resnet"), load("zoo:mobilenet")
    plan = make_plan(capture(cnn.module, cnn.example_inputs), model_name="zoo:resnet")
    assert plan.fingerprint and plan.decisions
    path = plan.save(tmp_path / "plan.json")
    again = Plan.load(path)
    assert again.fingerprint == plan.fingerprint
    with pytest.raises(PlanError, match="made for zoo:resnet") as e:
        apply_plan(capture(other.module, other.example_inputs), again)
    assert "\n" not in str(e.value)
    # the same model at another batch size: the plan still applies
    bigger = load("zoo:resnet", {"batch": "3"})
    applied = apply_plan(capture(bigger.module, bigger.example_inputs), again)
    assert len(applied.applied) == len(plan.decisions) and not applied.failed


def test_looser_exactness_without_rules_says_so(monkeypatch):
    import opswap.planner as plan_mod
    from opswap.graph.capture import capture
    from opswap.models import load
    from opswap.planner import make_plan
    from opswap.rules import registry as reg

    m = load("zoo:resnet")
    c = capture(m.module, m.example_inputs)
    exact, approx = make_plan(c, exactness="exact"), make_plan(c, exactness="approx")
    # an exact plan names the looser rules it left out and the flag that adds them
    assert any(
        "precision.int8_linear" in n and "--exactness approx plans them" in n for n in exact.notes
    ), exact.notes
    assert not any("no approx rules" in n for n in approx.notes)
    # with only exact rules installed, a looser setting says it plans only those
    exact_only = [r for r in reg.all_rules() if r.exactness == "exact"]
    monkeypatch.setattr(plan_mod.registry, "all_rules", lambda: exact_only)
    assert plan_mod._missing_classes("approx") == [
        "no approx rules are installed, so --exactness approx plans only the exact rules"
    ]
    assert plan_mod._missing_classes("lossy") == [
        "no approx rules are installed, so --exactness lossy plans only the exact rules",
        "no lossy rules are installed, so --exactness lossy plans only the exact rules",
    ]


def test_bottleneck_advice_names_only_installed_rules():
    from opswap.cost.analyze import analyze
    from opswap.graph.capture import capture
    from opswap.models import load
    from opswap.report.advice import advised
    from opswap.rules import registry
    from opswap.targets import get_target

    installed = {r.name for r in registry.all_rules()}
    for spec in ("zoo:resnet", "zoo:bert"):
        m = load(spec)
        a = advised(analyze(capture(m.module, m.example_inputs), get_target("cpu")))
        for sentence in a.bottlenecks(8):
            assert "no opswap rule does this" in sentence or "opswap rules that do" in sentence
            if "opswap rules that do" in sentence:
                named = sentence.split("where they match: ")[1].rstrip(".").split(", ")
                assert {n.split(" (")[0] for n in named} <= installed


def test_bottleneck_advice_names_the_int8_rule_where_it_runs_and_how_to_plan_it():
    from opswap.report.advice import RuleAdvice

    class Row:  # the two fields the advice reads
        bound, category = "compute", "matmul"

    from opswap.targets import get_target

    cpu = RuleAdvice()(Row(), get_target("cpu"))
    assert "precision.int8_linear (approx: plan it with --exactness approx)" in cpu
    gpu = RuleAdvice()(Row(), get_target("h200"))
    # int8_linear is for CPUs; on the H200 the half-precision rules relieve a compute-bound GEMM
    assert "int8_linear" not in gpu and "precision.bf16 (approx" in gpu


def test_sites_of_an_exported_model_are_named_by_module_path():
    from opswap.graph.capture import capture
    from opswap.models import load
    from opswap.planner import Plan, make_plan

    m = load("hf:bert")
    c = capture(m.module, m.example_inputs)
    plan = make_plan(c, rules=["fusion.parallel_linear"])
    assert c.method == "export" and plan.decisions
    modules = [d.module for d in plan.decisions]
    assert modules[0] == "model.encoder.layer.0.attention.self", modules
    again = Plan.from_json(plan.to_json())
    assert [d.module for d in again.decisions] == modules


def test_a_decision_looser_than_the_plans_exactness_is_refused_unless_allowed(tmp_path):
    model = Net().eval()
    c = capture(model, (torch.randn(5, 7),))
    lossy = make_plan(c, rules=["test.lossy"], exactness="lossy")
    assert lossy.decisions
    data = lossy.to_json()
    data["settings"]["exactness"] = "approx"  # a hand edit: the plan now says approx
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    edited = Plan.load(path)
    with pytest.raises(PlanError) as info:
        apply_plan(c, edited)
    msg = str(info.value)
    assert "test.lossy" in msg and "lossy" in msg and "exactness approx" in msg
    assert "--allow-looser" in msg and "allow_looser=True" in msg and "\n" not in msg
    out = apply_plan(c, edited, allow_looser=True)
    assert [s.key for s in out.applied] == [d.site.key for d in lossy.decisions]
    for x in (torch.randn(1, 7), torch.randn(6, 7)):  # the user's module, at other batches
        torch.testing.assert_close(out.gm(x), model(x))
    assert apply_plan(c, lossy).applied  # as loose as the plan says: no flag needed


def test_api_apply_takes_the_same_flag(tmp_path):
    import opswap

    model = Net().eval()
    x = torch.randn(5, 7)
    data = make_plan(capture(model, (x,)), rules=["test.lossy"], exactness="lossy").to_json()
    data["settings"]["exactness"] = "exact"
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match="allow_looser=True"):
        opswap.apply(model, (x,), str(path))
    out = opswap.apply(model, (x,), str(path), allow_looser=True)
    y = torch.randn(2, 7)
    torch.testing.assert_close(out(y), model(y))


class _Mixed(nn.Module):
    """Conv+BN (a buffer-holding module to fold), in-place ops, a dropout and a double
    relu: real rules of several families have sites here."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        y = self.bn(self.conv(x))
        y.relu_()
        y = torch.relu(torch.relu(y))
        y = self.drop(y).mean((2, 3))
        y.mul_(2.0)
        return self.fc(y)


@pytest.mark.parametrize("rules", [None, ["test.broken", "test.double_relu", "layout.*"]])
def test_the_graph_planning_made_is_the_one_apply_makes(rules):
    """leave-one-out times plan_with_graph's graph instead of applying the plan again: it
    must be the graph apply_plan makes (same code, same answers at another batch size),
    with a rule that fails half-way through its rewrites in the mix."""
    torch.manual_seed(0)
    m = _Mixed().eval()
    with torch.no_grad():
        m.bn.running_mean.uniform_(-1, 1)
        m.bn.running_var.uniform_(0.5, 2)
    c = capture(m, (torch.randn(2, 3, 9, 9),))
    before = c.gm.code
    plan, gm = plan_with_graph(c, rules=rules, exactness="approx")
    assert plan.decisions  # something was rewritten
    applied = apply_plan(c, plan)
    gm.recompile()  # planning leaves the code unwritten; the caller writes it
    assert gm.code == applied.gm.code
    assert c.gm.code == before  # the capture is left as it was
    x = torch.randn(5, 3, 11, 7)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), applied.gm(x), rtol=0, atol=0)
        torch.testing.assert_close(gm(x), m(x))
    assert [d.site.key for d in make_plan(c, rules=rules, exactness="approx").decisions] == [
        d.site.key for d in plan.decisions
    ]
