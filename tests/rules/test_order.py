"""The order a plan runs rules in follows their after/before/phase declarations; ties go
by chapter then name, and conflicting declarations are a clear error."""

from __future__ import annotations

import pytest

from opswap.errors import RuleError
from opswap.planner import _ordered
from opswap.rules import registry
from opswap.rules.base import Rule
from opswap.rules.order import ordered


def rule(name: str, chapter: int = 4, **decl) -> Rule:
    """A Rule instance with the given declarations (never registered)."""
    attrs = dict(name=name, family=name.split(".")[0], chapter=chapter, exactness="exact", **decl)
    return type("R_" + name.replace(".", "_"), (Rule,), attrs)()


def names(rules) -> list[str]:
    return [r.name for r in rules]


def test_without_declarations_the_order_is_phase_chapter_name():
    rs = [
        rule("b.z", 14),
        rule("a.y", 4),
        rule("a.x", 4),
        rule("c.w", 2, phase="late"),
        rule("c.v", 30, phase="early"),
    ]
    assert names(ordered(rs)) == ["c.v", "a.x", "a.y", "b.z", "c.w"]


def test_after_and_before_move_a_rule_past_its_name():
    rs = [rule("f.a", after=("f.c",)), rule("f.b"), rule("f.c"), rule("f.d", before=("f.b",))]
    got = names(ordered(rs))
    assert got.index("f.c") < got.index("f.a")
    assert got.index("f.d") < got.index("f.b")
    assert got == ["f.c", "f.a", "f.d", "f.b"]  # otherwise as close to name order as allowed


def test_globs_name_whole_families_and_never_the_rule_itself():
    rs = [
        rule("layout.a", 14, before=("fusion.*",)),
        rule("fusion.b"),
        rule("fusion.c"),
        rule("fusion.d", after=("fusion.*",)),
    ]
    got = names(ordered(rs))
    assert got == ["layout.a", "fusion.b", "fusion.c", "fusion.d"]


def test_declarations_naming_rules_outside_the_plan_are_ignored():
    rs = [rule("f.b", after=("f.missing", "g.*")), rule("f.a")]
    assert names(ordered(rs)) == ["f.a", "f.b"]


def test_a_cycle_is_an_error_naming_its_rules():
    rs = [
        rule("f.a", after=("f.c",)),
        rule("f.b", after=("f.a",)),
        rule("f.c", after=("f.b",)),
        rule("f.d"),
    ]
    with pytest.raises(RuleError, match="cycle") as e:
        ordered(rs)
    msg = str(e.value)
    for n in ("f.a", "f.b", "f.c"):
        assert n in msg
    assert "f.d" not in msg


def test_a_declaration_against_the_phases_is_a_cycle():
    rs = [rule("f.late", phase="late", before=("f.main",)), rule("f.main")]
    with pytest.raises(RuleError, match="phase 'late'"):
        ordered(rs)


def test_an_unknown_phase_is_an_error():
    with pytest.raises(RuleError, match="phase"):
        ordered([rule("f.a", phase="soon")])


def test_the_planner_runs_the_real_rules_in_the_declared_order():
    import fnmatch

    got = names(_ordered(registry.all_rules()))

    def matching(pattern, me):
        return [n for n in got if n != me and fnmatch.fnmatchcase(n, pattern)]

    for r in registry.all_rules():
        for first in r.after:  # names or globs ("fusion.*")
            for n in matching(first, r.name):
                assert got.index(n) < got.index(r.name), (n, r.name)
        for then in r.before:
            for n in matching(then, r.name):
                assert got.index(r.name) < got.index(n), (r.name, n)
    assert got.index("fusion.parallel_linear") < got.index("precision.int8_linear")
    # the dependencies the rules' docstrings explain
    assert got.index("fusion.conv_bn") < got.index("fusion.conv_relu")
    assert got.index("fusion.matmul_add") < got.index("fusion.parallel_linear")
    assert got.index("fusion.linear_bn") < got.index("fusion.parallel_linear")
    assert got.index("layout.cancel_transpose") < got.index("layout.permute_matmul")
    assert got[-1] == "layout.channels_last"
    # and a subset keeps them too
    sub = names(_ordered([registry.get("fusion.conv_relu"), registry.get("fusion.conv_bn")]))
    assert sub == ["fusion.conv_bn", "fusion.conv_relu"]
