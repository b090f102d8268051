"""The `opswap` command end to end, through its entry point."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from opswap.cli import main
from opswap.errors import OpswapError


def run(*args):
    """Run the CLI in-process; return its exit status."""
    try:
        main(list(args))
    except SystemExit as e:
        return e.code or 0
    return 0


def test_help_lists_commands():
    out = subprocess.run(
        [sys.executable, "-m", "opswap.cli", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0
    for cmd in ("analyze", "rules", "plan", "apply", "verify", "bench", "optimize", "models"):
        assert cmd in out.stdout


def test_every_command_has_help(capsys):
    for cmd in ("analyze", "rules", "plan", "apply", "verify", "bench", "optimize", "models"):
        assert run(cmd, "--help") == 0
        assert "--json" in capsys.readouterr().out or cmd in ("apply",)


def test_bad_spec_is_one_sentence_and_exit_2(capsys):
    assert run("analyze", "nonsense") == 2
    err = capsys.readouterr().err
    assert "error:" in err and "zoo:NAME" in err and "Traceback" not in err


def test_unknown_target(capsys):
    assert run("analyze", "zoo:resnet", "--target", "tpu9") == 2
    assert "h100" in capsys.readouterr().err


def test_bad_override(capsys):
    assert run("analyze", "zoo:resnet", "--set", "nokey") == 2
    assert "KEY=VALUE" in capsys.readouterr().err


def test_analyze_json(tmp_path, capsys):
    path = tmp_path / "a.json"
    assert run("analyze", "zoo:resnet", "--json", str(path)) == 0
    data = json.loads(path.read_text())
    for key in ("model", "target", "total_flops", "total_bytes", "ops"):
        assert key in data
    op = data["ops"][0]
    for key in ("name", "op", "category", "flops", "bytes", "intensity", "bound", "share"):
        assert key in op
    assert data["total_flops"] == sum(o["flops"] for o in data["ops"])
    assert "Bottlenecks" in capsys.readouterr().out


def test_rules_json(tmp_path):
    path = tmp_path / "r.json"
    assert run("rules", "--json", str(path)) == 0
    rules = json.loads(path.read_text())
    names = {r["name"] for r in rules}
    assert {"fusion.conv_bn", "fusion.parallel_linear", "layout.drop_dropout"} <= names
    # the rules on ONNX graphs are listed too, with what they target
    onnx_rows = [r for r in rules if r["family"] == "onnx"]
    assert {"onnx.attention", "onnx.skip_layer_norm"} <= {r["name"] for r in onnx_rows}
    assert all(r["targets"] == ["onnxruntime"] and r["description"] for r in onnx_rows)
    for r in rules:
        assert set(r) >= {"name", "family", "chapter", "exactness", "targets"}


def test_plan_apply_verify_bench(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert run("plan", "zoo:resnet", *SMALL, "--rules", "fusion.*", "--out", str(plan)) == 0
    data = json.loads(plan.read_text())
    assert data["decisions"] and all(d["rule"].startswith("fusion.") for d in data["decisions"])
    assert run("apply", "zoo:resnet", *SMALL, str(plan), "--out", str(tmp_path / "m")) == 0
    assert (tmp_path / "m" / "model.pt2").exists() or (tmp_path / "m" / "model_state.pt").exists()
    v_json = str(tmp_path / "v.json")
    assert run("verify", "zoo:resnet", *SMALL, str(plan), "--json", v_json) == 0
    assert json.loads((tmp_path / "v.json").read_text())["passed"] is True
    b_json = str(tmp_path / "b.json")
    assert run("bench", "zoo:resnet", *SMALL, str(plan), "--json", b_json) == 0
    b = json.loads((tmp_path / "b.json").read_text())
    assert b["ref_ms"] > 0 and b["opt_ms"] > 0 and b["speedup"] > 0


def test_apply_plan_of_another_model_is_refused(tmp_path, capsys):
    # the plan records its graph's fingerprint; sites missing from the same graph are
    # test_a_partly_applicable_plan_exits_1_everywhere's case
    plan = tmp_path / "plan.json"
    assert run("plan", "zoo:resnet", "--rules", "fusion.conv_bn", "--out", str(plan)) == 0
    capsys.readouterr()
    assert run("apply", "zoo:mobilenet", str(plan)) == 2
    err = capsys.readouterr().err
    assert "make a plan for it with `opswap plan`" in err and "Traceback" not in err


def test_verify_fails_on_a_tight_budget(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert run("plan", "zoo:resnet", "--rules", "fusion.conv_bn", "--out", str(plan)) == 0
    # folding BN changes rounding: an exactly-zero error budget cannot hold
    assert run("verify", "zoo:resnet", str(plan), "--budget", "max_abs<=0") == 1
    assert "FAILED" in capsys.readouterr().out


@pytest.mark.slow
def test_optimize_writes_everything(tmp_path):
    out = tmp_path / "o"
    assert run("optimize", "zoo:resnet", *SMALL, "--out", str(out), "--samples", "2") == 0
    for name in ("plan.json", "result.json", "report.md", "report.html"):
        assert (out / name).exists(), name
    data = json.loads((out / "result.json").read_text())
    for key in ("model", "target", "applied", "misses", "verification", "benchmark"):
        assert key in data
    for key in ("max_abs", "max_rel", "cosine", "sqnr_db", "passed"):
        assert key in data["verification"]
    for key in ("ref_ms", "opt_ms", "speedup", "device"):
        assert key in data["benchmark"]
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 3
    # batch, and height with width (one size, probed together); the channels stay static
    assert [a["name"] for a in data["dynamic"]["axes"]] == ["batch", "dim0_2"]
    assert "batch 1" in data["verification"]["shapes"]
    assert "Dynamic sizes" in (out / "report.md").read_text()


@pytest.mark.parametrize("cmd", ["optimize", "verify"])
def test_samples_below_one_are_refused(cmd, tmp_path, capsys):
    plan = tmp_path / "p.json"
    assert run("plan", "zoo:resnet", "--out", str(plan)) == 0
    args = (
        ("optimize", "zoo:resnet", "--out", str(tmp_path / "o"))
        if cmd == "optimize"
        else ("verify", "zoo:resnet", str(plan))
    )
    capsys.readouterr()
    assert run(*args, "--samples", "0") == 2
    err = capsys.readouterr().err
    assert "at least" in err and "Traceback" not in err


def test_dynamic_option_is_recorded(tmp_path):
    out = tmp_path / "o"
    assert (
        run(
            "optimize",
            "zoo:resnet",
            "--out",
            str(out),
            "--samples",
            "1",
            "--no-bench",
            "--dynamic",
            "none",
        )
        == 0
    )
    data = json.loads((out / "result.json").read_text())
    assert data["dynamic"]["axes"] == [] and data["settings"]["dynamic"] == "none"


def test_models_lists_zoo(capsys):
    assert run("models") == 0
    out = capsys.readouterr().out
    assert "zoo:resnet" in out and "hf:bert" in out


@pytest.mark.parametrize(
    "args, says",
    [
        (("optimize", "zoo:resnet", "--exprot", "onnx"), "No such option: --exprot"),
        (("optimize",), "Missing argument"),
        (("bogus",), "No such command 'bogus'"),
    ],
)
def test_usage_errors_are_one_message_and_exit_2(capsys, args, says):
    assert run(*args) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and len(err.splitlines()) <= 5


def test_no_arguments_prints_help(capsys):
    assert run() in (0, 2)  # click >= 8.2 exits 2 after showing the help, older click 0
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "optimize" in text and "analyze" in text and "Traceback" not in text


def test_version(capsys):
    from opswap import __version__

    assert run("--version") == 0
    assert capsys.readouterr().out == f"opswap {__version__}\n"


@pytest.fixture
def no_model(monkeypatch):
    def _load(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr("opswap.cli.commands._load", _load)


@pytest.mark.parametrize(
    "args, says",
    [
        (("optimize", "zoo:resnet", "--out", "FILE"), "--out FILE is an existing file"),
        (("plan", "zoo:resnet", "--out", "DIR"), "--out DIR is an existing directory"),
        (
            ("apply", "zoo:resnet", "missing.json", "--out", "FILE"),
            "--out FILE is an existing file",
        ),
        (("plan", "zoo:resnet", "--out", "FILE/plan.json"), "lies under FILE, which is a file"),
    ]
    + [
        ((*cmd, "--json", "DIR"), "--json DIR is an existing directory")
        for cmd in (
            ("analyze", "zoo:resnet"),
            ("rules",),
            ("models",),
            ("plan", "zoo:resnet"),
            ("apply", "zoo:resnet", "missing.json"),
            ("verify", "zoo:resnet", "missing.json"),
            ("bench", "zoo:resnet", "missing.json"),
            ("optimize", "zoo:resnet"),
        )
    ],
)
def test_bad_output_paths_fail_before_any_work(tmp_path, capsys, no_model, args, says):
    (tmp_path / "f.txt").write_text("keep me\n")
    (tmp_path / "d").mkdir()
    paths = {"FILE": str(tmp_path / "f.txt"), "DIR": str(tmp_path / "d")}
    sub = re.compile("FILE|DIR")
    assert run(*(sub.sub(lambda m: paths[m[0]], a) for a in args)) == 2
    captured = capsys.readouterr()
    assert sub.sub(lambda m: paths[m[0]], says) in captured.err
    assert captured.out == ""  # nothing ran: no table, no "wrote"
    assert (tmp_path / "f.txt").read_text() == "keep me\n"


@pytest.mark.parametrize(
    "args", [("optimize", "zoo:resnet"), ("bench", "zoo:resnet", "missing.json")]
)
def test_bogus_device_fails_before_loading(capsys, no_model, args):
    assert run(*args, "--device", "bogus") == 2
    err = capsys.readouterr().err
    assert "'bogus'" in err and "cpu, cuda or cuda:N" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_gpu_fails_before_loading(capsys, no_model):
    assert run("optimize", "zoo:resnet", "--device", "cuda") == 2
    assert "no GPU" in capsys.readouterr().err


def test_error_message_is_printed_verbatim(monkeypatch, capsys):
    message = (
        "fused attention takes dtype in [torch.float16, torch.bfloat16]: got torch.float32 "
        "at layer [3] of the encoder; pass --set dtype=float16 or drop the rule from --rules."
    )

    def _load(*args, **kwargs):
        raise OpswapError(message)

    monkeypatch.setattr("opswap.cli.commands._load", _load)
    assert run("analyze", "zoo:resnet") == 2
    assert capsys.readouterr().err == f"error: {message}\n"


def test_apply_rejects_a_hand_edited_plan(tmp_path, capsys, no_model):
    plan = tmp_path / "bad_plan.json"
    plan.write_text(
        json.dumps(
            {
                "version": 1,
                "settings": {"exactness": "exact"},
                "decisions": [
                    {
                        "rule": "fusion.conv_bn",
                        "site": {"key": "conv+bn", "nodes": ["conv", "bn"], "data": []},
                    }
                ],
            }
        )
    )
    assert run("apply", "zoo:resnet", str(plan)) == 2
    err = capsys.readouterr().err
    assert f"{plan}: decision 0: site data must be an object, got a list" in err
    assert "Traceback" not in err


# --- issue 8: wording, help, rules, target/device, exit statuses, markup -------------------

SMALL = ("--set", "width=4", "--set", "image_size=16", "--set", "batch=2")


def test_counts_are_singular_and_plural(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert run("plan", "zoo:resnet", *SMALL, "--rules", "fusion.linear_bn", "--out", str(plan)) == 0
    out = capsys.readouterr().out
    assert "plan: 1 replacement" in out and "1 replacements" not in out
    assert run("apply", "zoo:resnet", *SMALL, str(plan)) == 0
    assert "applied 1 of 1 decision\n" in capsys.readouterr().out


def test_flags_read_as_flags_in_help(capsys):
    assert run("optimize", "--help") == 0
    out = capsys.readouterr().out
    assert "<bool>" not in out and "<list[str]>" not in out
    line = next(ln for ln in out.splitlines() if "--no-bench" in ln)
    assert re.search(r"--no-bench\s+Skip timing", line), line
    assert "KEY=VALUE" in out and "--weights" in out
    assert run("--help") == 0
    out = capsys.readouterr().out
    assert "<bool>" not in out and "Exit status" in out and "1 when a verification failed" in out


def test_rules_wide_prints_whole_descriptions(monkeypatch, capsys):
    from rich.console import Console

    from opswap.rules.registry import all_rules

    monkeypatch.setattr("opswap.cli.consoles.console", Console(width=80))
    assert run("rules") == 0
    table = capsys.readouterr().out
    assert "--wide" in " ".join(table.split())  # the table says how to see the rest
    assert run("rules", "--wide") == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    text = " ".join(out.split())
    for rule in all_rules():
        assert " ".join(rule.info()["description"].split()) in text, rule.name


def test_a_gpu_target_timed_here_says_so(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert run("plan", "zoo:resnet", *SMALL, "--target", "h200", "--out", str(plan)) == 0
    capsys.readouterr()
    assert run("bench", "zoo:resnet", *SMALL, str(plan)) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "timing: the plan is made for h200" in out and "measured here, on cpu:" in out
    # bench prints the spread, the interval and the rounds
    assert re.search(
        r"reference [\d.]+ ms \(IQR [\d.]+\), optimized [\d.]+ ms \(IQR [\d.]+\), "
        r"speedup (at least |at most )?([\d.]+x|within noise) \[[\d.]+-[\d.]+\].*\d+ interleaved rounds",
        out,
    ), out
    assert run("plan", "zoo:resnet", *SMALL, "--out", str(plan)) == 0
    capsys.readouterr()
    assert run("bench", "zoo:resnet", *SMALL, str(plan)) == 0
    assert "timing:" not in capsys.readouterr().out  # made for this CPU, timed on it


def test_bench_on_a_busy_machine_prints_its_interval_and_says_it_did_not_settle(
    tmp_path, capsys, monkeypatch
):
    from opswap.bench import timing
    from opswap.bench.noisy import busy

    plan = tmp_path / "plan.json"
    assert run("plan", "zoo:resnet", *SMALL, "--out", str(plan)) == 0
    monkeypatch.setattr(timing, "_Timer", busy(seed=6))  # half the samples 20x slower
    capsys.readouterr()
    assert run("bench", "zoo:resnet", *SMALL, str(plan), "--json", str(tmp_path / "b.json")) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "timings did not settle: the machine is busy" in out
    data = json.loads((tmp_path / "b.json").read_text())
    lo, hi = data["speedup_ci"]
    # the interval is printed, led by the end it supports (or "within noise"), then the median
    assert re.search(
        rf"speedup (at least {lo:.2f}x|at most {hi:.2f}x|within noise) \[{lo:.2f}-{hi:.2f}\], "
        rf"median {data['speedup_of_medians']:.2f}x",
        out,
    ), out
    assert data["settled"] is False


def test_optimize_for_a_gpu_target_on_cpu_says_so_before_loading(monkeypatch, capsys):
    def _load(*args, **kwargs):
        raise OpswapError("stop after the checks.")

    monkeypatch.setattr("opswap.cli.commands._load", _load)
    assert run("optimize", "zoo:resnet", "--target", "h200") == 2
    assert "the plan is made for h200" in " ".join(capsys.readouterr().out.split())


def test_verify_prints_tolerance_and_samples(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert run("plan", "zoo:resnet", *SMALL, "--rules", "fusion.conv_bn", "--out", str(plan)) == 0
    capsys.readouterr()
    assert run("verify", "zoo:resnet", *SMALL, str(plan), "--samples", "2") == 0
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "tolerance: cosine>=0.99999, rel_l2<=1e-05, sqnr_db>=100, top1>=1, top5>=1 (the exact "
        "defaults); "
        "6 samples: 2 at the example shape 2x3x16x16, one at each of batch 1, batch 3, "
        "dim0_2 17, dim0_2 64 (largest verified), batch 1"
    ) in out


@pytest.fixture
def partial_plan(tmp_path):
    """A zoo:resnet plan with one decision more, whose site (a name in square brackets,
    which rich markup would eat) the model does not have."""
    plan = tmp_path / "plan.json"
    assert run("plan", "zoo:resnet", *SMALL, "--rules", "fusion.conv_bn", "--out", str(plan)) == 0
    data = json.loads(plan.read_text())
    ghost = json.loads(json.dumps(data["decisions"][0]))
    ghost["site"]["key"] = "conv9+bn9 [torch.float16, torch.bfloat16]"
    data["decisions"].append(ghost)
    plan.write_text(json.dumps(data))
    return plan, len(data["decisions"])


@pytest.mark.parametrize("cmd", ["apply", "verify", "bench"])
def test_a_partly_applicable_plan_exits_1_everywhere(cmd, partial_plan, tmp_path, capsys):
    plan, n = partial_plan
    capsys.readouterr()
    extra = ("--out", str(tmp_path / "m")) if cmd == "apply" else ()
    assert run(cmd, "zoo:resnet", *SMALL, str(plan), *extra) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "not applied: fusion.conv_bn at conv9+bn9 [torch.float16, torch.bfloat16]: " in out
    done = {
        "apply": f"saved {tmp_path / 'm' / 'model.pt2'} with the {n - 1} that did",
        "verify": f"verified the model with the {n - 1} that did",
        "bench": f"timed the model with the {n - 1} that did",
    }[cmd]
    assert (
        f"partial plan: 1 of {n} decisions could not be applied (listed above); {done}; "
        "exit status 1."
    ) in out
    if cmd == "apply":
        assert (tmp_path / "m" / "model.pt2").exists()


def test_plan_cells_keep_square_brackets(monkeypatch, tmp_path, capsys):
    import opswap.planner as plan_module
    from opswap.rules.base import Miss

    real = plan_module.make_plan

    def with_miss(*args, **kwargs):
        p = real(*args, **kwargs)
        p.misses.append(
            Miss(
                "fusion.sdpa",
                "layer [3]",
                "takes dtype in [torch.float16, torch.bfloat16], got torch.float32",
            )
        )
        return p

    monkeypatch.setattr(plan_module, "make_plan", with_miss)
    assert (
        run(
            "plan",
            "zoo:resnet",
            *SMALL,
            "--rules",
            "fusion.linear_bn",
            "--out",
            str(tmp_path / "p.json"),
        )
        == 0
    )
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "[torch.float16, torch.bfloat16]" in out and "layer [3]" in out


# --------------------------------------------------------------------------- rules from elsewhere

_MY_RULES = Path(__file__).resolve().parent.parent / "examples" / "my_rules"

_SWISH_SPEC = """
import torch
import torch.nn.functional as F
from torch import nn


class HardSwish(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        return y * F.relu6(y + 3) / 6


def build(batch: int = 2):
    torch.manual_seed(0)
    return HardSwish().eval(), (torch.randn(batch, 3, 9, 7),)
"""


def _opswap(*args, cwd, pythonpath=()):
    """The CLI in a fresh process (rules registered by one run stay out of the others), with
    -P: like the `opswap` script, and unlike `python -m`, no current directory on sys.path."""
    # a wide console, so that a table cell (a rule's name) is printed whole
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, pythonpath)), "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-P", "-m", "opswap.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=env,
    )


def test_rules_from_a_users_module_list_plan_and_reapply(tmp_path):
    spec = tmp_path / "swish.py"
    spec.write_text(_SWISH_SPEC)
    listed = _opswap(
        "rules", "--rules-from", "my_rules.hardswish", "--json", tmp_path / "r.json", cwd=_MY_RULES
    )
    assert listed.returncode == 0, listed.stderr
    rules = {r["name"]: r for r in json.loads((tmp_path / "r.json").read_text())}
    assert rules["my_rules.hardswish"]["origin"] == "module my_rules.hardswish"
    assert rules["fusion.conv_bn"]["origin"] == "opswap"
    assert "my_rules.hardswish" in listed.stdout and "module my_rules.hardswish" in listed.stdout
    plan = tmp_path / "plan.json"
    made = _opswap(
        "plan",
        f"{spec}:build",
        "--rules-from",
        "my_rules.hardswish",
        "--rules",
        "my_rules.*",
        "--out",
        plan,
        cwd=_MY_RULES,
    )
    assert made.returncode == 0, made.stderr
    assert [d["rule"] for d in json.loads(plan.read_text())["decisions"]] == ["my_rules.hardswish"]
    # re-applied at another batch size, against the user's module
    checked = _opswap(
        "verify",
        f"{spec}:build",
        plan,
        "--set",
        "batch=5",
        "--rules-from",
        "my_rules.hardswish",
        cwd=_MY_RULES,
    )
    assert checked.returncode == 0 and "PASSED" in checked.stdout, checked.stdout + checked.stderr
    # without the module the plan names a rule opswap does not know: one line, how to fix
    missing = _opswap("apply", f"{spec}:build", plan, cwd=_MY_RULES)
    assert missing.returncode == 2
    assert "my_rules.hardswish" in missing.stderr and "--rules-from MODULE" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_rules_from_a_module_that_cannot_load_is_one_line(tmp_path):
    (tmp_path / "broken_rules.py").write_text("import no_such_dependency_xyz\n")
    for module in ("broken_rules", "no_such_rules_xyz"):
        out = _opswap("rules", "--rules-from", module, cwd=tmp_path)
        assert out.returncode == 2, out.stdout
        assert out.stderr.startswith("error:") and module in out.stderr
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_installed_plugins_are_listed_and_a_broken_one_is_a_note(tmp_path):
    info = tmp_path / "opswap_my_rules-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: opswap-my-rules\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(
        "[opswap.rules]\nhardswish = my_rules.hardswish\ngone = no_such_plugin_xyz\n"
    )
    out = _opswap(
        "rules", "--json", tmp_path / "r.json", cwd=tmp_path, pythonpath=(tmp_path, _MY_RULES)
    )
    assert out.returncode == 0, out.stderr
    rules = {r["name"]: r for r in json.loads((tmp_path / "r.json").read_text())}
    assert rules["my_rules.hardswish"]["origin"] == "entry point hardswish of opswap-my-rules 0.1.0"
    assert {"fusion.conv_bn", "precision.int8_linear"} <= set(rules)
    note = [line for line in out.stdout.splitlines() if "no_such_plugin_xyz" in line]
    assert len(note) == 1 and "left out" in note[0] and "ModuleNotFoundError" in note[0]
    assert "Traceback" not in out.stdout + out.stderr


def test_every_command_that_plans_or_lists_takes_rules_from(capsys):
    for cmd in ("rules", "plan", "apply", "verify", "bench", "optimize"):
        assert run(cmd, "--help") == 0
        assert "--rules-from" in capsys.readouterr().out, cmd


# --- issue 13.12: a decision looser than the plan's exactness -------------------------------

_MLP = """
import torch
from torch import nn


def build(batch=32):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(160, 96), nn.ReLU(), nn.Linear(96, 72))
    return model, (torch.randn(batch, 160),)
"""


def test_apply_refuses_an_approx_decision_in_an_exact_plan_unless_allowed(
    tmp_path, capsys, monkeypatch
):
    from opswap import artifact

    # this machine's timing says int8 pays, so the approx rule is planned
    monkeypatch.setattr(
        "opswap.rules.precision.int8_linear.time_on_this_cpu",
        lambda m, k, n, b, t, timer, *kernel: (2e-3, 1e-3),
    )
    (tmp_path / "mlp.py").write_text(_MLP)
    spec = f"{tmp_path / 'mlp.py'}:build"
    plan = tmp_path / "plan.json"
    assert (
        run(
            "plan",
            spec,
            "--exactness",
            "approx",
            "--rules",
            "precision.int8_linear",
            "--out",
            str(plan),
        )
        == 0
    )
    data = json.loads(plan.read_text())
    assert [d["rule"] for d in data["decisions"]] == ["precision.int8_linear"] * 2
    data["settings"]["exactness"] = "exact"  # the approx decisions now sit in an exact plan
    plan.write_text(json.dumps(data))
    capsys.readouterr()
    out = tmp_path / "m"
    assert run("apply", spec, str(plan), "--out", str(out)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "precision.int8_linear, an approx rule" in err and "exactness exact" in err
    assert "--allow-looser" in err
    assert not (out / "model.pt2").exists() and not (out / "model_state.pt").exists()
    assert run("apply", spec, str(plan), "--allow-looser", "--out", str(out)) == 0
    saved = artifact.load(out)
    user = _load_user(tmp_path)
    for rows in (32, 9, 57):  # the example's batch and others, against the user's module
        x = torch.randn(rows, 160)
        with torch.no_grad():
            want, got = user(x), saved(x)
        assert float((got - want).norm() / want.norm()) < 3e-2  # the approx tolerance


def _load_user(tmp_path):
    from opswap.models import load

    return load(f"{tmp_path / 'mlp.py'}:build").module
