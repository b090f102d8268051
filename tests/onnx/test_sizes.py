"""The sizes an ONNX model is run at: refused before allocating when they cannot fit,
picked where the model runs when it does not run at the defaults, and said."""

import numpy as np
import pytest
from onnx import helper, numpy_helper
from tests.onnx.conftest import detector

from opswap.errors import SpecError
from opswap.onnx.load import load_onnx
from opswap.onnx.runtime import verify
from opswap.onnx.sizes import fit, implied, need_bytes, other_sizes


def _dense(g):
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Relu", ["h"], ["y"]),
    ]
    return g.save(g.proto(nodes, [("x", ["batch", "seq", 64])], ["y"], {"w": g.weight(64, 48)}))


def test_sizes_too_large_for_memory_are_refused_before_anything_is_allocated(graphs):
    path = _dense(graphs)
    with pytest.raises(SpecError, match=r"needs about .* GiB .* more than .* free; give smaller"):
        load_onnx(path, {"seq": 99_999_999})
    with pytest.raises(SpecError, match=r"needs about .* GiB"):
        load_onnx(path, {"batch": 10**7, "seq": 10**5})


def test_the_estimate_counts_inputs_and_the_largest_value_at_the_sizes(graphs):
    m = load_onnx(_dense(graphs), {"batch": 3, "seq": 7})
    need, what = need_bytes(m, {"batch": 3, "seq": 7})
    inputs = 3 * 7 * 64 * (4 + 8)  # float32, drawn in float64 first
    assert need == inputs + 2 * 3 * 7 * 48 * 4  # and twice the largest value, y
    assert what == "16 KiB of inputs and 2 x 4 KiB for h"
    big = {"batch": 5, "seq": 1000}
    fit(m, big, free=need_bytes(m, big)[0])  # exactly enough passes
    with pytest.raises(SpecError, match="more than the"):
        fit(m, big, free=need_bytes(m, big)[0] - 1)


def test_a_detector_that_does_not_run_at_16x16_gets_sizes_it_runs_at(tmp_path):
    m = load_onnx(detector(tmp_path / "det.onnx"))
    assert m.sizes == {"batch": 2, "height": 224, "width": 224}
    assert any("does not run at height=16, width=16" in n and "224x224" in n for n in m.notes)
    others = other_sizes(m)
    assert {"batch": 1, "height": 224, "width": 224} in others and len(others) == 2
    same = verify(m, m.proto, [m.sizes, *others], "exact", 1)  # every set runs
    assert same.passed


def test_the_size_a_files_metadata_names_is_tried_first(tmp_path):
    m = load_onnx(detector(tmp_path / "det.onnx", metadata={"imgsz": "[96, 128]"}))
    assert (m.sizes["height"], m.sizes["width"]) == (96, 128)
    assert any("96x128" in n for n in m.notes)


def test_sizes_the_user_gave_are_not_replaced_and_are_refused_in_one_sentence(tmp_path):
    with pytest.raises(SpecError, match=r"does not run at sizes .*height.: 16.*--set NAME=SIZE"):
        load_onnx(detector(tmp_path / "det.onnx"), {"height": 16, "width": 16})


def test_constant_size_resizes_imply_image_sizes(graphs):
    """A Resize to a constant 10x12 map implies inputs of 10x12 times a power of two."""
    sizes = numpy_helper.from_array(np.array([1, 3, 10, 12], np.int64), "sizes")
    nodes = [helper.make_node("Resize", ["x", "", "", "sizes"], ["y"], mode="nearest")]
    proto = graphs.proto(nodes, [("x", [1, 3, "h", "w"])], ["y"])
    proto.graph.initializer.append(sizes)
    m = load_onnx(graphs.save(proto), probe=False)
    assert implied(m)[:3] == [(10, 12), (20, 24), (40, 48)] and (320, 384) in implied(m)
