"""backends.registry: every registered runtime keeps the same contract, whatever its engine.

Each runtime declares its name, its file and what it needs, and these agree with the
registry's lookups; it builds a tiny model's file from its exported program, runs it at
the example's batch and at others to the numbers PyTorch gives, opens the saved file again
with `load`, says in result.json's words what that file holds, and, where it claims a layer
reader, reads the file's values layer by layer. A runtime whose packages are not installed
here is skipped by name.
"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from torch import nn

from opswap import api
from opswap.backends import registry
from opswap.backends.pt2 import export
from opswap.backends.runtime_layers import runtime_layers
from opswap.errors import ExportError
from opswap.graph.dynamic import variants

RUNTIMES = registry.runtimes()


class _Tiny(nn.Module):
    """Two Linears around a GELU, and a softmax: odd widths, a batch axis kept dynamic."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(11, 13), nn.Linear(13, 5)

    def forward(self, x):
        return self.b(nn.functional.gelu(self.a(x))).softmax(-1)


def _installed(rt: registry.Runtime) -> None:
    absent = rt.absent()
    if absent:
        pytest.skip(f"runtime {rt.name} ({rt.title}) needs {', '.join(absent)}, not installed")


def _program():
    torch.manual_seed(0)
    model = _Tiny().eval()
    captured = api.capture(model, (torch.randn(3, 11),))
    xs = captured.example_inputs
    return model, xs, captured.dynamic, export(captured.gm, xs, captured.dynamic, runtime=True)


def test_the_four_engines_are_registered_in_race_order():
    assert registry.names()[:4] == ("ort", "openvino", "executorch", "tvm")
    assert len(set(registry.names())) == len(RUNTIMES)
    files = [rt.file for rt in RUNTIMES]
    assert len(set(files)) == len(files)  # `load` finds a runtime by its file
    formats = registry.export_formats()
    assert len(set(formats)) == len(formats)  # an --export format saves one runtime's file


@pytest.mark.parametrize("rt", RUNTIMES, ids=lambda r: r.name)
def test_each_runtime_declares_its_file_needs_and_words(rt):
    assert rt.name.isidentifier() and rt.name == rt.name.lower()
    assert registry.get(rt.name) is rt
    assert rt.file.startswith("model.") and registry.of_file(f"out/{rt.file}") is rt
    assert rt.build_file.startswith("model.")
    for variant in rt.variants:
        assert registry.of_variant(variant) is rt
        assert rt.key(variant) in (f"{rt.name}_input", f"{rt.name}_candidate")
    assert rt.key(rt.variants[0]) != rt.key(rt.variants[1])
    assert rt.needs and all(m.isidentifier() for m in rt.needs) and rt.extra
    assert rt.title and rt.runs
    for fmt in rt.exports:
        assert registry.for_export(fmt) is rt
    assert (not rt.exports) or (rt.saves and rt.exported_as)
    assert rt.file in rt.files()
    for pattern in rt.beside:  # what travels with the file is named from it
        assert "{name}" in pattern or "{stem}" in pattern
    said = rt.missing(f"--export {rt.name}")
    assert said is None if not rt.absent() else said.endswith(f"'opswap[{rt.extra}]'.")


def test_a_runtime_must_define_what_it_does():
    class Half(registry.Runtime):
        name, title, rank, file = "half", "Half", 99, "model.half"
        needs, extra, runs = ("half",), "half", "Half runs"

    with pytest.raises(TypeError, match="does not define build"):
        registry.register(Half)
    assert registry.of_variant("opswap+half") is None


@pytest.mark.parametrize("rt", RUNTIMES, ids=lambda r: r.name)
def test_each_runtime_builds_loads_and_runs_like_pytorch(rt, tmp_path):
    _installed(rt)
    model, xs, dynamic, exported = _program()
    art = rt.build(None, xs, dynamic, exported=exported, mine=True, export=bool(rt.exports))
    assert art.module is not None and art.path is not None, art.error
    owner = registry.of_file(art.path)  # the runtime whose file it is: itself, saved as such
    assert owner is rt or (owner is not None and art.path.name == rt.build_file)
    kept = art.kept
    shapes = [("example", xs)] + (variants(xs, kept) if kept is not None else [])
    assert len(shapes) >= 2, art.note  # the batch stays dynamic in the tiny model's file
    for label, inputs in shapes:
        with torch.no_grad():
            want = model(*inputs)
        torch.testing.assert_close(art.module(*inputs), want, rtol=1e-4, atol=1e-5, msg=label)
    # the file as it is saved in DIR (with what travels with it), opened again by `load`
    dest = tmp_path / owner.file
    for name, data in owner.beside_of(art.path).items():
        if data.is_file():
            shutil.copyfile(data, tmp_path / name)
    shutil.copyfile(art.path, dest)
    loaded = owner.load(dest)
    again = copy.deepcopy(loaded)  # a session does not pickle: a copy opens the file anew
    x = torch.randn(2, 11)
    with torch.no_grad():
        want = model(x)
    for m in (loaded, again):
        out = m(x)
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    mine, theirs = rt.deploy(True, dest.name), rt.deploy(False, dest.name)
    assert mine.holds.startswith("opswap's") and theirs.holds.startswith("your model")
    assert f"DIR/{dest.name}" in mine.how and mine.run_under


@pytest.mark.parametrize("rt", RUNTIMES, ids=lambda r: r.name)
def test_each_runtime_reads_layers_when_it_claims_a_reader(rt):
    _installed(rt)
    _, xs, _, (program, _, _) = _program()
    if not rt.layer_forms:
        with pytest.raises(ExportError, match="keeps them inside"):
            runtime_layers(program, rt.name, xs)
        return
    int8, fusions = rt.layer_forms[-1]
    report = runtime_layers(program, rt.name, xs, int8=int8, fusions=fusions)
    compared = [r for r in report.rows if r.metrics is not None]
    assert {r.module for r in compared} >= {"a", "b"}
    assert report.first_divergence("exact") is None, report.table()
