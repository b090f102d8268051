"""The public Python API (`import opswap`)."""

import importlib

import torch

import opswap


def _state(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


def test_public_surface():
    assert set(opswap.__all__) == {"analyze", "apply", "bench", "load", "optimize", "plan",
                                   "rules", "verify"}
    for name in opswap.__all__:
        assert getattr(opswap, name) is not None
    # importing a subpackage must not hide the API function of the same name
    importlib.import_module("opswap.bench.timing")
    importlib.import_module("opswap.verify.layers")
    assert callable(opswap.verify) and callable(opswap.bench)
    names = {r.name for r in opswap.rules.all_rules()}
    assert "fusion.conv_bn" in names and "layout.cancel_transpose" in names


def test_optimize_leaves_the_model_alone_and_reports(tmp_path):
    loaded = opswap.load("zoo:resnet")
    before = _state(loaded.module)
    result = opswap.optimize(loaded.module, loaded.example_inputs, target="cpu", samples=2,
                             compare="none")
    after = _state(loaded.module)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    rules = {s.rule for s in result.applied}
    assert {"fusion.conv_bn", "fusion.conv_relu"} <= rules
    assert result.verification.passed and result.verification.cosine >= 0.99999
    assert result.benchmark.ref_ms > 0 and result.benchmark.opt_ms > 0
    x = torch.randn_like(loaded.example_inputs[0])
    with torch.no_grad():
        torch.testing.assert_close(result.candidate(x), loaded.module(x), rtol=1e-4, atol=1e-5)
    paths = result.save(tmp_path)
    assert paths["report_html"].exists() and paths["result"].exists()


def test_plan_apply_verify_bench_round_trip(tmp_path):
    loaded = opswap.load("zoo:bert")
    plan = opswap.plan(loaded.module, loaded.example_inputs, rules="fusion.*")
    assert {d.rule for d in plan.decisions} >= {"fusion.layer_norm", "fusion.parallel_linear"}
    path = plan.save(tmp_path / "plan.json")
    candidate = opswap.apply(loaded.module, loaded.example_inputs, str(path))
    v = opswap.verify(loaded.module, candidate, loaded.example_inputs)
    assert v.passed, v.reasons
    b = opswap.bench(loaded.module, candidate, loaded.example_inputs)
    assert b.speedup > 0


def test_analyze_api():
    loaded = opswap.load("zoo:gpt")
    a = opswap.analyze(loaded.module, loaded.example_inputs, target="h200")
    assert a.total_flops > 0 and a.rows
    assert {r.category for r in a.rows} >= {"matmul", "softmax"}
