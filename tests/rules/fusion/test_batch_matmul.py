"""fusion.batch_matmul: independent matmuls of equal shapes become one batched matmul;
dependent ones, mixed shapes and mixed dtypes stay apart (the last with a reason)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from opswap.graph.capture import capture
from opswap.planner import Plan, apply_plan, make_plan

from .._shapes import assert_same_at_other_shapes
from ._helpers import METHODS, count, reasons_text, rel_l2

RULE = "fusion.batch_matmul"


def _apply(model: nn.Module, inputs: tuple, method: str = "fx"):
    """Plan (keeping sites predicted slower: this checks the rewrite) and apply; the result
    matches the model at the example, at fresh inputs and at other batch sizes."""
    cap = capture(model, inputs, method=method)
    plan = make_plan(cap, rules=[RULE], keep_slower=True)
    applied = apply_plan(cap, plan)
    assert not plan.failed and not applied.failed, (plan.failed, applied.failed)
    fresh = tuple(torch.randn_like(t) for t in inputs)
    with torch.no_grad():
        want, got = model(*fresh), applied.gm(*fresh)
    for w, g in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,), strict=True):  # fmt: skip
        assert w.shape == g.shape and rel_l2(w, g) <= 1e-6
    assert_same_at_other_shapes(model, cap, applied.gm, rel=1e-5)
    return plan, applied


class Heads(nn.Module):
    """Per-head scores of an unrolled loop: q_h @ k_h^T for 3 heads (independent, batched;
    were the heads' slices cut, or head 1's score scaled in place, between the products,
    they would not be), then each scaled in place and softmaxed;
    softmax(s_h) @ k_h (a second group); and a per-branch product with a constant weight
    expanded over the batch. A BatchNorm (buffers) in front."""

    def __init__(self, d: int = 6, heads: int = 3):
        super().__init__()
        self.heads, self.d = heads, d
        self.norm = nn.BatchNorm1d(heads * d).eval()
        with torch.no_grad():
            self.norm.running_mean.uniform_(-1, 1)
        self.w = nn.ParameterList(nn.Parameter(torch.randn(d, 5)) for _ in range(heads))

    def forward(self, q, k):  # q, k: [B, S, H * d]
        q = self.norm(q.transpose(1, 2)).transpose(1, 2)
        d = self.d
        qs = [q[..., h * d : (h + 1) * d] for h in range(self.heads)]
        ks = [k[..., h * d : (h + 1) * d] for h in range(self.heads)]
        kts = [kh.transpose(1, 2) for kh in ks]
        scores = [torch.matmul(qs[h], kts[h]) for h in range(self.heads)]
        outs, branch = [], []
        for h in range(self.heads):
            s = scores[h].mul_(0.5)  # in place, after the batched matmul
            outs.append(torch.softmax(s, -1) @ ks[h])
            branch.append(qs[h] @ self.w[h].expand(qs[h].shape[0], -1, -1))
        return torch.cat(outs, -1), torch.cat(branch, -1)


@pytest.mark.parametrize("method", METHODS)
def test_batch_matmul_batches_unrolled_heads(method):
    model = Heads().eval()
    plan, _ = _apply(model, (torch.randn(2, 7, 18), torch.randn(2, 7, 18)), method)
    sizes = sorted(len(d.site.data["members"]) for d in plan.decisions)
    assert sizes == [3, 3, 3], [d.site.description for d in plan.decisions]


class Branches(nn.Module):
    """x_i @ W_i per branch, W_i constant and of one shape; and one of another shape."""

    def __init__(self):
        super().__init__()
        self.w = nn.ParameterList(nn.Parameter(torch.randn(9, 4)) for _ in range(4))
        self.other = nn.Parameter(torch.randn(9, 3))

    def forward(self, x):  # x: [4, M, 9]
        ys = [x[i] @ self.w[i] for i in range(4)]
        return torch.cat(ys, -1), x[0] @ self.other


def test_batch_matmul_stacks_constant_weights_once_and_leaves_other_shapes():
    model = Branches().eval()
    plan, applied = _apply(model, (torch.randn(4, 11, 9),))
    (d,) = plan.decisions
    assert len(d.site.data["members"]) == 4 and d.site.data["b"] == [9, 4]
    stacked = [t for n, t in applied.gm.named_parameters() if t.shape == (4, 9, 4)]
    assert len(stacked) == 1  # the weights, stacked at rewrite
    kinds = [n.target for n in applied.gm.graph.nodes if n.op == "call_function"]
    assert kinds.count(torch.stack) == 1  # only the left operands are stacked at run time
    assert "stack" in d.estimate.note


class Ranks(nn.Module):
    """[N, 3, M, 6] slices @ a constant [6, 5] weight each, and [M, 6] @ [N, 6, 4] with the
    right operand computed at run time: operands of different ranks broadcast as before."""

    def __init__(self):
        super().__init__()
        self.w = nn.ParameterList(nn.Parameter(torch.randn(6, 5)) for _ in range(3))

    def forward(self, x, y, z):  # x: [N, 9, M, 6], y: [M, 6], z: [N, 6, 12]
        xs = torch.chunk(x, 3, 1)
        zs = [z[..., 4 * i : 4 * (i + 1)].relu() for i in range(3)]
        a = torch.cat([xs[i] @ self.w[i] for i in range(3)], 1)
        b = torch.cat([(y * (i + 1)) @ zs[i] for i in range(3)], -1)
        return a.sum((1, 3)), b.sum(-2)


@pytest.mark.parametrize("method", METHODS)
def test_batch_matmul_keeps_broadcasts_of_lower_rank_operands(method):
    inputs = (torch.randn(2, 9, 7, 6), torch.randn(7, 6), torch.randn(2, 6, 12))
    plan, _ = _apply(Ranks().eval(), inputs, method)
    # x's dim 1 is claimed dynamic: at 10 channels chunk gives 4, 4, 2, so the last slice's
    # product differs in shape there and stays apart
    assert sorted(len(d.site.data["members"]) for d in plan.decisions) == [2, 3]


def test_batch_matmul_leaves_chains_and_refuses_mixed_dtypes():
    class Mixed(nn.Module):
        def forward(self, a, b, c, d):
            chain = (a @ b) @ b  # the second reads the first: not batched
            return chain, c @ d, (c.double() @ d.double()).float()

    x = torch.randn(3, 3)
    cap = capture(Mixed(), (x, torch.randn(3, 3), torch.randn(2, 4, 5), torch.randn(2, 5, 6)))
    plan = make_plan(cap, rules=[RULE], keep_slower=True)
    assert count(plan, RULE) == 0
    why = reasons_text(plan, RULE)
    assert "float64" in why and "same dtypes" in why and "." not in why


def test_batch_matmul_refuses_an_in_place_write_between_members():
    class Between(nn.Module):
        def forward(self, a, b, c):
            y1 = a @ b
            a.add_(1)  # the batched matmul would read a after this
            y2 = c @ b
            return y1 + y2

    cap = capture(Between(), (torch.randn(4, 5), torch.randn(5, 3), torch.randn(4, 5)))
    plan = make_plan(cap, rules=[RULE], keep_slower=True)
    assert count(plan, RULE) == 0 and "in place" in reasons_text(plan, RULE)


def test_batch_matmul_plan_round_trips_at_batch_one():
    model = Branches().eval()
    x = torch.randn(4, 1, 9)
    cap = capture(model, (x,))
    plan = make_plan(cap, rules=[RULE], keep_slower=True)
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    applied = apply_plan(capture(model, (x,)), again)
    assert count(again, RULE) == 1 and not applied.failed
    z = torch.randn(4, 1, 9)
    with torch.no_grad():
        for w, g in zip(model(z), applied.gm(z), strict=True):
            torch.testing.assert_close(g, w)
