import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from opswap.onnx.load import load_onnx


def _embeddings(g, positions_from_input=False, epsilon: float | None = 1e-12, scale=0.3):
    """BERT's embeddings as the legacy exporter writes them: the positions are a slice
    0..S-1 of a constant arange buffer. `epsilon` None leaves the attribute unset."""
    eps = {} if epsilon is None else {"epsilon": epsilon}
    nodes = [
        helper.make_node("Shape", ["ids"], ["shape"]),
        helper.make_node("Gather", ["shape", "one"], ["seqlen"], axis=0),
        helper.make_node("Unsqueeze", ["seqlen", "zero1"], ["end"]),
        helper.make_node("Slice", ["buffer", "zero1", "end", "one1"], ["positions"]),
        helper.make_node("Gather", ["word", "ids"], ["we"]),
        helper.make_node("Gather", ["seg", "types"], ["te"]),
        helper.make_node("Add", ["we", "te"], ["s1"]),
        helper.make_node(
            "Gather", ["pos", "pos_in" if positions_from_input else "positions"], ["pe"]
        ),
        helper.make_node("Add", ["s1", "pe"], ["s2"]),
        helper.make_node("LayerNormalization", ["s2", "gamma", "beta"], ["y"], axis=-1, **eps),
    ]
    inits = {
        "word": g.weight(50, 8, scale=scale),
        "seg": g.weight(2, 8, scale=scale),
        "pos": g.weight(32, 8, scale=scale),
        "gamma": g.weight(8) + 1,
        "beta": g.weight(8),
        "buffer": np.arange(32, dtype=np.int64)[None],
        "one": np.array(1, np.int64),
        "zero1": np.array([0], np.int64),
        "one1": np.array([1], np.int64),
    }
    inputs = [
        helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "seq"])
        for n in ("ids", "types")
    ]
    if positions_from_input:
        inputs.append(helper.make_tensor_value_info("pos_in", TensorProto.INT64, ["batch", "seq"]))
    graph = helper.make_graph(
        nodes,
        "g",
        inputs,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = g.tmp / f"emb{int(positions_from_input)}_{epsilon}.onnx"
    onnx.save(proto, str(path))
    return load_onnx(path)


def test_bert_embeddings_become_embed_layer_norm(graphs):
    m = _embeddings(graphs)
    plan, out, ops = graphs.apply(m, ["onnx.embed_layer_norm"])
    assert plan.counts() == {"onnx.embed_layer_norm": 1} and "EmbedLayerNormalization" in ops
    assert "LayerNormalization" not in ops
    assert graphs.matches(m, out, {"batch": 1, "seq": 3}, {"batch": 3, "seq": 31})


def test_positions_given_as_an_input_are_a_miss(graphs):
    m = _embeddings(graphs, positions_from_input=True)
    plan, _, ops = graphs.apply(m, ["onnx.embed_layer_norm"])
    assert "EmbedLayerNormalization" not in ops
    assert any("position ids are not 0..S-1" in x.reason for x in plan.misses)


def test_an_unset_epsilon_is_the_specs_default(graphs):
    """A LayerNormalization without epsilon has ONNX's 1e-5; on embeddings of variance
    about 1e-6 the fused op with 1e-12 instead would be off by far more than rounding."""
    m = _embeddings(graphs, epsilon=None, scale=1e-3)
    plan, out, ops = graphs.apply(m, ["onnx.embed_layer_norm"])
    assert plan.counts() == {"onnx.embed_layer_norm": 1}
    fused = next(n for n in out.graph.node if n.op_type == "EmbedLayerNormalization")
    eps = next(a.f for a in fused.attribute if a.name == "epsilon")
    assert abs(eps - 1e-5) < 1e-9
    assert graphs.matches(m, out, {"batch": 1, "seq": 5}, {"batch": 3, "seq": 29})
