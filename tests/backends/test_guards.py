"""backends.guards: a program's guard expressions compiled into one check, and only
when they are size arithmetic."""

from __future__ import annotations

import pytest
import torch

from opswap.backends.guards import compile_guards, refusal


def test_guards_compile_into_one_check_that_names_the_broken_one():
    holds, each = compile_guards(
        [
            "L['x'].size()[1] > 16",
            "L['y'].size()[0] == L['x'].size()[0]",
            "(L['x'].size()[1] - 1) % 2 == 0",
        ],
        ["x", "y"],
    )
    assert holds(torch.zeros(3, 17), torch.zeros(3))
    assert not holds(torch.zeros(3, 18), torch.zeros(3))
    assert not holds(torch.zeros(3, 17), torch.zeros(4))
    text = refusal("m.pt2", (torch.zeros(3, 17), torch.zeros(4)), ["x", "y"], each)
    assert text == (
        "m.pt2: input y has size 4 in dim 0 and input x has size 3 in dim 0, but the "
        "saved program accepts only y.size()[0] == x.size()[0]."
    )


def test_fixed_sizes_the_caller_checks_are_left_out():
    holds, each = compile_guards(["L['x'].size()[1] == 8"], ["x"], frozenset({"x.size()[1] == 8"}))
    assert holds is None and each == []


@pytest.mark.parametrize(
    "code",
    [
        "__import__('os').system('true') == 0",
        "L['x'].size()[0] == open('/etc/passwd') ",
        "L['x'].numpy().size == 1",
        "L['x'].size()[0] == 'a'",
        "L['z'].size()[0] == 1",
        "torch.ops.aten.abs(L['x']) == 1",
        "[c for c in L['x'].size()] == []",
    ],
)
def test_anything_but_size_arithmetic_is_not_compiled(code):
    assert compile_guards([code], ["x"]) is None
