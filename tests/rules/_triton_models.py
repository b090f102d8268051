"""What the tests of the Triton-kernel rules (the norm rules, activation.swiglu)
share: a tiny Llama from its config captured once, a plan on the h200 target, and the
check that the rewritten model computes what the user's module does at the example's
shapes and at others, without touching the user's module."""

from __future__ import annotations

import copy
from functools import lru_cache

import torch

from opswap.graph.capture import capture
from opswap.models import load
from opswap.planner import apply_plan, make_plan

from ._shapes import assert_same_at_other_shapes


@lru_cache(maxsize=1)
def llama():
    """(the loaded hf:llama, its torch.export capture): 2 layers, hidden 64, float32."""
    lm = load("hf:llama")
    return lm, capture(lm.module, lm.example_inputs, method="export")


def plan(model, inputs, rules, method="fx", target="h200", captured=None):
    """(plan, applied, capture) on `target`; asserts nothing failed, the user's module is
    untouched, and the result matches it at the example's shapes and at others."""
    before = copy.deepcopy(model.state_dict())
    cap = captured if captured is not None else capture(model, inputs, method=method)
    p = make_plan(cap, rules=rules, target=target)
    applied = apply_plan(cap, p)
    assert not p.failed and not applied.failed, (p.failed, applied.failed)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with torch.no_grad():
        ref, out = model(*inputs), applied.gm(*inputs)
    ref = ref[0] if isinstance(ref, (tuple, list)) else ref
    out = out[0] if isinstance(out, (tuple, list)) else out
    assert torch.allclose(ref.float(), out.float(), rtol=1e-2, atol=1e-2)
    assert_same_at_other_shapes(model, cap, applied.gm, rel=2e-2)
    return p, applied, cap


def fired(p, rule: str) -> int:
    return sum(d.rule == rule for d in p.decisions)


def reasons(p, rule: str) -> str:
    return " | ".join(m.reason for m in p.misses if m.rule == rule)


def ops_in(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]
