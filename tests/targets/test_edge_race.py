"""The edge race on tiny zoo models: opswap's legalised ExecuTorch program delegates every
compute op where the default export does not, both are verified against the model, and the
winner is saved as the very file that was timed."""

from __future__ import annotations

import pytest
import torch

from opswap.models.zoo import load_zoo

pytest.importorskip("executorch.exir")

from opswap.bench.edge import MIN_COSINE, EdgeRace, _compare, edge_race  # noqa: E402


@pytest.fixture(scope="module")
def gpt_race(tmp_path_factory: pytest.TempPathFactory) -> EdgeRace:
    m = load_zoo("gpt", "zoo:gpt", {"batch": 1, "seq": 11, "layers": 1, "hidden": 40, "heads": 5})
    out = tmp_path_factory.mktemp("race")
    tflite = out / "no.tflite" if _has_litert() else None  # a .tflite file that is not there
    return edge_race(m.module, tuple(m.example_inputs), out, tflite=tflite, rounds=3)


def _has_litert() -> bool:
    try:
        import ai_edge_litert.interpreter  # noqa: F401
    except ImportError:
        return False
    return True


def test_legalised_program_delegates_every_compute_op(gpt_race: EdgeRace) -> None:
    ours, default = gpt_race.entry("opswap+executorch"), gpt_race.entry("executorch")
    assert ours.delegation is not None and default.delegation is not None
    assert ours.delegation.compute_share == 1.0
    assert default.delegation.compute_share < 1.0
    left = {r.op for r in default.delegation.outside if r.compute}
    assert {"mean", "where"} <= left, left
    for e in (ours, default):
        assert e.verified and e.cosine is not None and e.cosine >= MIN_COSINE
        assert e.top1 == 1.0 and e.ms is not None and e.ms > 0


def test_the_winner_is_the_file_that_was_timed(gpt_race: EdgeRace) -> None:
    assert gpt_race.winner in ("executorch", "opswap+executorch")
    timed = gpt_race.entry(gpt_race.winner).path
    assert gpt_race.saved is not None and timed is not None
    assert gpt_race.saved.read_bytes() == timed.read_bytes()
    md = gpt_race.markdown()
    assert "(winner)" in md and "built at the example's shapes" in md
    assert gpt_race.to_dict()["entries"][1]["delegation"]["compute_share"] == 1.0


def test_compare_reads_cosine_top1_and_refuses_a_wrong_count() -> None:
    a = torch.randn(4, 9)
    c, t, m = _compare(a, -a)
    assert c == pytest.approx(-1.0) and t < 1.0 and m > 0
    with pytest.raises(Exception, match="returned 2 tensors where the model returns 1"):
        _compare(a, (a, a))


def test_a_missing_tflite_is_an_entry_that_says_why(gpt_race: EdgeRace) -> None:
    if not _has_litert():
        pytest.skip("ai_edge_litert is not installed")
    lite = gpt_race.entry("litert")
    assert not lite.verified and "LiteRT could not load no.tflite" in lite.error


def test_offline_checks_convert_for_core_ml_and_read_qnn_op_set(tmp_path) -> None:
    pytest.importorskip("coremltools")
    from opswap.bench.edge import offline_checks

    m = load_zoo("resnet", "zoo:resnet", {"batch": 1, "image_size": 16, "width": 8})
    got = offline_checks(m.module, tuple(m.example_inputs), tmp_path)
    assert got["coreml"]["converted"] and (tmp_path / "model.mlpackage").exists()
    assert "Apple hardware" in got["coreml"]["runs"]
    # the ANE and HTP take no float32: every op is named outside with that reason
    assert got["qnn"]["compute_share"] == 0.0 and "no QNN SDK" in got["qnn"]["runs"]
    assert any("float32" in o["why"] for o in got["coreml"]["ane_op_set"]["outside"])


def test_each_program_s_memory_is_read_in_a_process_of_its_own(gpt_race: EdgeRace) -> None:
    for name in ("executorch", "opswap+executorch"):
        mem = gpt_race.entry(name).memory
        assert mem is not None and "error" not in mem, mem
        # the activations the program plans are a few KB here; the resident set grows by
        # at least the file's weights once loaded
        assert 0 < mem["planned_mb"] < 1 and mem["peak_mb"] >= mem["load_mb"] > 0
        assert mem["process_peak_mb"] >= mem["base_mb"] + mem["steady_mb"] - 1
    assert "peak RSS" in gpt_race.markdown()
    assert any("torch's own pool held at 1" in n for n in gpt_race.notes)


def test_program_memory_refuses_what_is_not_a_program(tmp_path) -> None:
    from opswap.bench.edge import planned_memory, program_memory
    from opswap.errors import InputError

    with pytest.raises(InputError, match="is not a .pte or .tflite file here"):
        program_memory(tmp_path / "model.onnx")
    bad = tmp_path / "bad.pte"
    bad.write_bytes(b"not a program")
    with pytest.raises(InputError, match="bad.pte is not an ExecuTorch program"):
        planned_memory(bad)


def test_torch_pool_is_held_while_timing_and_given_back() -> None:
    from opswap.bench.edge import torch_pool_held

    before = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="inside"):
        with torch_pool_held(1):
            assert torch.get_num_threads() == 1
            raise RuntimeError("inside")
    assert torch.get_num_threads() == before
