from onnx import helper

from opswap.onnx.analyze import analyze_onnx


def test_per_op_counts_and_matmul_flops_at_the_example_sizes(graphs):
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("MatMul", ["r", "w2"], ["y"]),
    ]
    m = graphs.load(
        nodes,
        [("x", ["batch", 5, 8])],
        ["y"],
        {"w": graphs.weight(8, 6), "w2": graphs.weight(6, 3)},
        sizes={"batch": 3},
    )
    a = analyze_onnx(m)
    rows = {r.op: r for r in a.rows}
    assert rows["MatMul"].count == 2 and rows["Relu"].count == 1
    assert rows["MatMul"].flops == 2 * 3 * 5 * (8 * 6 + 6 * 3)
    assert rows["Relu"].flops == 3 * 5 * 6
    assert a.to_json()["ops"][0]["op"] == "MatMul" and a.nodes == 3
