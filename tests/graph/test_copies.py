"""Private copies drop the user's hooks; opswap's own runs leave buffers as they were."""

import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

from opswap.errors import OpswapError
from opswap.graph.copies import (
    count_hooks,
    materialise_weights,
    preserved_state,
    private_copy,
    user_hooks,
    weight_hooks,
)


class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return self.fc(x) * self.calls


def test_private_copy_drops_hooks_unless_kept():
    m = Counting()
    fired = []
    m.register_forward_hook(lambda *a: fired.append(1))
    m.fc.register_forward_pre_hook(lambda *a: fired.append(2))
    assert count_hooks(m) == 2
    c = private_copy(m)
    c(torch.randn(2, 4))
    assert fired == [] and count_hooks(c) == 0 and count_hooks(m) == 2
    private_copy(m, keep_hooks=True)(torch.randn(2, 4))
    assert sorted(fired) == [1, 2]
    assert m.calls.item() == 0


def test_preserved_state_puts_buffers_back():
    m = Counting()
    x = torch.randn(2, 4)
    with torch.no_grad(), preserved_state(m):
        first = m(x)
        second = m(x)
    assert m.calls.item() == 0
    assert not torch.equal(first, second)
    with torch.no_grad():
        torch.testing.assert_close(m(x), first)  # starts again from the same state


def test_writing_a_parameter_is_refused():
    class Drifting(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, x):
            with torch.no_grad():
                self.w.add_(1)
            return x * self.w

    m = Drifting()
    with pytest.raises(OpswapError, match="writes into its parameter w"):
        with preserved_state(m):
            m(torch.ones(3))


def test_a_model_made_under_inference_mode_runs_under_preserved_state():
    """Parameters made under torch.inference_mode have no version counter: the run goes
    on (they cannot be checked) instead of failing to read it."""
    with torch.inference_mode():
        m = nn.Linear(4, 3)
        x = torch.randn(2, 4)
        assert m.weight.is_inference()
        with preserved_state(m):
            y = m(x)
    assert y.shape == (2, 3)


# Weight-computing hooks and parametrisations: torch.nn.utils.weight_norm (a forward pre-hook
# recomputing `weight` from weight_g/weight_v), the old spectral_norm (likewise from
# weight_orig and its u/v), and torch.nn.utils.parametrize (`weight` a property).


def _old_weight_norm(m):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated in favour of parametrizations
        return torch.nn.utils.weight_norm(m)


def _weighted():
    """One module of each weight-computing kind, in eval mode, with one plain hook."""
    torch.manual_seed(0)
    m = nn.Sequential(
        _old_weight_norm(nn.Linear(6, 5)),
        nn.ReLU(),
        torch.nn.utils.spectral_norm(nn.Linear(5, 7)),
        nn.Tanh(),
        parametrizations.weight_norm(nn.Linear(7, 4)),
        nn.ReLU(),
        parametrizations.spectral_norm(nn.Linear(4, 3)),
    )
    for _ in range(3):  # train-mode calls move the spectral norms' u/v away from their start
        m(torch.randn(2, 6))
    return m.eval()


def _stale(m):
    """`m` after load_state_dict with other weight_g/weight_v: the old weight_norm's cached
    `weight` no longer is g * v / |v| until the module is called again."""
    sd = {
        k: v + torch.randn_like(v) if k.endswith(("weight_g", "weight_v")) else v
        for k, v in m.state_dict().items()
    }
    m.load_state_dict(sd)
    return m


def _snapshot(m):
    return (
        {k: v.clone() for k, v in m.state_dict().items()},
        weight_hooks(m),
        [type(x).__name__ for x in m.modules()],
    )


def test_weight_hooks_are_classified_apart_from_user_hooks():
    m = _weighted()
    m[0].register_forward_hook(lambda *a: None)
    assert [path for path, _ in weight_hooks(m)] == ["0", "2", "4", "6"]
    assert [kind for _, kind in weight_hooks(m)] == [
        "weight_norm",
        "spectral_norm",
        "weight_norm",
        "spectral_norm",
    ]
    assert count_hooks(m) == 1 and user_hooks(m) == [("0", "forward hook")]


def test_private_copy_keeps_weight_hooks_and_copies_a_fresh_weight_norm():
    torch.manual_seed(0)
    fresh = _old_weight_norm(nn.Linear(6, 5))  # its `weight` is a non-leaf: deepcopy refused
    fresh.register_forward_pre_hook(lambda *a: None)
    c = private_copy(fresh)
    assert weight_hooks(c) == [("", "weight_norm")] and count_hooks(c) == 0
    assert count_hooks(fresh) == 1
    x = torch.randn(3, 6)
    with torch.no_grad():
        torch.testing.assert_close(c(x), fresh(x), rtol=0, atol=0)
        c.load_state_dict(_stale(fresh).state_dict())  # the copy's hook follows new g and v
        torch.testing.assert_close(c(x), fresh(x), rtol=0, atol=0)


def test_materialise_stores_what_the_module_computes_in_eval_mode():
    m = _stale(_weighted())
    before = _snapshot(m)
    c = private_copy(m)
    done = materialise_weights(c)
    assert done == [
        "0.weight (weight_norm)",
        "2.weight (spectral_norm)",
        "4.weight (weight_norm)",
        "6.weight (spectral_norm)",
    ]
    assert weight_hooks(c) == []
    assert all(type(x).__module__.startswith("torch.nn.modules") for x in c.modules())
    assert all(isinstance(c[i].weight, nn.Parameter) for i in (0, 2, 4, 6))
    for x in (torch.randn(1, 6), torch.randn(5, 6)):
        with torch.no_grad():
            torch.testing.assert_close(c(x), m(x), rtol=0, atol=0)
    state, hooks, classes = _snapshot(m)  # the user's module: bytes, hooks, parametrisations
    assert hooks == before[1] and classes == before[2]
    assert state.keys() == before[0].keys()
    assert all(torch.equal(state[k], before[0][k]) for k in state)
