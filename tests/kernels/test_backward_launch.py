"""The row kernels' backward launch table (kernels/_rows.py): a sweep's rows pick, per GPU
class, kernel and shape class, the launch that is least behind each shape's fastest;
the table round-trips, replaces entries of the same key and keeps others; backward_grid
takes a measured launch only on a GPU of that class, for that kernel and class, never
under a benchmark's explicit tuning; a broken table says so in one sentence; the shipped
table reads and names only launches the sweep tries."""

from __future__ import annotations

import json

import pytest
import torch

from opswap.kernels import _rows


def _row(case, hidden, rows, rb, per_sm, ms, device="sm90"):
    return dict(case=case, hidden=hidden, rows=rows, rb=rb, per_sm=per_sm, ms=ms, device=device)


def test_picks_the_launch_least_behind_at_every_width_of_a_class():
    # 5120 and 8192 share the class h<=8192: (1, 1) is fastest at 8192 but 40% behind at
    # 5120; (2, 2) is 5% behind at both and wins the class
    sweep = [
        _row("rms_norm", 8192, 4096, 1, 1, 1.00),
        _row("rms_norm", 8192, 4096, 2, 2, 1.05),
        _row("rms_norm", 8192, 4096, 1, 4, 1.30),
        _row("rms_norm", 5120, 4096, 1, 1, 1.40),
        _row("rms_norm", 5120, 4096, 2, 2, 1.05),
        _row("rms_norm", 5120, 4096, 1, 4, 1.00),
        _row("rms_norm", 2048, 4096, 4, 8, None),  # failed: never picked
        _row("rms_norm", 2048, 4096, 2, 4, 0.5),
        _row("layer_norm", 8192, 32768, 1, 4, 2.0, device="sm80"),
    ]
    entries = {
        (e["device"], e["kernel"], e["shape"]): e for e in _rows.pick_backward_launches(sweep)
    }
    e = entries[("sm90", "rms_norm", "h<=8192,rows<=4096")]
    assert (e["rb"], e["per_sm"], e["shapes"]) == (2, 2, 2)
    assert e["worst_vs_fastest"] == pytest.approx(1.05)
    assert (entries[("sm90", "rms_norm", "h<=2048,rows<=4096")]["rb"]) == 2
    assert ("sm80", "layer_norm", "h<=8192,rows<=32768") in entries


def test_table_round_trip_lookup_and_grid(tmp_path, monkeypatch):
    path = tmp_path / "launch.json"
    first = [dict(device="sm90", kernel="rms_norm", shape="h<=8192,rows<=4096", rb=2, per_sm=1)]
    assert _rows.update_backward_launches(first, "test", path) == 1
    other = [dict(device="sm90", kernel="layer_norm", shape="h<=8192,rows<=4096", rb=1, per_sm=8)]
    _rows.update_backward_launches(other, "test 2", path)
    again = [dict(device="sm90", kernel="rms_norm", shape="h<=8192,rows<=4096", rb=4, per_sm=2)]
    _rows.update_backward_launches(again, "test 3", path)
    table = _rows.backward_launches(path)
    assert table[("sm90", "rms_norm", "h<=8192,rows<=4096")] == (4, 2)  # replaced
    assert table[("sm90", "layer_norm", "h<=8192,rows<=4096")] == (1, 8)  # kept
    assert json.loads(path.read_text())["entries"][0]["source"]

    # backward_grid on a (pretended) sm90 GPU with 132 multiprocessors
    monkeypatch.setattr(_rows, "BACKWARD_TABLE", path)
    monkeypatch.setattr(_rows, "_LAUNCH_MEMO", {})

    class _Props:
        multi_processor_count = 132

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: _Props())
    import opswap.kernels.crossover as cx

    monkeypatch.setattr(cx, "device_class", lambda where: "sm90")
    gpu = torch.device("cuda", 0)
    # the table's (4 rows a step, 2 programs a multiprocessor): 264 programs wanted, 16 rows
    # each (a multiple of 4), 256 programs
    g = _rows.backward_grid(4096, 8192, gpu, "rms_norm")
    assert (g.rb, g.rows, g.programs) == (4, 16, 256)
    # no entry for add_rms_norm: the defaults (1 row a step at 8 K, 4 a multiprocessor)
    plain = _rows.backward_grid(4096, 8192, gpu, "add_rms_norm")
    assert (plain.rb, plain.rows, plain.programs) == (1, 8, 512)
    with _rows.backward_tuning(rb=1, per_sm=8):  # a sweep's own choice wins over the table
        tuned = _rows.backward_grid(4096, 8192, gpu, "rms_norm")
    assert (tuned.rb, tuned.rows, tuned.programs) == (1, 4, 1024)
    # the CPU (the interpreter) never reads the table
    assert _rows.backward_launch("rms_norm", torch.device("cpu"), 4096, 8192) is None


def test_a_broken_table_says_so(tmp_path):
    bad = tmp_path / "launch.json"
    bad.write_text("{not json")
    with pytest.raises(_rows.KernelError, match="cannot be read.*restore it"):
        _rows.backward_launches(bad)
    assert _rows.backward_launches(tmp_path / "absent.json") == {}


def test_the_shipped_table_reads_and_holds_tried_launches():
    for (dev, kernel, shape), (rb, per_sm) in _rows.backward_launches().items():
        assert dev.startswith("sm") and kernel in ("rms_norm", "add_rms_norm", "layer_norm")
        assert shape.startswith("h<=") and rb in (1, 2, 4) and per_sm in (1, 2, 4, 8)
