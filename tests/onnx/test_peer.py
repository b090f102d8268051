"""opswap's ONNX rules against ONNX Runtime's transformer optimizer on tiny BERT, GPT-2 and
ViT: at least as many of every fused op the optimizer makes, and the outputs still match."""

import onnx
import pytest

from opswap.onnx.load import load_onnx, other_sizes
from opswap.onnx.peer import covers, op_counts, ort_optimize
from opswap.onnx.plan import plan_onnx
from opswap.onnx.runtime import verify


@pytest.mark.parametrize("kind", ["bert", "gpt2", "vit"])
def test_opswap_fuses_at_least_what_ort_optimizer_fuses(exported, kind):
    m = load_onnx(exported(kind))
    _, theirs = ort_optimize(onnx.load(exported(kind)), kind, num_heads=4, hidden_size=64)
    plan, out = plan_onnx(m)
    ours = op_counts(out)
    table = covers(ours, theirs)
    assert table, f"ORT's optimizer fused nothing on {kind}: the comparison would prove nothing"
    short = {k: v for k, v in table.items() if v[0] < v[1]}
    assert not short, f"{kind}: opswap (ours, ORT's) short of ORT's optimizer: {short}"
    check = verify(m, out, [m.sizes, *other_sizes(m)], "exact", 1)
    assert check.passed, check.reasons
    assert len(check.shapes) == 3  # batch (and sequence) symbolic: verified at three sizes


def test_covers_counts_containing_fusions_and_says_where_short():
    ours = {"SkipLayerNormalization": 4, "LayerNormalization": 1, "BiasGelu": 2}
    theirs = {"LayerNormalization": 5, "Gelu": 2, "FastGelu": 0, "Attention": 2}
    assert covers(ours, theirs) == {
        "LayerNormalization": (5, 5),
        "Gelu": (2, 2),
        "Attention": (0, 2),
    }


def _sliced_norm(g, external: bool):
    """A Slice whose starts and ends are initializers, then a LayerNormalization, as
    torch.onnx's dynamo exporter writes BERT's position ids; its tensors in a data file
    beside it when `external`."""
    import numpy as np
    from onnx import helper

    nodes = [
        helper.make_node("Slice", ["x", "starts", "ends", "axes"], ["s"]),
        helper.make_node("LayerNormalization", ["s", "gamma", "beta"], ["y"], axis=-1),
    ]
    inits = {
        "starts": np.array([0], np.int64),
        "ends": np.array([6], np.int64),
        "axes": np.array([2], np.int64),
        "gamma": g.weight(6) + 1,
        "beta": g.weight(6),
    }
    proto = g.proto(nodes, [("x", ["batch", "seq", 9])], ["y"], inits)
    kw = {"save_as_external_data": True, "location": "m.onnx.data", "size_threshold": 0}
    return g.save(proto, **(kw if external else {}))


@pytest.mark.parametrize("external", [True, False])
def test_the_peer_runs_on_files_whose_slices_read_initializers(graphs, external):
    """Handed a ModelProto, ORT's optimizer moves every initializer out of the model and then
    fails on such a Slice ("Cannot parse data from external tensors"); opswap hands it a
    file, and the peer is raced."""
    from opswap.onnx.optimize import optimize_onnx

    m = load_onnx(_sliced_norm(graphs, external), {"seq": 5})
    model, stats = ort_optimize(m.proto)
    assert "LayerNormalization" in stats and model.graph.node
    result = optimize_onnx(m, samples=1, min_time_s=0.02)
    assert result.peer["model_type"] == "bert" and result.peer["verification"]["passed"]
    assert {v["name"] for v in result.variants} == {"input", "opswap", "ort-optimizer"}
    assert not any("failed" in n for n in result.notes)


def test_the_transformer_peer_applies_to_transformer_blocks_only(graphs):
    from onnx import helper

    from opswap.onnx.peer import applies

    def proto(*nodes):
        return graphs.proto(list(nodes), [("x", [2, 4, 4])], ["y"], {"w": graphs.weight(4, 4)})

    conv = graphs.proto(
        [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Relu", ["c"], ["y"])],
        [("x", [1, 3, 8, 8])],
        ["y"],
        {"w": graphs.weight(4, 3, 3, 3)},
    )
    assert "no attention and no LayerNorm" in applies(conv)
    softmax_alone = proto(helper.make_node("Softmax", ["x"], ["y"]))
    assert applies(softmax_alone) is not None  # a detector's Softmax over boxes
    attention = proto(
        helper.make_node("MatMul", ["x", "w"], ["s"]),
        helper.make_node("Mul", ["s", "w"], ["t"]),
        helper.make_node("Softmax", ["t"], ["y"]),
    )
    assert applies(attention) is None
    norm = proto(helper.make_node("LayerNormalization", ["x", "w", "w"], ["y"]))
    assert applies(norm) is None
