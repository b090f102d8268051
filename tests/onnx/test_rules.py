"""The ONNX rules are found and ordered as the PyTorch rules are: one module per rule, the
order from each rule's phase/after/before declarations (rules/order.py)."""

from __future__ import annotations

import sys
import types

import pytest

import opswap.onnx.rules as onnx_rules
from opswap.errors import RuleError
from opswap.onnx.plan import select
from opswap.onnx.rule import OnnxRule

#: the order plans applied the rules in when it was a hand-written tuple
PLAN_ORDER = [
    "onnx.constant_fold",
    "onnx.transpose_pair",
    "onnx.conv_bn",
    "onnx.layer_norm",
    "onnx.rms_norm",
    "onnx.gelu",
    "onnx.fast_gelu",
    "onnx.attention",
    "onnx.embed_layer_norm",
    "onnx.skip_layer_norm",
    "onnx.bias_gelu",
    "onnx.matmul_bias",
]


@pytest.fixture
def fresh_rules():
    onnx_rules.onnx_rule_classes.cache_clear()
    yield
    onnx_rules.onnx_rule_classes.cache_clear()


def test_every_module_holds_one_rule_named_after_it_and_the_order_is_declared():
    classes = onnx_rules.onnx_rule_classes()
    stems = sorted(m.rpartition(".")[2] for m in onnx_rules.rule_modules())
    assert sorted(c.name for c in classes) == [f"onnx.{s}" for s in stems]
    assert [c.name for c in classes] == PLAN_ORDER
    assert [r.name for r in select(None, "lossy")] == PLAN_ORDER


def _module(name: str, cls_name: str, rule_name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)

    def pattern(self, op, x):
        return op.Relu(x)

    def rewrite(self, op, x):
        return op.Relu(x)

    body = {"name": rule_name, "pattern": pattern, "rewrite": rewrite, "__module__": name}
    body.update(attrs)
    setattr(module, cls_name, type(cls_name, (OnnxRule,), body))
    return module


def test_a_new_rule_module_is_found_and_placed_by_its_declarations(monkeypatch, fresh_rules):
    name = "opswap.onnx.rules.aa_relu_extra"
    extra = _module(name, "Extra", "onnx.aa_relu_extra", phase="late", after=("onnx.bias_gelu",))
    monkeypatch.setitem(sys.modules, name, extra)
    found = [*onnx_rules.rule_modules(), name]
    monkeypatch.setattr(onnx_rules, "rule_modules", lambda: found)
    order = [c.name for c in onnx_rules.onnx_rule_classes()]
    assert order == [*PLAN_ORDER[:-1], "onnx.aa_relu_extra", "onnx.matmul_bias"]
    assert "onnx.aa_relu_extra" in [r.name for r in select(["onnx.aa_*"])]


def test_a_rule_not_named_after_its_module_is_refused(monkeypatch, fresh_rules):
    name = "opswap.onnx.rules.zz_other"
    monkeypatch.setitem(sys.modules, name, _module(name, "Other", "onnx.something_else"))
    found = [*onnx_rules.rule_modules(), name]
    monkeypatch.setattr(onnx_rules, "rule_modules", lambda: found)
    with pytest.raises(TypeError, match="must be named 'onnx.zz_other'"):
        onnx_rules.onnx_rule_classes()


def test_conflicting_declarations_are_refused_naming_the_cycle(monkeypatch, fresh_rules):
    name = "opswap.onnx.rules.zz_loop"
    loop = _module(name, "Loop", "onnx.zz_loop", after=("onnx.gelu",), before=("onnx.layer_norm",))
    monkeypatch.setitem(sys.modules, name, loop)
    found = [*onnx_rules.rule_modules(), name]
    monkeypatch.setattr(onnx_rules, "rule_modules", lambda: found)
    with pytest.raises(RuleError, match="cycle"):
        onnx_rules.onnx_rule_classes()
