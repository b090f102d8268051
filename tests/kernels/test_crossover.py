"""The crossover table: the shipped one holds no invented figures (every entry without a
measurement says "none yet"), a benchmark's rows update it, and a measured entry decides
a rule's prediction on a CUDA target where the roofline would otherwise."""

from __future__ import annotations

import torch

from opswap.kernels import crossover as cx
from opswap.rules import _triton
from opswap.targets import get_target


def test_shipped_table_is_honest_and_keyed_by_the_benchmark_shapes():
    entries = cx.load()
    assert entries and {e.kernel for e in entries} == set(cx.KERNELS)
    for e in entries:
        assert e.measured == e.source.startswith("measured"), e
        if not e.measured:
            assert e.source == "none yet" and e.speedup_vs_eager is None
    assert cx.shape_class(4096, 32768) == "h<=4096,rows<=32768"
    assert cx.shape_class(5632, 40000) == "h<=8192,rows>32768"
    assert cx.device_class(get_target("h200")) == "sm90"
    assert cx.device_class(get_target("cpu")) == "cpu"


def _result(ours, eager):
    row = dict(kernel="rms_norm", dtype="bfloat16", rows=32768, hidden=4096)
    return {
        "device_class": "sm90",
        "rows": [
            dict(row, **{"pass": "forward", "ours_ms": ours, "eager_ms": eager, "compile_ms": 0.5}),
            dict(row, **{"pass": "forward+backward", "ours_ms": None, "eager_ms": 1.0}),
        ],
    }


def test_update_replaces_entries_and_lookup_finds_the_measured_ones(tmp_path, monkeypatch):
    path = tmp_path / "crossover.json"
    path.write_text((cx.TABLE).read_text())
    new = cx.update(_result(0.2, 0.6), "measured norm_kernels_h200.json 2026-01-01", path)
    assert len(new) == 1  # the untimed row gives no entry
    table = cx.load(path)
    e = cx.lookup("rms_norm", "sm90", torch.bfloat16, 4096, 32768, entries=table)
    assert e is not None and e.beats_eager and e.beats_compile and e.speedup_vs_eager == 3.0
    assert len(table) == len(cx.load())  # replaced in place, nothing added
    # a measured loss decides the prediction: predicted slower, with the measurement's source
    cx.update(_result(0.9, 0.6), "measured norm_kernels_h200.json 2026-01-02", path)
    monkeypatch.setattr(cx, "TABLE", path)
    est = _triton.predict(
        get_target("h200"), "rms_norm", [], _triton.NodeCost(0, 1), torch.bfloat16, 4096, 32768, ""
    )
    assert est.time_saved_s is not None and est.time_saved_s < 0 and "2026-01-02" in est.note
    est = _triton.predict(
        get_target("h200"), "rms_norm", [], _triton.NodeCost(0, 1), torch.bfloat16, 8192, 256, "x"
    )
    assert "roofline" in est.note  # nothing measured at hidden 8192


def test_a_tensor_shape_in_a_row_is_not_taken_for_a_shape_class(tmp_path):
    # bench_kernels18.py's rows carry the tensor's shape as a list; the class is then made
    # from hidden and rows (a list as a key failed the update on the H200)
    row = {"kernel": "bias_gelu_cuda", "dtype": "bfloat16", "rows": 8192, "hidden": 4096}
    row.update({"pass": "forward", "shape": [8192, 4096], "ours_ms": 1.0, "eager_ms": 2.0})
    new = cx.entries_from_benchmark({"device_class": "sm90", "rows": [row]}, "measured x")
    assert [e.shape for e in new] == [cx.shape_class(4096, 8192)]
    attn = {**row, "kernel": "flash_attention", "shape": "d=64,sq<=4096,sk<=4096"}
    assert cx.entries_from_benchmark({"device_class": "sm90", "rows": [attn]}, "m")[0].shape == (
        "d=64,sq<=4096,sk<=4096"
    )
