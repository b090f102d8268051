"""Private copies drop the user's hooks; opswap's own runs leave buffers as they were."""

import pytest
import torch
from torch import nn

from opswap.errors import OpswapError
from opswap.graph.copies import count_hooks, preserved_state, private_copy


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
