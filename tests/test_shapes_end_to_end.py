"""`optimize` on every built-in model: the saved model.pt2 loads, runs and matches the input
module at batch 1, at the example's batch and at a larger one, and at other sequence
lengths for text models; a size the capture's guards exclude (a graph torch.export traced
for images up to 32x32) is refused in one sentence by the file and the in-memory result."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

from opswap.config import OptimizeConfig
from opswap.deploy import load_optimized
from opswap.errors import InputError
from opswap.graph.dynamic import at, within
from opswap.models import list_zoo, load
from opswap.models.hf import hf_kinds, list_hf_presets
from opswap.pipeline import optimize

# every zoo model, the 11 tuned hf presets, and one generic type of each kind the presets
# lack (an encoder-decoder, a vision-text model): optimize of all 57 checked types would
# add some 20 minutes to CI (tests/models/test_hf_kinds.py covers a sample of each kind)
_PRESETS = list_hf_presets()
_EXTRA = [
    next(t for t, k in hf_kinds().items() if k == kind)
    for kind in ("encoder-decoder", "vision-text")
]
SPECS = [f"zoo:{z.name}" for z in list_zoo()] + [f"hf:{t}" for t in _PRESETS + _EXTRA]


def _shapes(example, dynamic) -> list[tuple[str, tuple]]:
    out = [("example", example)]
    for axis in dynamic.axes:
        sizes = (
            [1, axis.size + 3]
            if axis.name == "batch"
            else [max(1, axis.size - 5), axis.probe]
            if axis.name == "seq"
            else [axis.probe, axis.size + 2 * axis.step]
        )  # image sizes: not below the example
        out += [(f"{axis.name} {n}", at(example, axis, n)) for n in sizes if n != axis.size]
    return out


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("spec", SPECS)
def test_saved_model_matches_the_input_at_other_shapes(spec, tmp_path):
    if spec.startswith("hf:"):
        pytest.importorskip("transformers")
    loaded = load(spec)
    module, example = loaded.module, loaded.example_inputs
    r = optimize(module, example, OptimizeConfig(bench=False, layers=False, samples=2), name=spec)
    assert r.verification.passed, r.verification.reasons
    names = {a.name for a in r.dynamic.axes}
    assert "batch" in names, r.dynamic.notes
    if spec.startswith("hf:") and example[0].dtype == torch.int64 or spec == "zoo:bert":
        assert "seq" in names, r.dynamic.notes
    claimed = r.dynamic
    r.save(tmp_path)
    note = tmp_path / "model_shapes.txt"
    if note.exists():  # only an axis torch.export specialises (zoo:seq's LSTM over time)
        assert "torch.export specialised" in note.read_text(), note.read_text()
        assert "batch" in {a.name for a in r.dynamic.axes}, note.read_text()
    saved = load_optimized(tmp_path, compile=False)  # what a user loads
    shapes = _shapes(example, r.dynamic)  # the file's claim (result.json's `dynamic`)
    assert len([s for s in shapes if within(r.dynamic)(s[1])]) >= 3
    for fn, sizes, inside in (
        (saved, shapes, within(r.dynamic)),
        (r.candidate, _shapes(example, claimed), within(claimed)),
    ):
        for label, xs in sizes:
            if not inside(xs):
                with pytest.raises(InputError, match="size"):
                    fn(*xs)
                continue
            with torch.no_grad():
                want = [t for t in pytree.tree_leaves(module(*xs)) if isinstance(t, torch.Tensor)]
                got = [t for t in pytree.tree_leaves(fn(*xs)) if isinstance(t, torch.Tensor)]
            assert len(got) == len(want), label
            for g, w in zip(got, want, strict=True):
                assert g.shape == w.shape, (label, g.shape, w.shape)
                if w.is_floating_point():
                    assert _rel(g, w) <= 1e-4, (label, _rel(g, w))
                else:
                    assert torch.equal(g, w), label
