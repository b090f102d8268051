"""The lists that name every rule (README's count, the chapters' rule tables, the run order
in docs/rule-order.txt) are generated from the registry, and stay so."""

from __future__ import annotations

import difflib
from pathlib import Path

from opswap import catalog
from opswap.rules import registry
from opswap.rules.base import Rule

ROOT = Path(__file__).resolve().parents[2]


def test_generated_rule_lists_are_up_to_date():
    stale = [str(p.relative_to(ROOT)) for p in catalog.stale(ROOT)]
    assert not stale, f"{', '.join(stale)} out of date: run `{catalog.COMMAND}`"


def test_every_family_has_a_table_and_every_rule_a_row():
    text = "".join(catalog.expected(ROOT).values())
    for rule in catalog.builtin_rules():
        assert f"| `{rule.name}` |" in text, rule.name


def test_a_moved_rule_shows_in_the_order_file(monkeypatch):
    before = catalog.order_text(catalog.builtin_rules())
    int8 = registry.get("precision.int8_linear")
    monkeypatch.setattr(type(int8), "after", ())
    monkeypatch.setattr(type(int8), "phase", "early")
    assert catalog.order_text(catalog.builtin_rules()) != before


def test_a_new_rule_is_one_added_line_of_the_order_file():
    class Early(Rule):
        name, family, chapter, exactness = "layout.aaa_extra", "layout", 4, "exact"
        phase = "early"

        def check(self, gm, node):
            return None

        def rewrite(self, gm, found):
            pass

    before = catalog.order_text(catalog.builtin_rules()).splitlines()
    after = catalog.order_text([*catalog.builtin_rules(), Early()]).splitlines()
    diff = [
        line
        for line in difflib.unified_diff(before, after, lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    assert diff == ["+layout.aaa_extra (early)"]


def test_a_new_rule_changes_the_count_and_its_family_table():
    class Extra(Rule):
        name, family, chapter, exactness = "fusion.extra", "fusion", 4, "approx"
        description = "made up for this test"

        def check(self, gm, node):
            return None

        def rewrite(self, gm, found):
            pass

    rules = [*catalog.builtin_rules(), Extra()]
    assert catalog.summary(rules) != catalog.summary(catalog.builtin_rules())
    assert "| `fusion.extra` | made up for this test | approx |" in catalog.table(rules, "fusion")
