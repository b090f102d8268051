"""What the tests of the GELU/SiLU approximations and the Linear epilogue share: a plan
and its application checked against the user's module (untouched) at the example's
shapes and at other batch sizes and lengths, the worst absolute and relative error
returned; a tiny BERT from its config, captured once; and BERT's MLP block alone, which
FX can trace (the whole HF BERT does not trace: its embeddings slice by a tensor)."""

from __future__ import annotations

import copy
from functools import cache

import torch
from torch import nn
from torch.utils import _pytree as pytree

from opswap.graph.capture import capture
from opswap.models import load
from opswap.planner import apply_plan, make_plan

from .._shapes import other_shapes


def _err(want, got) -> tuple[float, float]:
    """(max abs, rel L2) over every floating output."""
    worst_abs = worst_rel = 0.0
    for w, g in zip(pytree.tree_leaves(want), pytree.tree_leaves(got), strict=True):
        assert g.shape == w.shape, (g.shape, w.shape)
        if w.is_floating_point():
            d = (g.double() - w.double()).abs()
            worst_abs = max(worst_abs, d.max().item())
            worst_rel = max(worst_rel, (d.norm() / w.double().norm().clamp_min(1e-30)).item())
    return worst_abs, worst_rel


def run(model, inputs, rules, method="fx", target="h200", exactness="exact", captured=None):
    """(plan, applied, max abs, rel L2): the rules planned and applied; the errors are the
    worst against the user's module over the example and two other sizes of each
    dynamic axis. Asserts nothing failed and that the user's module is untouched."""
    model.eval()
    before = copy.deepcopy(model.state_dict())
    cap = captured if captured is not None else capture(model, inputs, method=method)
    plan = make_plan(cap, rules=rules, target=target, exactness=exactness)
    applied = apply_plan(cap, plan)
    assert not plan.failed and not applied.failed, (plan.failed, applied.failed)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    shapes = [("example", inputs), *other_shapes(cap)]
    assert len(shapes) >= 3, "the capture claims no dynamic axis"
    worst_abs = worst_rel = 0.0
    for _, xs in shapes:
        with torch.no_grad():
            a, r = _err(model(*xs), applied.gm(*xs))
        worst_abs, worst_rel = max(worst_abs, a), max(worst_rel, r)
    return plan, applied, worst_abs, worst_rel


def fired(plan, rule: str) -> int:
    return sum(d.rule == rule for d in plan.decisions)


def reasons(plan, rule: str) -> str:
    return " | ".join(m.reason for m in plan.misses if m.rule == rule)


def skipped(plan, rule: str) -> str:
    return " | ".join(s.reason for s in plan.skipped if s.rule == rule)


def calls(gm, target) -> int:
    return sum(n.target is target for n in gm.graph.nodes)


@cache
def bert(**overrides: str):
    """(hf:bert with one layer, its capture): torch.export, since FX cannot trace it."""
    lm = load("hf:bert", {"num_hidden_layers": "1", **overrides})
    return lm, capture(lm.module, lm.example_inputs)


class BertMLP(nn.Module):
    """HF BERT's MLP block (BertIntermediate: dense + the config's activation; BertOutput:
    dense, dropout, LayerNorm of the residual), as its encoder layer calls it."""

    def __init__(self, layer):
        super().__init__()
        self.intermediate, self.output = layer.intermediate, layer.output

    def forward(self, x):
        return self.output(self.intermediate(x), x)


def bert_mlp(**overrides: str) -> tuple[nn.Module, tuple]:
    lm, _ = bert(**overrides)
    layer = copy.deepcopy(lm.module.model.encoder.layer[0]).eval()
    hidden = lm.module.model.config.hidden_size
    torch.manual_seed(0)
    return BertMLP(layer).eval(), (torch.randn(2, 9, hidden),)
