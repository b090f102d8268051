"""The registry finds every rule from the files in the family packages: one rule class per
module, named after the module, with no list to keep by hand."""

from __future__ import annotations

import importlib
import inspect

import pytest

from opswap.errors import RuleError
from opswap.rules import registry
from opswap.rules.base import PHASES, Rule


def test_every_rule_module_holds_exactly_one_rule_named_after_it():
    modules = registry.rule_modules()
    assert modules, "no rule modules found"
    for dotted in modules:
        mod = importlib.import_module(dotted)
        own = [c for _, c in inspect.getmembers(mod, inspect.isclass)
               if issubclass(c, Rule) and c.__module__ == dotted and hasattr(c, "name")]
        assert len(own) == 1, (dotted, own)
        family, stem = dotted.split(".")[-2:]
        assert own[0].name == f"{family}.{stem}", (dotted, own[0].name)
        assert own[0].family == family
        assert registry.get(own[0].name).__class__ is own[0]


def test_registry_holds_the_fourteen_rules():
    found = {r.name for r in registry.all_rules()}
    assert {m.rsplit(".", 2)[-2] + "." + m.rsplit(".", 1)[-1]
            for m in registry.rule_modules()} <= found
    assert {"fusion.conv_bn", "fusion.conv_relu", "fusion.linear_bn", "fusion.matmul_add",
            "fusion.layer_norm", "fusion.parallel_linear", "fusion.log_softmax",
            "layout.cancel_transpose", "layout.collapse_view", "layout.permute_matmul",
            "layout.drop_dropout", "layout.drop_identity", "layout.channels_last",
            "precision.int8_linear"} <= found
    assert registry.get("precision.int8_linear").exactness == "approx"


def test_every_rule_declares_a_known_phase_and_orders_against_real_rules():
    import fnmatch

    found = [r.name for r in registry.all_rules()]
    for r in registry.all_rules():
        assert r.phase in PHASES
        for pattern in (*r.after, *r.before):
            assert any(fnmatch.fnmatchcase(n, pattern) for n in found if n != r.name), (
                f"{r.name} orders itself against {pattern!r}, which names no rule")


def test_unknown_rule_names_the_command_that_lists_them():
    with pytest.raises(RuleError, match="opswap rules"):
        registry.get("fusion.nope")
