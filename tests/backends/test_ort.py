"""backends.ort: an ONNX Runtime session called like the module it came from."""

from __future__ import annotations

import copy

import pytest
import torch

from opswap import api
from opswap.backends.ort import OrtModule, ort_artifact, session
from opswap.errors import ExportError, InputError
from opswap.graph.dynamic import variants


def test_tiny_bert_runs_in_ort_at_other_batches_and_lengths(tmp_path):
    loaded = api.load("zoo:bert", hidden="32", layers="1", heads="2", intermediate="64", seq="12")
    model = loaded.module.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    captured = api.capture(model, loaded.example_inputs)
    assert {a.name for a in captured.dynamic.axes} >= {"batch", "seq"}
    art = ort_artifact(model, captured.example_inputs, captured.dynamic, tmp_path, fusions=True)
    assert art.module is not None, art.error
    assert art.module.session_threads == torch.get_num_threads()
    shapes = [("example", captured.example_inputs)] + variants(
        captured.example_inputs, captured.dynamic
    )
    labels = [s for s, _ in shapes]
    assert "batch 1" in labels and any(s.startswith("seq") for s in labels)
    for _, xs in shapes:
        with torch.no_grad():
            want = model(*xs)
        got = art.module(*xs)
        assert type(got) is type(want)  # the output structure comes back
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    other = copy.deepcopy(art.module)  # a session is not copied: a new one is opened
    assert other.session is not art.module.session
    xs = captured.example_inputs
    torch.testing.assert_close(other(*xs), art.module(*xs))


def test_wrong_inputs_are_refused_in_one_sentence(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(6, 3), torch.nn.ReLU()).eval()
    art = ort_artifact(model, (torch.randn(4, 6),), None, tmp_path)
    mod = art.module
    assert isinstance(mod, OrtModule)
    with pytest.raises(InputError, match="takes 1 input tensor"):
        mod(torch.randn(4, 6), torch.randn(4, 6))
    with pytest.raises(InputError, match="refused the inputs"):
        mod(torch.randn(4, 7))
    with pytest.raises(InputError, match="bfloat16"):
        mod(torch.randn(4, 6, dtype=torch.bfloat16))


def test_a_file_ort_cannot_load_is_an_export_error(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(ExportError, match="could not load bad.onnx"):
        session(bad)


def test_timed_sessions_do_not_spin_and_sessions_for_use_do(tmp_path):
    """The race's ORT sessions keep their threads from spin-waiting (they would take the
    cores from the variant timed next); a copy keeps the setting; a saved file loaded for
    use (opswap.load_optimized) spins, as ORT's default has it."""
    import opswap

    model = torch.nn.Sequential(torch.nn.Linear(8, 4)).eval()
    x = torch.randn(2, 8)
    art = ort_artifact(model, (x,), None, tmp_path)
    assert art.module is not None, art.error

    def spins(mod) -> str:
        return mod.session.get_session_options().get_session_config_entry(
            "session.intra_op.allow_spinning"
        )

    assert spins(art.module) == "0"
    assert spins(copy.deepcopy(art.module)) == "0"
    loaded = opswap.load_optimized(art.path)
    assert isinstance(loaded, OrtModule) and spins(loaded) == "1"
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x))
