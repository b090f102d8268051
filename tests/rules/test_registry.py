"""The registry finds every rule from the files in the family packages: one rule class per
module, named after the module, with no list to keep by hand."""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from opswap.errors import RuleError
from opswap.rules import registry
from opswap.rules.base import PHASES, Rule


def test_every_rule_module_holds_exactly_one_rule_named_after_it():
    modules = registry.rule_modules()
    assert modules, "no rule modules found"
    for dotted in modules:
        mod = importlib.import_module(dotted)
        own = [
            c
            for _, c in inspect.getmembers(mod, inspect.isclass)
            if issubclass(c, Rule) and c.__module__ == dotted and hasattr(c, "name")
        ]
        assert len(own) == 1, (dotted, own)
        family, stem = dotted.split(".")[-2:]
        assert own[0].name == f"{family}.{stem}", (dotted, own[0].name)
        assert own[0].family == family
        assert registry.get(own[0].name).__class__ is own[0]


def test_registry_holds_one_rule_per_module_of_every_family():
    found = {r.name for r in registry.all_rules()}
    modules = {m.rsplit(".", 2)[-2] + "." + m.rsplit(".", 1)[-1] for m in registry.rule_modules()}
    assert modules <= found and len(modules) >= 15
    assert {"fusion", "layout", "precision"} <= {m.split(".")[0] for m in modules}
    assert registry.get("precision.int8_linear").exactness == "approx"


def test_every_rule_declares_a_known_phase_and_orders_against_real_rules():
    import fnmatch

    found = [r.name for r in registry.all_rules()]
    for r in registry.all_rules():
        assert r.phase in PHASES
        for pattern in (*r.after, *r.before):
            assert any(fnmatch.fnmatchcase(n, pattern) for n in found if n != r.name), (
                f"{r.name} orders itself against {pattern!r}, which names no rule"
            )


def test_unknown_rule_names_the_command_that_lists_them():
    with pytest.raises(RuleError, match="opswap rules"):
        registry.get("fusion.nope")


# --------------------------------------------------------------------------- rules from elsewhere

EXAMPLE_PACKAGE = Path(__file__).resolve().parents[2] / "examples" / "my_rules"


@pytest.fixture
def fresh_registry(monkeypatch):
    """The registry with the built-in rules only, restored afterwards with the modules the
    test imported, so no plugin rule leaks into other tests."""
    registry.all_rules()
    for attr in ("_RULES", "_ORIGINS"):
        monkeypatch.setattr(registry, attr, dict(getattr(registry, attr)))
    monkeypatch.setattr(registry, "_PROBLEMS", [])
    monkeypatch.setattr(registry, "_plugins_loaded", False)
    modules = set(sys.modules)
    yield registry
    # forget the plugin modules the test imported, not the libraries it happened to pull
    # in (a torch submodule imported twice registers its ops twice and breaks torch.export)
    for name in set(sys.modules) - modules:
        where = getattr(sys.modules[name], "__file__", None) or ""
        if not where.startswith(sys.prefix) and not name.startswith("torch"):
            del sys.modules[name]


def _install(tmp_path, monkeypatch, entry_points: dict[str, str], dist="opswap-test-rules"):
    """A dist-info on sys.path declaring `entry_points` in the opswap.rules group: what pip
    leaves behind for an installed package, without installing anything."""
    info = tmp_path / f"{dist.replace('-', '_')}-0.3.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.3.0\n")
    lines = "".join(f"{k} = {v}\n" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[{registry.ENTRY_POINT_GROUP}]\n{lines}")
    monkeypatch.syspath_prepend(str(tmp_path))


_RULE_SOURCE = """
from opswap.rules import Rule, register


@register
class {cls}(Rule):
    name = "{name}"
    family = "mine"
    chapter = 9
    exactness = "{exactness}"

    def check(self, gm, node):
        return None

    def rewrite(self, gm, found):
        pass
"""


def _rule_module(folder, module: str, *rules: tuple[str, str]) -> None:
    """A module of the user's holding one rule class per (name, exactness)."""
    (folder / f"{module}.py").write_text(
        "".join(
            _RULE_SOURCE.format(cls=f"R{i}", name=name, exactness=ex)
            for i, (name, ex) in enumerate(rules)
        )
    )


class _HardSwish(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        return y * torch.nn.functional.relu6(y + 3) / 6


def test_an_installed_plugin_adds_its_rules_with_their_origin(
    fresh_registry, tmp_path, monkeypatch
):
    from opswap.graph.capture import capture
    from opswap.planner import apply_plan, make_plan

    _install(tmp_path, monkeypatch, {"hardswish": "my_rules.hardswish"}, dist="opswap-my-rules")
    monkeypatch.syspath_prepend(str(EXAMPLE_PACKAGE))
    names = [r.name for r in registry.all_rules()]
    assert "my_rules.hardswish" in names and set(names) > {"fusion.conv_bn", "fusion.conv_relu"}
    assert registry.origin("my_rules.hardswish") == "entry point hardswish of opswap-my-rules 0.3.0"
    assert registry.origin("fusion.conv_bn") == "opswap" and registry.problems() == []
    # planned like a built-in rule (default: every rule), against the user's module
    model, x = _HardSwish().eval(), torch.randn(2, 3, 9, 7)
    captured = capture(model, (x,))
    plan = make_plan(captured)
    assert [d.rule for d in plan.decisions].count("my_rules.hardswish") == 1
    out = apply_plan(captured, plan).gm
    for xs in (x, torch.randn(1, 3, 9, 7), torch.randn(4, 3, 12, 5)):
        with torch.no_grad():
            torch.testing.assert_close(out(xs), model(xs), rtol=1e-5, atol=1e-6)


def test_a_broken_plugin_is_one_sentence_and_leaves_the_other_rules(
    fresh_registry, tmp_path, monkeypatch
):
    builtin = set(registry._RULES)  # all_rules() now would look for plugins before _install
    _rule_module(tmp_path, "plugin_bad_class", ("mine.maybe", "sometimes"))
    # the first rule is valid, the second is not: the whole plugin stays out
    _rule_module(tmp_path, "plugin_half", ("mine.good", "exact"), ("mine.bad", "often"))
    _rule_module(tmp_path, "plugin_ok", ("mine.fine", "exact"))
    (tmp_path / "plugin_empty.py").write_text("X = 1\n")
    _install(
        tmp_path,
        monkeypatch,
        {
            "gone": "plugin_missing_xyz",
            "bad": "plugin_bad_class",
            "half": "plugin_half",
            "empty": "plugin_empty",
            "ok": "plugin_ok",
        },
    )
    names = {r.name for r in registry.all_rules()}
    assert names == builtin | {"mine.fine"}
    problems = registry.problems()
    assert len(problems) == 4, problems
    for p in problems:
        assert "\n" not in p and "Traceback" not in p and p.startswith("The rule plugin ")
        assert "opswap-test-rules 0.3.0" in p
    text = " | ".join(problems)
    assert "gone (plugin_missing_xyz" in text and "ModuleNotFoundError" in text
    assert "bad (plugin_bad_class" in text and "exactness must be exact, approx or lossy" in text
    assert "half (plugin_half" in text and "mine.bad" in text
    assert "empty (plugin_empty" in text and "registers no rule" in text
    assert registry.origin("mine.fine") == "entry point ok of opswap-test-rules 0.3.0"


def test_a_module_named_by_the_user_loads_its_rules(fresh_registry, tmp_path, monkeypatch):
    _rule_module(tmp_path, "my_user_rules", ("mine.one", "exact"), ("mine.two", "approx"))
    monkeypatch.chdir(tmp_path)  # the current directory, as for `opswap ... --rules-from`
    assert str(tmp_path) not in sys.path
    rules = registry.load_module("my_user_rules")
    assert [r.name for r in rules] == ["mine.one", "mine.two"]
    assert str(tmp_path) not in sys.path
    assert registry.origin("mine.two") == "module my_user_rules"
    assert registry.get("mine.one") is rules[0]
    assert [r.name for r in registry.load_module("my_user_rules")] == ["mine.one", "mine.two"]
    # a file path works too
    _rule_module(tmp_path, "other_rules", ("mine.three", "exact"))
    assert [r.name for r in registry.load_module(str(tmp_path / "other_rules.py"))] == [
        "mine.three"
    ]


def test_a_module_that_cannot_load_is_one_sentence(fresh_registry, tmp_path, monkeypatch):
    builtin = {r.name for r in registry.all_rules()}
    monkeypatch.chdir(tmp_path)
    (tmp_path / "raises_rules.py").write_text("import no_such_dependency_xyz\n")
    (tmp_path / "no_rules.py").write_text("X = 1\n")
    _rule_module(tmp_path, "half_rules", ("mine.good", "exact"), ("fusion.conv_bn", "exact"))
    for module, words in (
        ("missing_rules_xyz", "no module named 'missing_rules_xyz'"),
        ("raises_rules", "ModuleNotFoundError"),
        ("no_rules", "registers no rule"),
        ("half_rules", "two rules are named 'fusion.conv_bn'"),
        ("nowhere.py", "no such file"),
    ):
        with pytest.raises(RuleError, match=re.escape(words)) as e:
            registry.load_module(module)
        assert "\n" not in str(e.value) and module in str(e.value)
    assert {r.name for r in registry.all_rules()} == builtin


def test_register_refuses_what_is_not_a_rule():
    class NotARule:
        name, family, chapter, exactness = "mine.x", "mine", 9, "exact"

    class NoCheck(Rule):
        name, family, chapter, exactness = "mine.y", "mine", 9, "exact"

    class OldShape(Rule):
        name, family, chapter, exactness = "mine.z", "mine", 9, "exact"

        def match(self, gm):
            return []

        def rewrite(self, gm, site):
            pass

    with pytest.raises(TypeError, match="subclass of opswap.rules.Rule"):
        registry.register(NotARule)
    with pytest.raises(TypeError, match=r"does not define check\(\)"):
        registry.register(NoCheck)
    with pytest.raises(TypeError, match=r"define check\(gm, node\) and rewrite\(gm, found\)"):
        registry.register(OldShape)
    assert not {"mine.y", "mine.z"} & {r.name for r in registry.all_rules()}


def test_an_unknown_rule_says_how_to_load_a_users_own():
    with pytest.raises(RuleError, match="--rules-from MODULE"):
        registry.get("mine.nope")


def test_a_users_rule_named_like_a_built_in_one_is_refused_before_the_built_ins_load(tmp_path):
    # in a fresh process: the user's module is imported before anything asked the registry
    _rule_module(tmp_path, "clash_rules", ("fusion.conv_bn", "exact"))
    code = (
        "import opswap.rules.registry as r\n"
        "try:\n    import clash_rules\nexcept TypeError as e:\n    print('refused:', e)\n"
        "print(type(r.get('fusion.conv_bn')).__module__, len(r.all_rules()))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    refused, owner = out.stdout.splitlines()
    assert "two rules are named 'fusion.conv_bn'" in refused
    assert owner == f"opswap.rules.fusion.conv_bn {len(registry.all_rules())}"


def test_a_module_executed_again_replaces_its_own_rules(fresh_registry, tmp_path, monkeypatch):
    # a file.py:function spec is executed on every load; its rules are the same rules
    _rule_module(tmp_path, "again_rules", ("mine.again", "exact"))
    monkeypatch.chdir(tmp_path)
    (first,) = registry.load_module("again_rules")
    monkeypatch.syspath_prepend(str(tmp_path))  # where reload() finds it again
    module = importlib.reload(sys.modules["again_rules"])
    assert registry.get("mine.again").__class__ is module.R0 is not type(first)


@pytest.mark.parametrize(
    "given, patterns",
    [
        (None, ()),
        ("", ()),
        (" , ,", ()),
        ([], ()),
        ("fusion.*", ("fusion.*",)),
        (" fusion.* ,layout.drop_*, ", ("fusion.*", "layout.drop_*")),
        ("fusion.conv_bn,,layout.*", ("fusion.conv_bn", "layout.*")),
        (["fusion.*", " layout.drop_dropout "], ("fusion.*", "layout.drop_dropout")),
        (["fusion.conv_bn,fusion.linear_bn", ""], ("fusion.conv_bn", "fusion.linear_bn")),
        (("precision.?nt8_*",), ("precision.?nt8_*",)),
    ],
)
def test_parse_patterns_strips_spaces_drops_empty_items_and_keeps_globs(given, patterns):
    assert registry.parse_patterns(given) == patterns


def test_select_takes_a_string_or_a_list_of_patterns_alike():
    names = {r.name for r in registry.select(" fusion.conv_bn , layout.drop_*")}
    assert names == {r.name for r in registry.select(["fusion.conv_bn", "layout.drop_*"])}
    assert "fusion.conv_bn" in names and all(
        n == "fusion.conv_bn" or n.startswith("layout.drop_") for n in names
    )


def test_renamed_rules_answer_to_their_old_names_in_lookups_globs_and_declarations():
    from opswap.rules.order import ordered

    for old, new in registry.RENAMED.items():
        assert registry.get(old) is registry.get(new), old
        assert not new.endswith("_triton") and registry.get(new).implementation == "triton"
    assert {r.name for r in registry.select("norm.*_triton", "lossy")} == {
        "norm.add_rms_norm",
        "norm.group_norm",
        "norm.layer_norm",
        "norm.rms_norm",
    }
    assert [r.name for r in registry.select(["fusion.rope_triton"], "lossy")] == ["fusion.rope"]

    class Later(Rule):  # a plugin written against the old names still orders against them
        name, family, chapter, exactness = "norm.aa_later", "norm", 1, "exact"
        after = ("norm.rms_norm_triton",)

    chosen = [registry.get("norm.rms_norm"), Later()]
    assert [r.name for r in ordered(chosen)] == ["norm.rms_norm", "norm.aa_later"]


def test_a_plan_saved_with_old_rule_names_loads_and_applies(tmp_path):
    """plan.json written before the Triton rules lost their suffix: its decisions and its
    --rules patterns name `norm.layer_norm_triton`; it loads under the new name and
    applies the same rewrite."""
    import json

    from opswap.graph.capture import capture
    from opswap.planner import Plan, apply_plan, make_plan

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 24), nn.LayerNorm(24)).eval()
    x = torch.randn(5, 24)
    cap = capture(model, (x,), method="fx")
    plan = make_plan(cap, rules=["norm.layer_norm"], target="h200")
    assert [d.rule for d in plan.decisions] == ["norm.layer_norm"]
    text = json.dumps(plan.to_json()).replace('"norm.layer_norm"', '"norm.layer_norm_triton"')
    assert '"norm.layer_norm"' not in text
    (tmp_path / "plan.json").write_text(text)
    old = Plan.load(tmp_path / "plan.json")
    assert [d.rule for d in old.decisions] == ["norm.layer_norm"]
    assert [d.site.rule for d in old.decisions] == ["norm.layer_norm"]
    applied = apply_plan(cap, old)
    assert not applied.failed
    ops = [n.target for n in applied.gm.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.opswap.layer_norm.default) == 1
    with torch.no_grad():
        for rows in (1, 7):  # the example's batch and others
            inp = torch.randn(rows, 24)
            assert torch.allclose(applied.gm(inp), model(inp), atol=1e-5)


def test_a_new_rule_may_not_take_a_renamed_rules_old_name():
    class Old(Rule):
        name, family, chapter, exactness = "norm.layer_norm_triton", "norm", 10, "exact"

        def check(self, gm, node):
            return None

        def rewrite(self, gm, found):
            pass

    with pytest.raises(TypeError, match="old name of norm.layer_norm"):
        registry.register(Old)
