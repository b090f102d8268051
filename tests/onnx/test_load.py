import onnx
import pytest
from onnx import helper

from opswap.errors import SpecError
from opswap.onnx.load import load_onnx, other_sizes


def _gelu_net(g, opset):
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Add", ["h", "b"], ["hb"]),
        helper.make_node("Relu", ["hb"], ["y"]),
    ]
    return g.proto(
        nodes,
        [("x", ["batch", "seq", 4])],
        ["y"],
        {"w": g.weight(4, 6), "b": g.weight(6)},
        opset=opset,
    )


def test_a_missing_file_is_one_sentence(tmp_path):
    with pytest.raises(SpecError, match="does not exist"):
        load_onnx(tmp_path / "nothing.onnx")


def test_a_file_that_is_not_onnx_is_refused(tmp_path):
    p = tmp_path / "junk.onnx"
    p.write_bytes(b"\x00\xff not a protobuf at all \xff" * 10)
    with pytest.raises(SpecError, match="not an ONNX model"):
        load_onnx(p)


@pytest.mark.parametrize("opset", [11, 12, 22])
def test_an_opset_out_of_range_is_converted_and_said(graphs, opset):
    """Converted to the nearest opset the rules take; the reference stays the file as given."""
    path = graphs.save(_gelu_net(graphs, opset))
    m = load_onnx(path)
    want = 13 if opset < 13 else 21
    assert m.opset == want and m.proto.opset_import[0].version == want
    assert m.as_given.opset_import[0].version == opset
    assert any(f"opset {opset}" in n and f"converted to opset {want}" in n for n in m.notes)
    plan, out, _ = graphs.apply(m, None)
    assert graphs.matches(m, out, {"batch": 1, "seq": 3}, {"batch": 4, "seq": 9})


def test_an_opset_the_converter_cannot_take_is_refused_in_one_sentence(graphs, monkeypatch):
    from onnx import version_converter

    def fail(model, target):
        raise RuntimeError("No adapter for Relu\nmore lines")

    monkeypatch.setattr(version_converter, "convert_version", fail)
    path = graphs.save(_gelu_net(graphs, 12))
    with pytest.raises(
        SpecError,
        match=r"opset 12, and onnx's version converter cannot bring it to opset 13 \(No adapter for Relu\)",
    ):
        load_onnx(path)


@pytest.mark.parametrize("opset", [13, 21])
def test_opset_13_and_21_models_load_and_their_rewrites_run(graphs, opset):
    """The first and last opsets taken: a decomposed LayerNorm rewrites and runs in ORT."""
    two, eps = graphs.const("two", 2.0), graphs.const("eps", 1e-5)

    def mean(s, d):
        if opset < 18:
            return [helper.make_node("ReduceMean", [s], [d], axes=[-1])]
        return [
            helper.make_node("Constant", [], [d + "a"], value_ints=[-1]),
            helper.make_node("ReduceMean", [s, d + "a"], [d]),
        ]

    nodes = [
        two,
        eps,
        *mean("x", "mu"),
        helper.make_node("Sub", ["x", "mu"], ["d"]),
        helper.make_node("Pow", ["d", "two"], ["d2"]),
        *mean("d2", "v"),
        helper.make_node("Add", ["v", "eps"], ["ve"]),
        helper.make_node("Sqrt", ["ve"], ["sd"]),
        helper.make_node("Div", ["d", "sd"], ["n"]),
        helper.make_node("Mul", ["n", "g"], ["ng"]),
        helper.make_node("Add", ["ng", "b"], ["y"]),
    ]
    m = graphs.load(
        nodes,
        [("x", ["batch", 6])],
        ["y"],
        {"g": graphs.weight(6), "b": graphs.weight(6)},
        opset=opset,
    )
    assert m.opset == opset
    plan, out, ops = graphs.apply(m, None)
    assert "LayerNormalization" in ops
    assert graphs.matches(m, out, {"batch": 1}, {"batch": 5})


def test_external_data_is_read_from_beside_the_file(graphs):
    proto = _gelu_net(graphs, 17)
    path = graphs.save(proto, save_as_external_data=True, location="weights.bin", size_threshold=0)
    assert (graphs.tmp / "weights.bin").exists()
    m = load_onnx(path)
    assert all(not t.external_data for t in m.proto.graph.initializer)
    plan, out, _ = graphs.apply(m, None)
    assert graphs.matches(m, out, {"batch": 1, "seq": 3})


def test_missing_external_data_is_one_sentence(graphs):
    path = graphs.save(
        _gelu_net(graphs, 17), save_as_external_data=True, location="w.bin", size_threshold=0
    )
    (graphs.tmp / "w.bin").unlink()
    with pytest.raises(SpecError, match="external data"):
        load_onnx(path)


def test_a_model_without_value_info_gets_inferred_shapes(graphs):
    proto = _gelu_net(graphs, 17)
    assert not proto.graph.value_info
    m = load_onnx(graphs.save(proto))
    assert m.inferred
    shapes = {
        v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
        for v in m.proto.graph.value_info
    }
    assert shapes["hb"] == ["batch", "seq", 6]


def test_symbolic_dims_get_example_sizes_and_others(graphs):
    m = load_onnx(graphs.save(_gelu_net(graphs, 17)), {"seq": 9})
    assert m.symbols == ["batch", "seq"] and m.sizes == {"batch": 2, "seq": 9}
    others = other_sizes(m)
    assert {"batch": 1, "seq": 9} in others and all(o != m.sizes for o in others)
    with pytest.raises(SpecError, match="no symbolic dim 'width'"):
        load_onnx(graphs.save(_gelu_net(graphs, 17)), {"width": 3})


def test_the_file_on_disk_is_left_as_it_was(graphs):
    path = graphs.save(_gelu_net(graphs, 17))
    before = open(path, "rb").read()
    graphs.apply(load_onnx(path), None)
    assert open(path, "rb").read() == before and onnx.load(path).graph.node[0].op_type == "MatMul"


def test_the_torch_model_loader_points_an_onnx_spec_to_the_onnx_commands():
    from opswap.models import load

    with pytest.raises(SpecError, match="opswap analyze`, `plan` and `optimize` read"):
        load("exported/model.onnx")
