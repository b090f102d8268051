"""The `opswap` command end to end, through its entry point."""

import json
import subprocess
import sys

import pytest

from opswap.cli import main


def run(*args):
    """Run the CLI in-process; return its exit status."""
    try:
        main(list(args))
    except SystemExit as e:
        return e.code or 0
    return 0


def test_help_lists_commands():
    out = subprocess.run([sys.executable, "-m", "opswap.cli", "--help"], capture_output=True,
                         text=True, timeout=120)
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
    for r in rules:
        assert set(r) >= {"name", "family", "chapter", "exactness", "targets"}


def test_plan_apply_verify_bench(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert run("plan", "zoo:resnet", "--rules", "fusion.*", "--out", str(plan)) == 0
    data = json.loads(plan.read_text())
    assert data["decisions"] and all(d["rule"].startswith("fusion.") for d in data["decisions"])
    assert run("apply", "zoo:resnet", str(plan), "--out", str(tmp_path / "m")) == 0
    assert (tmp_path / "m" / "model.pt2").exists() or (tmp_path / "m" / "model_state.pt").exists()
    assert run("verify", "zoo:resnet", str(plan), "--json", str(tmp_path / "v.json")) == 0
    assert json.loads((tmp_path / "v.json").read_text())["passed"] is True
    assert run("bench", "zoo:resnet", str(plan), "--json", str(tmp_path / "b.json")) == 0
    b = json.loads((tmp_path / "b.json").read_text())
    assert b["ref_ms"] > 0 and b["opt_ms"] > 0 and b["speedup"] > 0


def test_apply_plan_of_another_model_reports_missing_sites(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert run("plan", "zoo:resnet", "--rules", "fusion.conv_bn", "--out", str(plan)) == 0
    assert run("apply", "zoo:mobilenet", str(plan)) == 1
    assert "site not found" in capsys.readouterr().out


def test_verify_fails_on_a_tight_budget(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert run("plan", "zoo:resnet", "--rules", "fusion.conv_bn", "--out", str(plan)) == 0
    # folding BN changes rounding: an exactly-zero error budget cannot hold
    assert run("verify", "zoo:resnet", str(plan), "--budget", "max_abs<=0") == 1
    assert "FAILED" in capsys.readouterr().out


@pytest.mark.slow
def test_optimize_writes_everything(tmp_path):
    out = tmp_path / "o"
    assert run("optimize", "zoo:resnet", "--out", str(out), "--samples", "2") == 0
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


def test_models_lists_zoo(capsys):
    assert run("models") == 0
    out = capsys.readouterr().out
    assert "zoo:resnet" in out and "hf:bert" in out
