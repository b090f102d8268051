"""The fusion family as a whole: every rule registered with the family's settings, the rules
together on the zoo's ResNet and BERT, and on random graphs mixing their patterns.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from opswap.rules import registry

from ._helpers import (
    METHOD,
    METHODS,
    SETTINGS,
    TOL,
    _eval_bn,
    _first,
    count,
    fired,
    optimize,
    rel_l2,
    run,
)


def test_rules_are_registered_exact_chapter_4():
    names = {r.name for r in registry.select("fusion.*")}
    files = Path(registry.__file__).parent / "fusion"
    assert names == {f"fusion.{p.stem}" for p in files.glob("[!_]*.py")}  # one rule per file
    big_ops = {"fusion.parallel_conv", "fusion.batch_matmul"}  # chapter 5: big ops for small
    for r in registry.select("fusion.*"):
        chapter = 5 if r.name in big_ops else 4
        assert (r.family, r.chapter, r.exactness) == ("fusion", chapter, "exact")
        assert r.description


def _zoo(name):
    from opswap.models import load

    return load(f"zoo:{name}")


@pytest.mark.parametrize("method", METHODS)
def test_zoo_resnet(method):
    lm = _zoo("resnet")
    pairs = sum(isinstance(m, nn.BatchNorm2d) for m in lm.module.modules())  # each after a conv
    plan, applied = optimize(lm.module, lm.example_inputs, ["fusion.*"], method)
    assert fired(plan, "fusion.conv_bn") == pairs == 8
    assert fired(plan, "fusion.conv_relu") == 4
    assert fired(plan, "fusion.linear_bn") == 1
    x = torch.randn_like(lm.example_inputs[0])
    with torch.no_grad():
        assert rel_l2(lm.module(x), _first(applied.gm(x))) <= TOL


@pytest.mark.parametrize("method", METHODS)
def test_zoo_bert(method):
    lm = _zoo("bert")
    layers = len(lm.module.layers)
    plan, applied = optimize(lm.module, lm.example_inputs, ["fusion.*"], method)
    assert fired(plan, "fusion.layer_norm") == 2 * layers + 1
    assert fired(plan, "fusion.parallel_linear") == layers
    assert fired(plan, "fusion.matmul_add") == 1
    assert fired(plan, "fusion.log_softmax") == 1
    ids = torch.randint_like(lm.example_inputs[0], 0, 1000)
    with torch.no_grad():
        assert rel_l2(lm.module(ids), _first(applied.gm(ids))) <= TOL


def _block(kind: str, h: int) -> tuple[nn.Module, dict[str, int]]:
    """A [B, S, h] -> [B, S, h] block holding one pattern, and what it should fire."""

    class B(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(h, h) / h**0.5)
            self.b = nn.Parameter(torch.randn(h))
            self.q, self.k = nn.Linear(h, h), nn.Linear(h, h, bias=False)
            self.g = nn.Parameter(1 + 0.1 * torch.randn(h))

        def forward(self, x):
            if kind == "matmul_add":
                return x @ self.w + self.b
            if kind == "parallel_linear":
                return self.q(x) * torch.sigmoid(self.k(x))
            if kind == "layer_norm":
                m = x.mean(-1, keepdim=True)
                return (x - m) / torch.sqrt(((x - m) ** 2).mean(-1, keepdim=True) + 1e-5) * self.g
            return torch.log(torch.softmax(x, -1))

    fires = {
        "matmul_add": {"fusion.matmul_add": 1},
        "parallel_linear": {"fusion.parallel_linear": 1},
        "layer_norm": {"fusion.layer_norm": 1},
        "log_softmax": {"fusion.log_softmax": 1},
    }
    return B(), fires[kind]


@SETTINGS
@given(
    kinds=st.lists(
        st.sampled_from(["matmul_add", "parallel_linear", "layer_norm", "log_softmax"]),
        min_size=1,
        max_size=5,
    ),
    h=st.integers(2, 12),
    b=st.integers(1, 3),
    s=st.integers(1, 6),
    method=METHOD,
)
def test_random_sequence_graphs_keep_outputs(kinds, h, b, s, method):
    blocks, expect = [], {}
    for kind in kinds:
        m, fires = _block(kind, h)
        blocks.append(m)
        for r, n in fires.items():
            expect[r] = expect.get(r, 0) + n
    plan, err = run(nn.Sequential(*blocks).eval(), (torch.randn(b, s, h),), ["fusion.*"], method)
    assert err <= TOL
    for rule, n in expect.items():
        assert count(plan, rule) == n, (rule, [d.site.key for d in plan.decisions])
    assert len(plan.decisions) == sum(expect.values())


@SETTINGS
@given(
    layers=st.lists(
        st.tuples(st.integers(1, 6), st.sampled_from([1, 3]), st.booleans(), st.booleans()),
        min_size=1,
        max_size=4,
    ),
    cin=st.integers(1, 5),
    size=st.integers(5, 9),
    method=METHOD,
)
def test_random_cnn_graphs_keep_outputs(layers, cin, size, method):
    mods, bns, relus = [], 0, 0
    c = cin
    for cout, k, bn, relu in layers:
        mods.append(nn.Conv2d(c, cout, k, padding=k // 2))
        if bn:
            mods.append(_eval_bn(nn.BatchNorm2d, cout))
            bns += 1
        if relu:
            mods.append(nn.ReLU())
            relus += 1
        c = cout
    plan, err = run(
        nn.Sequential(*mods).eval(), (torch.randn(2, cin, size, size + 2),), ["fusion.*"], method
    )
    assert err <= TOL
    assert count(plan, "fusion.conv_bn") == bns
    assert count(plan, "fusion.conv_relu") == relus
