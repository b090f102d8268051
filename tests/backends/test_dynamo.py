"""The `opswap` torch.compile backend: rules on each Dynamo graph, then Inductor.

Compiling is slow on 2 cores, so the models are tiny and each test compiles once or
twice; outputs are compared with the user's eager module (Inductor reorders float
sums, hence the 1e-5-scale tolerances of float32 exact rewrites)."""

from __future__ import annotations

import copy
import importlib.metadata
import tomllib
from pathlib import Path

import pytest
import torch
from torch import nn

from opswap.backends import dynamo
from opswap.errors import OpswapError
from opswap.models import load

TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _state(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _unchanged(m: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    now = m.state_dict()
    return set(now) == set(before) and all(torch.equal(now[k], before[k]) for k in before)


class ConvNet(nn.Module):
    """Conv + eval BatchNorm + in-place ReLU twice, and a buffer the forward reads."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6)
        self.relu = nn.ReLU(inplace=True)
        self.conv2, self.bn2 = nn.Conv2d(6, 5, 3, padding=1), nn.BatchNorm2d(5)
        self.register_buffer("offset", torch.randn(5, 1, 1))

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        return self.bn2(self.conv2(x)).relu_() + self.offset


def _convnet() -> ConvNet:
    torch.manual_seed(0)
    m = ConvNet().eval()
    with torch.no_grad():  # statistics that make the folds change numbers
        for bn in (m.bn1, m.bn2):
            bn.running_mean.normal_()
            bn.running_var.uniform_(0.5, 2.0)
    return m


def test_conv_zoo_model_matches_eager_with_the_custom_op_at_another_batch():
    lm = load("zoo:resnet", overrides={"width": "4", "image_size": "8"})
    model = lm.module.eval()
    before = _state(model)
    be = dynamo.backend()
    compiled = torch.compile(model, backend=be)
    (x,) = lm.example_inputs
    torch._dynamo.mark_dynamic(x, 0)  # one graph for both batches
    x5 = torch.randn(5, *x.shape[1:])
    with torch.no_grad(), torch.profiler.profile() as prof:
        y, y5 = compiled(x), compiled(x5)
    torch.testing.assert_close(y, model(x).detach(), **TOL)
    torch.testing.assert_close(y5, model(x5).detach(), **TOL)
    # opswap's op reached Inductor's code as a call, and ran
    assert any("opswap::conv_relu" in e.key for e in prof.key_averages())
    (report,) = be.reports
    assert report.applied["fusion.conv_bn"] == 8 and report.applied["fusion.conv_relu"] == 4
    assert report.dynamic and report.frozen > 0 and not report.untouched
    assert _unchanged(model, before) and not any(p.grad is not None for p in model.parameters())


def test_transformer_zoo_model_dynamic_at_another_batch_and_length():
    lm = load(
        "zoo:bert",
        overrides={"layers": "1", "hidden": "32", "heads": "2", "intermediate": "48", "seq": "8"},
    )
    model = lm.module.eval()
    before = _state(model)
    seen: list[dynamo.GraphReport] = []
    be = dynamo.backend(report=seen.append)
    compiled = torch.compile(model, backend=be, dynamic=True)
    (ids,) = lm.example_inputs
    other = torch.randint(0, 1000, (3, 11))
    with torch.no_grad():
        for x in (ids, other):
            torch.testing.assert_close(compiled(x), model(x), **TOL)
    assert seen and seen == be.reports
    last = be.reports[-1]
    assert last.dynamic and "layout.drop_dropout" in last.fired and last.applied
    assert _unchanged(model, before)


class Breaks(nn.Module):
    """x * sigmoid(x) on each side of a graph break (`.item()` and a print)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(7, 9), nn.Linear(9, 4)

    def forward(self, x):
        h = self.fc1(x)
        h = h * torch.sigmoid(h)
        scale = h.abs().mean().item()
        print("scale", round(scale, 3))
        h = self.fc2(h / scale)
        return h * torch.sigmoid(h)


def test_graph_breaks_give_several_graphs_each_rewritten(capsys):
    model = Breaks().eval()
    be = dynamo.backend(rules="fusion.silu")
    compiled = torch.compile(model, backend=be)
    x = torch.randn(3, 7)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), **TOL)
    planned = [r for r in be.reports if not r.untouched and r.ops]
    assert len(planned) >= 2
    assert sum(r.applied.get("fusion.silu", 0) for r in planned) == 2
    assert "scale" in capsys.readouterr().out


def test_bn_eval_inplace_relu_a_recompile_and_weights_loaded_after_compiling():
    model = _convnet()
    before = _state(model)
    be = dynamo.backend()
    compiled = torch.compile(model, backend=be)
    x, x3 = torch.randn(2, 3, 11, 13), torch.randn(3, 3, 7, 9)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), **TOL)
        torch.testing.assert_close(compiled(x3), model(x3), **TOL)  # recompiled dynamic
    assert len(be.reports) == 2 and be.reports[1].dynamic and not be.reports[0].dynamic
    for report in be.reports:
        assert {"fusion.conv_bn", "fusion.conv_relu"} <= set(report.fired)
    assert _unchanged(model, before)
    # new weights through load_state_dict (in-place copies): planned again, not stale
    other = _convnet()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.5)
    model.load_state_dict(other.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(compiled(x3), other(x3), **TOL)
    assert any("planned again" in n for n in be.reports[1].notes)


def test_without_freezing_the_weight_rules_refuse_with_the_reason():
    model = _convnet()
    be = dynamo.backend(rules="fusion.conv_bn", freeze=False)
    compiled = torch.compile(model, backend=be)
    x = torch.randn(1, 3, 6, 6)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), **TOL)
    report = be.reports[0]
    assert not report.applied and report.frozen == 0
    assert any("not a constant" in m.reason for m in report.misses)
    assert any("freeze=False" in n for n in report.notes)


def test_training_graphs_go_to_inductor_untouched_and_train_alike():
    model = _convnet().train()
    twin = copy.deepcopy(model)
    be = dynamo.backend()
    compiled = torch.compile(model, backend=be)
    x = torch.randn(4, 3, 5, 5)
    compiled(x).square().mean().backward()
    twin(x).square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)
    torch.testing.assert_close(model.bn1.running_mean, twin.bn1.running_mean, **TOL)
    assert "records autograd" in be.reports[0].untouched and not be.reports[0].applied


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(rules="nosuch.*"), "No rule matches"),
        (dict(exactness="sloppy"), "exactness must be one of"),
        (dict(target="abacus"), "Unknown target"),
        (dict(freeze="yes"), "freeze must be"),
        (dict(report=3), "report must be a callable"),
    ],
)
def test_bad_options_are_one_sentence(kwargs, words):
    with pytest.raises(OpswapError, match=words):
        dynamo.backend(**kwargs)


def test_options_through_torch_compile_are_checked_by_name(monkeypatch):
    _registered(monkeypatch)
    with pytest.raises(OpswapError, match="has no option 'colour'"):
        dynamo.Options.make(colour="red")
    model = _convnet()
    compiled = torch.compile(model, backend="opswap", options={"rules": "fusion.conv_bn"})
    before = len(dynamo.opswap_backend.reports)
    with torch.no_grad():
        x = torch.randn(2, 3, 4, 4)
        torch.testing.assert_close(compiled(x), model(x), **TOL)
    assert dynamo.opswap_backend.reports[before].fired == ["fusion.conv_bn"]


def _registered(monkeypatch) -> importlib.metadata.EntryPoint:
    """pyproject.toml's entry point, made known to Dynamo: where this install predates it (an
    editable install made before it was declared), it is handed to Dynamo's discovery as an
    installed one would be."""
    from torch._dynamo.backends import registry

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    value = pyproject["project"]["entry-points"]["torch_dynamo_backends"]["opswap"]
    ep = importlib.metadata.EntryPoint("opswap", value, "torch_dynamo_backends")
    installed = importlib.metadata.entry_points(group="torch_dynamo_backends")
    if "opswap" not in installed.names:
        registry._BACKENDS.pop("opswap", None)
        registry._COMPILER_FNS.pop("opswap", None)
        monkeypatch.setattr(
            importlib.metadata,
            "entry_points",
            lambda group=None, **kw: importlib.metadata.EntryPoints([ep]),
        )
        registry._discover_entrypoint_backends.cache_clear()
        registry._discover_entrypoint_backends()
    return ep


def test_the_string_opswap_is_a_registered_backend(monkeypatch):
    from torch._dynamo.backends import registry

    ep = _registered(monkeypatch)
    assert ep.load() is dynamo.opswap_backend
    assert "opswap" in torch._dynamo.list_backends()
    assert registry.lookup_backend("opswap") is dynamo.opswap_backend
