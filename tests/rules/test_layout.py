"""Chapter 14 layout rules: each fires the expected number of times on a small model in
both capture flavours, keeps outputs equal on fresh inputs, and refuses with a reason
where it must."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opswap.graph import capture, op_kind
from opswap.graph.shapes import propagate
from opswap.rules import registry
from opswap.rules._layout_nhwc import nhwc_strides
from opswap.rules.base import misses_of, sites_of
from opswap.search.plan import apply_plan, make_plan
from opswap.targets import Target

SHAPE = (3, 5, 7, 13)
FLAVOURS = ["fx", "export"]


def _target(layout: str) -> Target:
    return Target(name="cpu", description="test CPU", kind="cpu",
                  peak_flops={"float32": 1e12}, mem_bandwidth=50e9, memory_bytes=0,
                  dtypes=("float32",), layout=layout)


NHWC_CPU = _target("channels_last")
NCHW_CPU = _target("contiguous")


def _flat(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    return [t for o in out for t in _flat(o)]


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _snapshot(model: nn.Module):
    return {k: (v.clone(), v.stride()) for k, v in model.state_dict().items()}, [
        m.training for m in model.modules()]


def run(model, rule, method, inputs=None, target=NHWC_CPU):
    """Plan and apply one rule; check outputs on fresh inputs and that the model is untouched."""
    inputs = inputs or (torch.randn(SHAPE),)
    before = _snapshot(model)
    captured = capture(model, inputs, method=method)
    plan = make_plan(captured, rules=[rule], target=target)
    applied = apply_plan(captured, plan)
    assert not plan.failed and not applied.failed, (plan.failed, applied.failed)
    fresh = tuple(torch.randn_like(t) if t.is_floating_point() else t for t in inputs)
    with torch.no_grad():
        for got, want in zip(_flat(applied.gm(*fresh)), _flat(model(*fresh)), strict=True):
            assert got.shape == want.shape
            assert rel_l2(got, want) <= 1e-5
    after = _snapshot(model)
    assert after[1] == before[1]
    for k, (v, stride) in before[0].items():
        assert torch.equal(after[0][k][0], v) and after[0][k][1] == stride, k
    return plan, applied


def keys(plan) -> list[str]:
    return [d.site.key for d in plan.decisions]


def reasons(plan) -> list[str]:
    return [m.reason for m in plan.misses]


def test_rules_registered():
    names = {r.name for r in registry.select(["layout.*"])}
    assert names == {"layout.cancel_transpose", "layout.collapse_view",
                     "layout.permute_matmul", "layout.drop_dropout", "layout.drop_identity",
                     "layout.channels_last"}
    for name in names:
        rule = registry.get(name)
        assert rule.family == "layout" and rule.chapter == 14 and rule.exactness == "exact"
        assert rule.description
    assert registry.get("layout.channels_last").late


# --------------------------------------------------------------------------- cancel_transpose


class Transposes(nn.Module):
    def forward(self, x):
        a = x.transpose(1, 2).transpose(1, 2)  # cancels
        b = x.permute(0, 2, 3, 1).permute(0, 3, 1, 2)  # cancels
        c = x.transpose(1, 3).permute(0, 2, 1, 3)  # one permute
        t = x.transpose(2, 3)
        d = t.transpose(2, 3) + t.sum()  # t is read twice: refused
        return a + b + d, c


@pytest.mark.parametrize("method", FLAVOURS)
def test_cancel_transpose(method):
    plan, applied = run(Transposes(), "layout.cancel_transpose", method)
    assert keys(plan) == ["transpose+transpose_1", "permute+permute_1", "transpose_2+permute_2"]
    assert [d.site.data["identity"] for d in plan.decisions] == [True, True, False]
    assert reasons(plan) == ["transpose_3's output is also read by sum_1, so transpose_3 and "
                             "transpose_4 cannot be merged"]
    kinds = [op_kind(n) for n in applied.gm.graph.nodes]
    assert kinds.count("permute") == 1 and kinds.count("transpose") == 2
    assert all(d.estimate.bytes_saved == 0 for d in plan.decisions)


# --------------------------------------------------------------------------- collapse_view


class Views(nn.Module):
    def forward(self, x):
        a = x.view(3, 35, 13).reshape(15, 7, 13).flatten(0, 1)  # one reshape
        b = x.reshape(3, 5, 7, 13)  # same shape: removed
        c = x.unsqueeze(0).squeeze(0)  # identity chain: removed
        d = x.view(x.size(0), 35, 13).unsqueeze(1)  # FX: size read at run time
        e = x.flatten(2).view(x.size(0), -1)  # the last op spells the shape: fine
        return a, b + c, d, e


@pytest.mark.parametrize("method", FLAVOURS)
def test_collapse_view(method):
    plan, applied = run(Views(), "layout.collapse_view", method)
    common = ["view+reshape+flatten", "reshape_1", "unsqueeze+squeeze", "flatten_1+view_2"]
    if method == "fx":
        assert keys(plan) == common
        assert len(plan.misses) == 1 and plan.misses[0].where == "unsqueeze_1"
        assert "a size read at run time" in plan.misses[0].reason
    else:  # torch.export fixed x.size(0) to 3 when it traced, so d collapses too
        assert sorted(keys(plan)) == sorted([*common, "view_1+unsqueeze_1"])
        assert not plan.misses
    shape_ops = [n for n in applied.gm.graph.nodes
                 if op_kind(n) in ("view", "reshape", "flatten", "squeeze")]
    assert len(shape_ops) == (4 if method == "fx" else 3)


# --------------------------------------------------------------------------- permute_matmul


class Matmuls(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(11, 13))
        self.w2 = nn.Parameter(torch.randn(11, 13))
        self.w3 = nn.Parameter(torch.randn(5, 11, 13))

    def forward(self, x):
        y = x @ self.w.t()  # -> linear
        z = torch.matmul(x, self.w2.transpose(0, 1))  # -> linear
        u = torch.matmul(x, self.w3.transpose(1, 2))  # batched constant: stored permuted
        v = torch.matmul(x.transpose(2, 3).contiguous(), x)  # contiguous dropped
        w = torch.matmul(x.transpose(1, 2).contiguous(), x[0, 0].t())  # matmul would copy
        return y, z, u, v, w


@pytest.mark.parametrize("method", FLAVOURS)
def test_permute_matmul(method):
    plan, applied = run(Matmuls(), "layout.permute_matmul", method)
    assert keys(plan) == ["linear:matmul", "linear:matmul_1", "pretranspose:transpose_1",
                          "contiguous:contiguous"]
    assert len(plan.misses) == 1 and plan.misses[0].where == "contiguous_1"
    assert "torch.matmul would copy transpose_3 itself" in plan.misses[0].reason
    gm = applied.gm
    kinds = [op_kind(n) for n in gm.graph.nodes]
    assert kinds.count("linear") == 2 and kinds.count("contiguous") == 1
    assert not hasattr(gm, "w3") and gm.w3_permuted.is_contiguous()
    # the dropped copy saves writing and re-reading x^T: 2 x 4 bytes x numel
    saved = {d.site.key: d.estimate.bytes_saved for d in plan.decisions}
    assert saved["contiguous:contiguous"] == 2 * 4 * torch.Size(SHAPE).numel()


# --------------------------------------------------------------------------- drop_dropout


class Dropouts(nn.Module):
    def __init__(self):
        super().__init__()
        self.drop1 = nn.Dropout(0.2)
        self.block = nn.Sequential(nn.Linear(13, 13), nn.Dropout(0.3))
        self.drop2d = nn.Dropout2d(0.1)

    def forward(self, x):
        y = self.block(self.drop1(x))
        y = F.dropout(y, 0.5, training=self.training)
        return F.dropout(self.drop2d(y), 0.0) + 1  # p = 0 is removed even in training


@pytest.mark.parametrize("method", FLAVOURS)
def test_drop_dropout(method):
    plan, applied = run(Dropouts().eval(), "layout.drop_dropout", method)
    assert len(plan.decisions) == 5 and not plan.misses
    assert not [n for n in applied.gm.graph.nodes if op_kind(n) == "dropout"]


@pytest.mark.parametrize("method", FLAVOURS)
def test_drop_dropout_refuses_training_mode(method):
    model = Dropouts().eval()
    model.drop1.train()
    captured = capture(model, (torch.randn(SHAPE),), method=method)
    plan = make_plan(captured, rules=["layout.drop_dropout"], target=NHWC_CPU)
    assert len(plan.decisions) == 4
    assert len(plan.misses) == 1
    assert plan.misses[0].reason.startswith("Dropout drop1 is in training mode")
    applied = apply_plan(captured, plan)
    x = torch.randn(SHAPE)
    torch.manual_seed(0)
    want = model(x)
    torch.manual_seed(0)  # the dropout kept draws the same mask from the same generator
    assert torch.equal(_flat(applied.gm(x))[0], want)


# --------------------------------------------------------------------------- drop_identity


class Identities(nn.Module):
    def __init__(self):
        super().__init__()
        self.idn = nn.Identity()
        self.lin = nn.Linear(13, 13)

    def forward(self, x):
        y = self.lin(self.idn(x)).contiguous()  # already contiguous
        z = x.transpose(1, 2).contiguous()  # a real copy: refused
        w = x.contiguous()  # the caller chooses x's strides: refused
        c = (y * 2).clone()  # nothing writes into it: removed
        t = c.to(torch.float32).float()  # same dtype twice
        a = torch.ops.aten.alias(t)
        return a + 1, z, w, x.clone()  # returning x.clone(): refused


@pytest.mark.parametrize("method", FLAVOURS)
def test_drop_identity(method):
    plan, applied = run(Identities(), "layout.drop_identity", method)
    if method == "fx":
        assert keys(plan) == ["idn", "contiguous", "clone", "to", "float_1", "alias"]
    else:  # torch.export already dropped the Identity and the no-op contiguous calls
        assert keys(plan) == ["clone", "to", "to_1", "alias"]
    why = reasons(plan)
    assert any("is not contiguous" in r and "real copy" in r for r in why)
    assert any("would share memory with x" in r for r in why)
    if method == "fx":
        assert any("lays out the model input x" in r for r in why)
    clone = next(d for d in plan.decisions if d.site.key == "clone")
    assert clone.estimate.bytes_saved == 2 * 4 * 3 * 5 * 7 * 13
    x = torch.randn(SHAPE)
    assert _flat(applied.gm(x))[3].data_ptr() != x.data_ptr()  # the kept clone still copies


@pytest.mark.parametrize("method", FLAVOURS)
def test_drop_identity_refuses_in_place_writes(method):
    class Writes(nn.Module):
        def forward(self, x):
            y = (x * 2).clone()
            y.add_(1)
            return y

    captured = capture(Writes(), (torch.randn(SHAPE),), method=method)
    found = registry.get("layout.drop_identity").match(captured.gm)
    assert not sites_of(found)
    assert "writes into tensors in place" in misses_of(found)[0].reason


def test_drop_identity_refuses_unknown_strides():
    class Copy(nn.Module):
        def forward(self, x):
            return (x * 2).contiguous() + 1

    captured = capture(Copy(), (torch.randn(SHAPE),), method="fx")
    mul = next(n for n in captured.gm.graph.nodes if n.name == "mul")
    del mul.meta["tensor_meta"]
    found = registry.get("layout.drop_identity").match(captured.gm)
    assert not sites_of(found)
    assert misses_of(found)[0].reason == ("the strides of mul are not known, so contiguous "
                                          "cannot be shown to be a no-op")


# --------------------------------------------------------------------------- channels_last


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(5, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 6, 3)
        self.fc = nn.Linear(6 * 5 * 11, 4)

    def forward(self, x):
        f = F.relu(self.bn(self.c1(x)))
        g = self.c2(f)
        return self.fc(g.view(g.size(0), -1)), g  # a .view of a 4-D activation, and a 4-D output


def _conv_weights(gm) -> list[torch.Tensor]:
    out = []
    for n in gm.graph.nodes:
        if op_kind(n) == "conv":
            out.append(gm.get_submodule(n.target).weight if n.op == "call_module"
                       else gm.get_parameter(n.args[1].target))
    return out


@pytest.mark.parametrize("method", FLAVOURS)
def test_channels_last(method):
    model = SmallCNN().eval()
    plan, applied = run(model, "layout.channels_last", method)
    assert keys(plan) == ["model"] and plan.decisions[0].estimate.time_saved_s > 0
    gm = applied.gm
    x = torch.randn(SHAPE)
    propagate(gm, (x,))
    convs = [n for n in gm.graph.nodes if op_kind(n) == "conv"]
    assert len(convs) == 2
    for n in convs:  # strides of a real run: NHWC, C innermost
        meta = n.meta["tensor_meta"]
        assert nhwc_strides(meta.shape, meta.stride) and meta.stride[1] == 1
    for w in _conv_weights(gm):
        assert w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous()
    logits, fmap = gm(x)
    assert fmap.is_contiguous()  # converted back at the output
    assert model.c1.weight.is_contiguous() and model.c2.weight.is_contiguous()


def test_channels_last_refuses_model_without_convs():
    mlp = nn.Sequential(nn.Linear(13, 7), nn.ReLU())
    captured = capture(mlp, (torch.randn(SHAPE),), method="fx")
    found = registry.get("layout.channels_last").match(captured.gm)
    assert not sites_of(found)
    assert "no 2-D convolution" in misses_of(found)[0].reason


def test_channels_last_skipped_where_nchw_is_preferred():
    captured = capture(SmallCNN().eval(), (torch.randn(SHAPE),), method="fx")
    plan = make_plan(captured, rules=["layout.channels_last"], target=NCHW_CPU)
    assert not plan.decisions
    assert len(plan.skipped) == 1 and "prefers contiguous" in plan.skipped[0]["reason"]


def test_channels_last_rolls_back_when_a_view_breaks():
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Conv2d(5, 4, 3)

        def forward(self, x):
            # NCHW: flatten(2) then view is fine; NHWC: the C and H*W strides do not merge
            return self.c(x).flatten(2).view(3, -1)

    model = Flat().eval()
    captured = capture(model, (torch.randn(SHAPE),), method="fx")
    plan = make_plan(captured, rules=["layout.channels_last"], target=NHWC_CPU)
    assert not plan.decisions
    assert len(plan.failed) == 1 and "no longer runs" in plan.failed[0].reason
    assert all(w.is_contiguous() for w in _conv_weights(captured.gm))


# --------------------------------------------------------------------------- real models


def _tiny_bert():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=32,
                                  max_position_embeddings=32, attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.BertModel(cfg).eval(), (torch.randint(0, 50, (2, 7)),)


def _count_transpose_pairs(gm) -> int:
    return sum(1 for n in gm.graph.nodes
               if op_kind(n) == "transpose" and n.args and op_kind(n.args[0]) == "transpose"
               and len(n.args[0].users) == 1)


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
        assert any(d.site.data.get("identity") for d in plan.decisions
                   if d.rule == "layout.cancel_transpose")  # encode/forward transposes cancel
        assert fired.count("layout.collapse_view") >= 1  # the view -> reshape per layer
        applied = apply_plan(captured, plan)
        assert not applied.failed
        want = loaded.module(*loaded.example_inputs)
        got = _flat(applied.gm(*loaded.example_inputs))[0]
        assert rel_l2(got, want) <= 1e-5
