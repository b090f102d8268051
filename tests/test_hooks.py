"""Hooks through the whole flow: weights computed by hooks and parametrisations reach the
optimized model as the user's module computes them; the user's own hooks are named."""

import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize

import opswap
from opswap.errors import OpswapError
from opswap.graph.copies import weight_hooks


def _old_weight_norm(m):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated in favour of parametrizations
        return torch.nn.utils.weight_norm(m)


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = _old_weight_norm(nn.Linear(6, 16))
        self.fc2 = parametrizations.spectral_norm(nn.Linear(16, 5))

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _normed():
    torch.manual_seed(0)
    m = Normed()
    m(torch.randn(2, 6))  # one train-mode call: spectral norm's u/v move off their start
    return m.eval()


def _reloaded(m):
    """`m` as a user has it after running it once and loading other weight_g/weight_v: the old
    weight_norm's cached `weight` is stale until its pre-hook runs again."""
    with torch.no_grad():
        m(torch.randn(2, 6))
    sd = {
        k: v + torch.randn_like(v) if k.endswith(("weight_g", "weight_v")) else v
        for k, v in m.state_dict().items()
    }
    m.load_state_dict(sd)
    return m


def _state(m):
    return (
        {k: v.clone() for k, v in m.state_dict().items()},
        weight_hooks(m),
        parametrize.is_parametrized(m.fc2),
        len(m.fc1._forward_pre_hooks),
    )


def _same_state(a, b):
    return (
        a[0].keys() == b[0].keys()
        and all(torch.equal(a[0][k], b[0][k]) for k in a[0])
        and a[1:] == b[1:]
    )


def _agrees(module, fn, batches=(1, 4, 7)):
    for b in batches:
        x = torch.randn(b, 6)
        with torch.no_grad():
            torch.testing.assert_close(fn(x), module(x), rtol=1e-5, atol=1e-5)


def test_the_saved_model_uses_the_weights_the_module_computes(tmp_path):
    m = _reloaded(_normed())
    before = _state(m)
    r = opswap.optimize(m, (torch.randn(4, 6),), bench=False, samples=2)
    assert _same_state(_state(m), before)  # nothing of the user's changed or dropped
    _agrees(m, r.candidate)
    r.save(tmp_path)
    with torch.inference_mode():
        _agrees(m, opswap.load_optimized(tmp_path))
    assert r.verification.passed
    assert any(
        "fc1.weight (weight_norm)" in n and "fc2.weight (spectral_norm)" in n for n in r.notes
    )


def test_verify_compares_with_the_module_as_the_user_calls_it():
    m = _reloaded(_normed())
    stale = Normed().eval()  # the plain modules with the weights the hooks left behind
    stale.load_state_dict(m.state_dict())
    with torch.no_grad():
        fc1 = nn.Linear(6, 16)
        fc1.weight.copy_(m.fc1.weight)
        fc1.bias.copy_(m.fc1.bias)
    stale.fc1 = fc1
    assert not opswap.verify(m, stale, (torch.randn(4, 6),)).passed
    assert opswap.verify(
        m,
        opswap.optimize(m, (torch.randn(4, 6),), bench=False, samples=1).candidate,
        (torch.randn(4, 6),),
    ).passed


def test_a_fresh_weight_norm_model_is_optimized():
    torch.manual_seed(0)
    m = nn.Sequential(
        _old_weight_norm(nn.Linear(6, 8)), nn.ReLU(), torch.nn.utils.spectral_norm(nn.Linear(8, 3))
    ).eval()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    r = opswap.optimize(m, (torch.randn(3, 6),), bench=False, samples=2)
    assert r.verification.passed
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    _agrees(m, r.candidate)


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 5)

    def forward(self, x):
        return torch.relu(self.fc(x))


def test_keep_hooks_names_the_hooks_it_cannot_keep():
    torch.manual_seed(0)
    m = Scaled().eval()
    m.fc.register_forward_hook(lambda mod, args, out: out * 2)
    m.register_forward_pre_hook(lambda mod, args: (args[0] + 1,))
    with pytest.raises(OpswapError) as e:
        opswap.optimize(m, (torch.randn(4, 6),), bench=False, keep_hooks=True)
    said = str(e.value)
    assert "forward hook on fc" in said and "forward pre-hook on the model" in said
    assert "deterministic" not in said and said.count(". ") == 0


def test_keep_hooks_with_only_weight_hooks_optimizes():
    m = _reloaded(_normed())
    r = opswap.optimize(m, (torch.randn(4, 6),), bench=False, samples=1, keep_hooks=True)
    assert r.verification.passed
    _agrees(m, r.candidate)


def test_a_fold_into_a_weight_normed_conv_uses_the_computed_weight():
    torch.manual_seed(0)
    m = nn.Sequential(_old_weight_norm(nn.Conv2d(3, 8, 3, padding=1)), nn.BatchNorm2d(8), nn.ReLU())
    m(torch.randn(4, 3, 9, 9))  # train-mode calls give BatchNorm statistics of its own
    m.eval()
    with torch.no_grad():
        m(torch.randn(1, 3, 9, 9))
    m.load_state_dict(
        {
            k: v * 1.5 + 0.1 if k.endswith(("weight_g", "weight_v")) else v
            for k, v in m.state_dict().items()
        }
    )
    r = opswap.optimize(m, (torch.randn(2, 3, 9, 9),), bench=False, samples=2)
    assert "fusion.conv_bn" in [s.rule for s in r.applied]
    for shape in ((1, 3, 9, 9), (3, 3, 12, 7)):
        x = torch.randn(shape)
        with torch.no_grad():
            torch.testing.assert_close(r.candidate(x), m(x), rtol=1e-4, atol=1e-5)
