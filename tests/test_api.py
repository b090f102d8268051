"""The public Python API (`import opswap`)."""

import importlib

import torch

import opswap


def _state(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


def test_public_surface():
    assert set(opswap.__all__) == {
        "analyze",
        "apply",
        "bench",
        "export",
        "load",
        "load_optimized",
        "optimize",
        "plan",
        "rules",
        "verify",
    }
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
    result = opswap.optimize(
        loaded.module, loaded.example_inputs, target="cpu", samples=2, compare="none"
    )
    after = _state(loaded.module)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    rules = {s.rule for s in result.applied}
    # a rule the clock found slower on this (busy) machine is pruned, with that reason
    pruned = {s.rule for s in result.plan.skipped if "measured slower" in s.reason}
    assert {"fusion.conv_bn", "fusion.conv_relu"} <= rules | pruned
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


class _Keywords(torch.nn.Module):
    """A forward that needs keywords: opswap takes them through graph.keywords.KeywordCall."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x, *, mask=None, scale=1.0):
        y = torch.relu(self.bn(self.conv(x))).mean((2, 3))
        y = self.head(y) * scale
        return y if mask is None else y * mask


def _keyword_model():
    torch.manual_seed(0)
    model = _Keywords().eval()
    with torch.no_grad():  # BatchNorm statistics that are not the identity
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    return model


def test_optimize_takes_keyword_inputs(tmp_path):
    model = _keyword_model()
    before = _state(model)
    x, mask = torch.randn(4, 3, 8, 8), torch.rand(4, 4)
    result = opswap.optimize(
        model, {"x": x, "mask": mask, "scale": 0.5}, samples=2, compare="none", bench=False
    )
    assert result.verification.passed, result.verification.reasons
    assert "fusion.conv_bn" in {s.rule for s in result.applied}
    assert any(s.startswith("batch") for s in result.verification.shapes)
    assert result.notes[0] == (
        "The model takes keyword inputs; the optimized model (and "
        "model.pt2) takes its inputs positionally in this order: x, "
        "mask (scale=0.5 bound as a constant)."
    )
    assert all(torch.equal(before[k], v) for k, v in _state(model).items())
    x7, mask7 = torch.randn(7, 3, 8, 8), torch.rand(7, 4)  # another batch size
    with torch.no_grad():
        torch.testing.assert_close(
            result.candidate(x7, mask7), model(x7, mask=mask7, scale=0.5), rtol=1e-4, atol=1e-5
        )
    # the API's other entry points take the same keyword inputs
    inputs = ((x,), {"mask": mask, "scale": 0.5})
    assert opswap.verify(model, result.candidate, inputs).passed
    assert opswap.bench(model, result.candidate, inputs).speedup > 0
    plan = opswap.plan(model, inputs)
    assert plan.model == "_Keywords" and plan.decisions
    candidate = opswap.apply(model, inputs, plan)
    with torch.no_grad():
        torch.testing.assert_close(
            candidate(x7, mask7), model(x7, mask=mask7, scale=0.5), rtol=1e-4, atol=1e-5
        )
    assert opswap.analyze(model, inputs).total_flops > 0


def test_verify_catches_a_wrong_constant():
    model = _keyword_model()
    x, mask = torch.randn(4, 3, 8, 8), torch.rand(4, 4)
    wrong = opswap.apply(
        model,
        {"x": x, "mask": mask, "scale": 2.0},
        opswap.plan(model, {"x": x, "mask": mask, "scale": 2.0}),
    )
    assert not opswap.verify(model, wrong, {"x": x, "mask": mask, "scale": 0.5}).passed
