"""The zoo: every model builds, runs, traces, is deterministic, and holds its documented patterns."""

from __future__ import annotations

import math

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from opswap.errors import SpecError
from opswap.graph import capture, op_kind
from opswap.models import list_zoo, load
from opswap.models.zoo_transformer import DecomposedLayerNorm, HandRMSNorm

ZOO_NAMES = [e.name for e in list_zoo()]


# --------------------------------------------------------------------------- helpers


def graph_of(spec: str, **overrides):
    loaded = load(spec, {k: str(v) for k, v in overrides.items()})
    return loaded, capture(loaded.module, loaded.example_inputs)


def kinds(gm: fx.GraphModule) -> list[str]:
    return [op_kind(n) for n in gm.graph.nodes]


def count(gm: fx.GraphModule, kind: str) -> int:
    return kinds(gm).count(kind)


def chains(gm: fx.GraphModule, *path: str) -> int:
    """Number of node chains whose kinds are `path`, each node the sole user of the one before."""
    found = 0
    for node in gm.graph.nodes:
        if op_kind(node) != path[0]:
            continue
        cur = node
        for kind in path[1:]:
            users = list(cur.users)
            if len(users) != 1 or op_kind(users[0]) != kind:
                break
            cur = users[0]
        else:
            found += 1
    return found


def fan_out(gm: fx.GraphModule, kind: str, n: int) -> int:
    """Number of nodes read by at least `n` nodes of `kind` (e.g. 3 linears: a QKV site)."""
    return sum(1 for node in gm.graph.nodes if sum(op_kind(u) == kind for u in node.users) >= n)


def submodule(gm: fx.GraphModule, node: fx.Node) -> nn.Module:
    return gm.get_submodule(str(node.target))


def fresh_like(inputs: tuple[torch.Tensor, ...], gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """New random inputs with the shapes and dtypes of `inputs` (ids stay below their max + 1)."""
    out = []
    for t in inputs:
        if t.is_floating_point():
            out.append(torch.randn(t.shape, generator=gen))
        else:
            out.append(torch.randint(0, int(t.max()) + 1, t.shape, generator=gen))
    return tuple(out)


# --------------------------------------------------------------------------- every model


def test_list_zoo_names_and_metadata():
    assert ZOO_NAMES == [
        "resnet",
        "mobilenet",
        "bert",
        "gpt",
        "seq",
        "recsys",
        "largekernel",
        "longconv",
        "digits_mlp",
        "digits_cnn",
    ]
    for entry in list_zoo():
        assert entry.description
        assert entry.chapters and all(1 <= c <= 30 for c in entry.chapters)
        assert "Patterns" in entry.patterns
        assert "seed" in entry.defaults and "batch" in entry.defaults


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_builds_runs_and_is_finite(name):
    loaded = load(f"zoo:{name}")
    assert loaded.source == "zoo" and loaded.name == name and loaded.spec == f"zoo:{name}"
    assert isinstance(loaded.example_inputs, tuple)
    assert all(isinstance(t, torch.Tensor) for t in loaded.example_inputs)
    assert not any(m.training for m in loaded.module.modules())
    with torch.no_grad():
        out = loaded.module(*loaded.example_inputs)
    # forward time is measured by benchmarks/bench_zoo.py, not asserted here
    assert torch.isfinite(out).all()
    assert out.std() > 1e-4, "output does not depend on anything"


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_symbolic_trace_matches_eager(name):
    loaded = load(f"zoo:{name}")
    traced = fx.symbolic_trace(loaded.module)
    captured = capture(loaded.module, loaded.example_inputs)
    assert captured.method == "fx"
    gen = torch.Generator().manual_seed(1234)
    for _ in range(2):
        inputs = fresh_like(loaded.example_inputs, gen)
        with torch.no_grad():
            ref = loaded.module(*inputs)
            torch.testing.assert_close(traced(*inputs), ref)
            torch.testing.assert_close(captured.gm(*inputs), ref)


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_deterministic_and_seeded(name):
    a, b = load(f"zoo:{name}"), load(f"zoo:{name}")
    for (ka, va), (kb, vb) in zip(
        a.module.state_dict().items(), b.module.state_dict().items(), strict=True
    ):
        assert ka == kb
        assert torch.equal(va, vb), ka
    for x, y in zip(a.example_inputs, b.example_inputs, strict=True):
        assert torch.equal(x, y)
    c = load(f"zoo:{name}", {"seed": "7"})
    differs = [
        not torch.equal(va, vc)
        for va, vc in zip(
            a.module.state_dict().values(), c.module.state_dict().values(), strict=True
        )
        if va.is_floating_point()
    ]
    assert any(differs)


def test_loading_does_not_disturb_global_rng():
    torch.manual_seed(99)
    expected = torch.rand(3)
    torch.manual_seed(99)
    load("zoo:resnet")
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize(
    "name, overrides, input_shapes, output_shape",
    [
        ("resnet", {"batch": 3, "image_size": 40, "num_classes": 7}, [(3, 3, 40, 40)], (3, 7)),
        ("mobilenet", {"batch": 1, "image_size": 48, "width": 8}, [(1, 3, 48, 48)], (1, 10)),
        ("bert", {"seq": 17, "hidden": 48, "heads": 3, "num_labels": 5}, [(2, 17)], (2, 5)),
        ("gpt", {"batch": 3, "seq": 9, "vocab": 301}, [(3, 9)], (3, 9, 301)),
        ("seq", {"batch": 2, "seq": 7, "features": 5}, [(2, 7, 5)], (2, 5)),
        (
            "recsys",
            {"batch": 3, "tag_bag": 5, "dense_features": 6},
            [(3,), (3,), (3, 4), (3, 5), (3, 6)],
            (3, 1),
        ),
        ("largekernel", {"image_size": 45, "num_classes": 4}, [(2, 3, 45, 45)], (2, 4)),
        (
            "longconv",
            {"batch": 3, "length": 50, "kernel": 63, "width": 6, "in_channels": 2},
            [(3, 2, 50)],
            (3, 10),
        ),
    ],
)
def test_overrides_change_shapes(name, overrides, input_shapes, output_shape):
    loaded = load(f"zoo:{name}", {k: str(v) for k, v in overrides.items()})
    assert [tuple(t.shape) for t in loaded.example_inputs] == input_shapes
    with torch.no_grad():
        assert tuple(loaded.module(*loaded.example_inputs).shape) == output_shape
    for key, value in overrides.items():
        assert loaded.settings[key] == value
    fx.symbolic_trace(loaded.module)


def test_override_errors_name_the_problem():
    with pytest.raises(SpecError, match=r"Unknown override 'depth'.*batch.*image_size.*width"):
        load("zoo:resnet", {"depth": "3"})
    with pytest.raises(SpecError, match="batch for zoo:resnet must be an integer"):
        load("zoo:resnet", {"batch": "two"})
    with pytest.raises(SpecError, match="at least 1"):
        load("zoo:mobilenet", {"width": "0"})
    with pytest.raises(SpecError, match="must be true or false"):
        load("zoo:gpt", {"tie_embeddings": "3"})
    with pytest.raises(SpecError, match="max_positions"):
        load("zoo:bert", {"seq": "200"})
    with pytest.raises(SpecError, match="multiple of heads"):
        load("zoo:bert", {"hidden": "50"})
    with pytest.raises(SpecError, match="at least 32"):
        load("zoo:largekernel", {"image_size": "16"})
    with pytest.raises(SpecError, match="kernel for zoo:longconv must be odd"):
        load("zoo:longconv", {"kernel": "64"})


def test_float_override_accepts_int_text():
    loaded = load("zoo:bert", {"dropout": "0"})
    assert loaded.settings["dropout"] == 0.0 and isinstance(loaded.settings["dropout"], float)


# --------------------------------------------------------------------------- patterns


def test_resnet_patterns():
    loaded, cap = graph_of("zoo:resnet")
    gm = cap.gm
    assert chains(gm, "conv", "batch_norm") == 8
    assert chains(gm, "conv", "batch_norm", "relu") == 4
    assert chains(gm, "add", "relu") == 3
    assert chains(gm, "linear", "batch_norm") == 1
    assert chains(gm, "adaptive_avg_pool", "flatten") == 1
    strided = [
        n for n in gm.graph.nodes if op_kind(n) == "conv" and submodule(gm, n).stride == (2, 2)
    ]
    assert len(strided) == 2  # the block's first conv and its downsample shortcut
    assert [op_kind(n) for n in gm.graph.nodes][-2] == "linear"
    for m in loaded.module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            assert (m.running_var > 0).all()
            assert not torch.allclose(m.running_var, torch.ones_like(m.running_var))
            assert m.running_mean.abs().max() > 0.05


def test_mobilenet_patterns():
    _, cap = graph_of("zoo:mobilenet")
    gm = cap.gm
    assert chains(gm, "conv", "batch_norm") == 11
    assert chains(gm, "conv", "batch_norm", "relu6") == 3
    assert chains(gm, "conv", "batch_norm", "hardswish") == 5
    depthwise = [
        n
        for n in gm.graph.nodes
        if op_kind(n) == "conv" and submodule(gm, n).groups == submodule(gm, n).in_channels > 1
    ]
    assert len(depthwise) == 3
    assert all(submodule(gm, n).kernel_size == (3, 3) for n in depthwise)
    assert chains(gm, "adaptive_avg_pool", "conv", "relu", "conv", "hardsigmoid", "mul") == 2
    assert count(gm, "add") == 2


def test_bert_patterns():
    _, cap = graph_of("zoo:bert")
    gm = cap.gm
    assert fan_out(gm, "linear", 3) == 2  # query, key, value read one node, per layer
    assert count(gm, "layer_norm") == 0 and count(gm, "gelu") == 0
    assert count(gm, "erf") == 2
    assert chains(gm, "erf", "add", "mul") == 2
    # decomposed LayerNorm: sqrt(var + eps) feeding a div, 2 per layer + embeddings
    assert chains(gm, "add", "sqrt", "div", "mul", "add") == 5
    assert count(gm, "mean") == 10
    assert chains(gm, "matmul", "div", "softmax", "dropout", "matmul") == 2
    assert chains(gm, "softmax", "log") == 1
    assert chains(gm, "view", "reshape", "linear") == 2
    # the pooler: x @ w + b on raw parameters
    raw = [
        n
        for n in gm.graph.nodes
        if op_kind(n) == "matmul"
        and any(a.op == "get_attr" for a in n.args if isinstance(a, fx.Node))
        and len(n.users) == 1
        and op_kind(next(iter(n.users))) == "add"
    ]
    assert len(raw) == 1
    add = next(iter(raw[0].users))
    assert any(isinstance(a, fx.Node) and a.op == "get_attr" for a in add.args)
    cancelling = [
        n
        for n in gm.graph.nodes
        if op_kind(n) == "transpose"
        and n.args[1:] == (0, 1)
        and len(n.users) == 1
        and op_kind(next(iter(n.users))) == "transpose"
        and next(iter(n.users)).args[1:] == (0, 1)
    ]
    assert len(cancelling) == 1


def test_gpt_patterns():
    loaded, cap = graph_of("zoo:gpt")
    gm = cap.gm
    assert fan_out(gm, "linear", 3) == 2  # q, k, v
    assert fan_out(gm, "linear", 2) == 4  # plus gate and up
    assert chains(gm, "pow", "mean", "add", "rsqrt", "mul", "mul") == 5
    assert chains(gm, "linear", "silu", "mul", "linear") == 2
    masked = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "masked_fill"]
    assert len(masked) == 2
    assert all(op_kind(next(iter(n.users))) == "softmax" for n in masked)
    assert count(gm, "layer_norm") == count(gm, "rms_norm") == count(gm, "attention") == 0
    model = loaded.module
    assert model.lm_head.weight is model.embed.weight
    untied = load("zoo:gpt", {"tie_embeddings": "false"}).module
    assert untied.lm_head.weight is not untied.embed.weight
    mask = model.layers[0].attn.future_mask
    assert mask.dtype == torch.bool and torch.equal(mask, mask.triu(1)) and mask[0, 1]


def test_gpt_is_causal():
    loaded = load("zoo:gpt")
    ids = loaded.example_inputs[0].clone()
    changed = ids.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % 1000
    with torch.no_grad():
        a, b = loaded.module(ids), loaded.module(changed)
    torch.testing.assert_close(a[:, :20], b[:, :20])
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_bert_is_not_causal():
    loaded = load("zoo:bert")
    ids = loaded.example_inputs[0].clone()
    ids[:, -1] = (ids[:, -1] + 1) % 1000
    with torch.no_grad():
        a, b = loaded.module(loaded.example_inputs[0]), loaded.module(ids)
    # the classifier reads token 0, which attends to the changed last token
    assert not torch.allclose(a, b)
    torch.testing.assert_close(a.exp().sum(-1), torch.ones(2))  # log-probabilities


def test_hand_written_norms_match_reference():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(5, 7, 123, generator=gen) * 3 + 1
    ln = DecomposedLayerNorm(123, eps=1e-5)
    torch.testing.assert_close(ln(x), F.layer_norm(x, (123,), ln.weight, ln.bias, 1e-5))
    rms = HandRMSNorm(123, eps=1e-6)
    expected = x / torch.sqrt((x.double() ** 2).mean(-1, keepdim=True) + 1e-6).float() * rms.weight
    torch.testing.assert_close(rms(x), expected)


def test_bert_gelu_matches_exact_gelu():
    ffn = load("zoo:bert").module.layers[0].ffn
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 11, 64, generator=gen)
    h = ffn.up(x)
    expected = ffn.norm(x + ffn.down(F.gelu(h)))
    torch.testing.assert_close(ffn(x), expected)


def test_seq_patterns():
    _, cap = graph_of("zoo:seq")
    gm = cap.gm
    rnns = [submodule(gm, n) for n in gm.graph.nodes if op_kind(n) == "rnn"]
    assert [type(m) for m in rnns] == [nn.LSTM, nn.GRU]
    assert all(m.batch_first for m in rnns)
    assert count(gm, "linear") == 1


def test_recsys_patterns():
    loaded, cap = graph_of("zoo:recsys")
    gm = cap.gm
    tables = [submodule(gm, n) for n in gm.graph.nodes if op_kind(n) == "embedding"]
    assert len(tables) == 4
    assert all(1000 <= t.num_embeddings <= 5000 and 16 <= t.embedding_dim <= 32 for t in tables)
    assert chains(gm, "embedding", "sum", "cat") == 1
    assert chains(gm, "embedding", "mean", "cat") == 1
    assert chains(gm, "linear", "sigmoid", "output") == 1
    assert chains(gm, "linear", "relu") == 4
    ids = loaded.example_inputs[:4]
    assert all(i.dtype == torch.int64 for i in ids)
    assert loaded.example_inputs[4].is_floating_point()


def test_largekernel_patterns():
    _, cap = graph_of("zoo:largekernel")
    gm = cap.gm
    convs = [submodule(gm, n) for n in gm.graph.nodes if op_kind(n) == "conv"]
    sizes = {c.kernel_size[0] for c in convs}
    assert {5, 7, 11, 13} <= sizes
    dw = {c.kernel_size[0] for c in convs if c.groups == c.in_channels > 1}
    dense = {c.kernel_size[0] for c in convs if c.groups == 1}
    assert {7, 13} <= dw and {5, 7, 11} <= dense
    for kind in ("max_pool", "avg_pool", "adaptive_max_pool", "adaptive_avg_pool"):
        assert count(gm, kind) == 1, kind
    assert chains(gm, "adaptive_avg_pool", "flatten", "linear", "relu", "linear") == 1


@pytest.mark.parametrize("depth, kernel", [(2, 127), (3, 31)])
def test_longconv_patterns(depth, kernel):
    _, cap = graph_of("zoo:longconv", depth=depth, kernel=kernel, length=96)
    gm = cap.gm
    convs = [submodule(gm, n) for n in gm.graph.nodes if op_kind(n) == "conv"]
    assert all(isinstance(c, nn.Conv1d) and c.groups == 1 for c in convs)
    long = [c for c in convs if c.kernel_size[0] > 1]
    assert [c.kernel_size[0] for c in long] == [kernel] * depth
    assert all(c.padding[0] == kernel // 2 for c in long)
    assert len(convs) == 1 + 2 * depth  # the embedding and each block's channel mix
    assert chains(gm, "conv", "relu", "conv", "add") == depth
    assert chains(gm, "mean", "layer_norm", "linear", "output") == 1


def test_attention_scale_is_one_over_sqrt_head_dim():
    # Guards the constant a SDPA rewrite relies on: scores are divided by sqrt(d).
    _, cap = graph_of("zoo:bert", hidden=48, heads=3)
    divs = [
        n
        for n in cap.gm.graph.nodes
        if op_kind(n) == "div" and op_kind(n.args[0]) == "matmul" and isinstance(n.args[1], float)
    ]
    assert divs and all(math.isclose(n.args[1], math.sqrt(16)) for n in divs)
