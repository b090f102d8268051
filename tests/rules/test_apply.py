"""rules/apply.py: one site at a time, undoing a rewrite that raises."""

import pytest
import torch
from torch import nn

from opswap.graph import capture, op_kind
from opswap.rules import registry
from opswap.rules.apply import apply_sites, rewrite_site
from opswap.rules.base import Found, Rule, Site


class _DropSecondRelu(Rule):
    name = "test.apply_drop_relu"
    family = "test"
    chapter = 3
    exactness = "exact"

    anchors = ("relu",)

    def check(self, gm, n):
        if isinstance(n.args[0], torch.fx.Node) and op_kind(n.args[0]) == "relu":
            return Found((n,), "drop a relu that follows a relu")
        return None

    def rewrite(self, gm, found):
        node = found.nodes[0]
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)


class _Vandal(Rule):
    """Adds a submodule and an attribute, swaps a weight and rewires the graph, then raises."""

    name = "test.apply_vandal"
    family = "test"
    chapter = 3
    exactness = "exact"

    def check(self, gm, n):
        return Found((n,), "wreck a") if n.target == "a" else None

    def rewrite(self, gm, found):
        gm.add_submodule("intruder", nn.Linear(7, 7))
        gm.a.weight = nn.Parameter(torch.zeros_like(gm.a.weight))
        gm.stray_attribute = 1
        node = next(n for n in gm.graph.nodes if n.target == "a")
        with gm.graph.inserting_after(node):
            new = gm.graph.call_module("intruder", (node,))
        node.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new)
        raise ValueError("half-way")


@pytest.fixture(autouse=True)
def toy_rules():
    for c in (_DropSecondRelu, _Vandal):
        registry.register(c)
    yield
    for c in (_DropSecondRelu, _Vandal):
        registry._RULES.pop(c.name, None)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(7, 7)

    def forward(self, x):
        return torch.relu(torch.relu(self.a(x))) + torch.relu(torch.relu(x))


def _site(c, name, key):
    return next(s for s in registry.get(name).match(c.gm) if s.key == key)


def _decision(name, key, anchor):
    return registry.get(name), Site(name, key, (key,), "", {}, anchor)


def _cap():
    torch.manual_seed(0)
    return capture(Net().eval(), (torch.randn(3, 7),))


def test_rewrite_site_applies_and_recompiles():
    c = _cap()
    rule = registry.get("test.apply_drop_relu")
    gm, err = rewrite_site(c.gm, rule, _site(c, rule.name, "relu_1").found)
    assert err is None and gm is c.gm
    assert sum(op_kind(n) == "relu" for n in gm.graph.nodes) == 3
    assert "relu_1" not in gm.code


def test_failed_rewrite_restores_graph_weights_and_modules():
    c = _cap()
    keys = set(c.gm.state_dict())
    x = torch.randn(2, 7)
    expected = c.gm(x)
    gm, err = rewrite_site(
        c.gm, registry.get("test.apply_vandal"), _site(c, "test.apply_vandal", "a").found
    )
    assert "half-way" in err and "ValueError" in err
    assert set(gm.state_dict()) == keys
    assert not hasattr(gm, "intruder") and not hasattr(gm, "stray_attribute")
    assert gm.a.weight.abs().sum() > 0
    torch.testing.assert_close(gm(x), expected)


def test_apply_sites_works_on_a_copy_and_reports_each_decision():
    c = _cap()
    before = c.gm.code
    calls = []
    out = apply_sites(
        c,
        [
            _decision("test.apply_drop_relu", "relu_1", "relu_1"),
            _decision("test.apply_vandal", "a", "a"),
            _decision("test.apply_drop_relu", "missing", "relu_1"),
        ],
        progress=lambda: calls.append(1),
    )
    assert [s.key for s in out.applied] == ["relu_1"]
    assert [f.where for f in out.failed] == ["a", "missing"]
    assert out.failed[1].reason == "site not found in this model"
    assert c.gm.code == before and len(calls) == 3
    x = torch.randn(4, 7)
    torch.testing.assert_close(out.gm(x), c.gm(x))


class _PickyDrop(_DropSecondRelu):
    """Drops a relu that follows a relu, but at relu_3 wrecks the graph half-way and raises:
    a failure in the middle of a run of one rule's sites."""

    name = "test.apply_picky_drop"

    def rewrite(self, gm, found):
        node = found.nodes[0]
        if node.name == "relu_3":
            gm.add_submodule("intruder", nn.Identity())
            with gm.graph.inserting_after(node):
                new = gm.graph.call_module("intruder", (node,))
            node.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new)
            raise ValueError("half-way")
        super().rewrite(gm, found)


class Three(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(7, 7)
        self.b = nn.Linear(7, 7)

    def forward(self, x):
        return (
            torch.relu(torch.relu(self.a(x)))
            + torch.relu(torch.relu(x))
            - torch.relu(torch.relu(self.b(x)))
        )


def test_a_failure_inside_a_run_of_one_rule_costs_only_its_site():
    """Sites of one rule share one snapshot; a failing one puts the run back and the run is
    made again site by site: the sites before and after it are applied, it is reported, and
    the result computes what the model did, its code written from the final graph."""
    registry.register(_PickyDrop)
    try:
        torch.manual_seed(0)
        c = capture(Three().eval(), (torch.randn(3, 7),))
        relus = [n.name for n in c.gm.graph.nodes if op_kind(n) == "relu"]
        assert relus == [f"relu{s}" for s in ("", "_1", "_2", "_3", "_4", "_5")]
        calls = []
        out = apply_sites(
            c,
            [_decision(_PickyDrop.name, k, k) for k in ("relu_1", "relu_3", "relu_5")],
            progress=lambda: calls.append(1),
        )
        assert [s.key for s in out.applied] == ["relu_1", "relu_5"]
        assert [f.where for f in out.failed] == ["relu_3"] and "half-way" in out.failed[0].reason
        assert len(calls) == 3
        assert not hasattr(out.gm, "intruder") and "intruder" not in out.gm.code
        assert "relu_1" not in out.gm.code and "relu_5" not in out.gm.code
        assert "relu_3" in out.gm.code
        x = torch.randn(5, 7)
        torch.testing.assert_close(out.gm(x), c.gm(x))

        from opswap.planner import make_plan

        plan = make_plan(c, rules=[_PickyDrop.name])
        assert [d.site.key for d in plan.decisions] == ["relu_1", "relu_5"]
        assert [f.where for f in plan.failed] == ["relu_3"]
    finally:
        registry._RULES.pop(_PickyDrop.name, None)


def test_shapes_after_the_last_run_only_when_asked(monkeypatch):
    """Each run of a rule's sites is followed by a shape propagation (a few forward passes
    on a large model) so that the next rule reads the new nodes' shapes; a caller that only
    runs the result (verification, bisection) skips the one after the last run, and gets
    the same graph."""
    registry.register(_PickyDrop)
    try:
        torch.manual_seed(0)
        c = capture(Three().eval(), (torch.randn(3, 7),))
        calls = []
        real = type(c).propagate
        monkeypatch.setattr(
            type(c), "propagate", lambda self, gm: calls.append(1) or real(self, gm)
        )
        picky = [_decision(_PickyDrop.name, k, k) for k in ("relu_1", "relu_5")]
        drop = [_decision(_DropSecondRelu.name, "relu_3", "relu_3")]
        registry.register(_DropSecondRelu)
        both = picky + drop
        with_shapes = apply_sites(c, both)
        assert len(calls) == 2
        calls.clear()
        without = apply_sites(c, both, shapes=False)
        assert len(calls) == 1
        assert [s.key for s in with_shapes.applied] == ["relu_1", "relu_5", "relu_3"]
        assert [s.key for s in without.applied] == [s.key for s in with_shapes.applied]
        assert without.gm.code == with_shapes.gm.code
        x = torch.randn(5, 7)
        torch.testing.assert_close(without.gm(x), c.gm(x))
    finally:
        registry._RULES.pop(_PickyDrop.name, None)
        registry._RULES.pop(_DropSecondRelu.name, None)
