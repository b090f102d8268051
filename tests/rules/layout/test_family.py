"""The layout family as a whole: every rule registered with the family's settings, and the
rules together on real models.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from opswap.graph import capture, op_kind
from opswap.planner import apply_plan, make_plan
from opswap.rules import registry

from ._helpers import FLAVOURS, NHWC_CPU, _flat, rel_l2


def test_rules_registered():
    names = {r.name for r in registry.select(["layout.*"])}
    files = Path(registry.__file__).parent / "layout"
    assert names == {f"layout.{p.stem}" for p in files.glob("[!_]*.py")}  # one rule per file
    for name in names:
        rule = registry.get(name)
        assert rule.family == "layout" and rule.chapter == 14 and rule.exactness == "exact"
        assert rule.description
    assert registry.get("layout.channels_last").phase == "late"


def _tiny_bert():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return transformers.BertModel(cfg).eval(), (torch.randint(0, 50, (2, 7)),)


def _count_transpose_pairs(gm) -> int:
    return sum(
        1
        for n in gm.graph.nodes
        if op_kind(n) == "transpose"
        and n.args
        and op_kind(n.args[0]) == "transpose"
        and len(n.args[0].users) == 1
    )


@pytest.mark.hf
def test_hf_bert_layout_rules():
    model, inputs = _tiny_bert()
    captured = capture(model, inputs, method="export")
    dropouts = sum(1 for n in captured.gm.graph.nodes if op_kind(n) == "dropout")
    pairs = _count_transpose_pairs(captured.gm)
    assert dropouts == 7 and pairs == 2  # embeddings + 3 per layer; k^T per layer
    plan = make_plan(captured, rules=["layout.*"], target=NHWC_CPU)
    by_rule = {}
    for d in plan.decisions:
        by_rule[d.rule] = by_rule.get(d.rule, 0) + 1
    assert by_rule["layout.drop_dropout"] == dropouts
    assert by_rule["layout.cancel_transpose"] == pairs
    applied = apply_plan(captured, plan)
    assert not applied.failed
    assert not [n for n in applied.gm.graph.nodes if op_kind(n) == "dropout"]
    ids = torch.randint(0, 50, (2, 7))
    for got, want in zip(_flat(applied.gm(ids)), _flat(model(ids)), strict=True):
        assert rel_l2(got, want) <= 1e-5


def test_zoo_bert():
    models = pytest.importorskip("opswap.models")
    try:
        loaded = models.load("zoo:bert")
    except Exception as e:  # the zoo is written by another part of the tree
        pytest.skip(f"zoo:bert not available: {e}")
    for method in FLAVOURS:
        captured = capture(copy.deepcopy(loaded.module), loaded.example_inputs, method=method)
        pairs = _count_transpose_pairs(captured.gm)
        plan = make_plan(captured, rules=["layout.*"], target=NHWC_CPU)
        fired = [d.rule for d in plan.decisions]
        assert fired.count("layout.cancel_transpose") == pairs
        assert any(
            d.site.data.get("identity")
            for d in plan.decisions
            if d.rule == "layout.cancel_transpose"
        )  # encode/forward transposes cancel
        assert fired.count("layout.collapse_view") >= 1  # the view -> reshape per layer
        applied = apply_plan(captured, plan)
        assert not applied.failed
        want = loaded.module(*loaded.example_inputs)
        got = _flat(applied.gm(*loaded.example_inputs))[0]
        assert rel_l2(got, want) <= 1e-5
