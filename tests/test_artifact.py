"""opswap.artifact: what a run leaves on disk, written beside DIR and swapped in, and
the model loaded back."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from opswap import artifact
from opswap.artifact import save_model, write_run
from opswap.config import OptimizeConfig
from opswap.errors import InputError, OpswapError
from opswap.graph import capture
from opswap.models import load
from opswap.pipeline import optimize
from opswap.planner import apply_plan, make_plan


def test_optimized_model_round_trips_through_pt2(tmp_path):
    m = load("zoo:resnet")
    c = capture(m.module, m.example_inputs)
    plan = make_plan(c, rules="fusion.*")
    gm = apply_plan(c, plan).gm
    files = save_model(gm, c.example_inputs, tmp_path)
    assert files["model"].name == "model.pt2"
    back = artifact.load(tmp_path)
    x = torch.randn_like(m.example_inputs[0])
    with torch.no_grad():
        torch.testing.assert_close(back(x), m.module(x), rtol=1e-4, atol=1e-5)
    # the saved file is also a model spec
    again = load(str(files["model"]))
    assert again.source == "checkpoint"


def test_unexportable_model_falls_back_to_state_dict(tmp_path):
    class Unexportable(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            if x.sum().item() > 1e9:  # data-dependent branch: torch.export refuses
                return x
            return self.lin(x)

    m = Unexportable()
    files = save_model(m, (torch.randn(2, 4),), tmp_path)
    assert files["model"].name == "model_state.pt"
    state = torch.load(files["model"], weights_only=True)
    assert torch.equal(state["lin.weight"], m.lin.weight)
    assert "opswap apply" in (tmp_path / "model_state.txt").read_text()


class _TopK(nn.Module):
    """torch.export.save fails on its output, torch.return_types.topk, after writing weights."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.topk(self.lin(x), 2)


def test_saving_again_leaves_only_the_new_form(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    assert save_model(_TopK(), (x,), tmp_path)["model"].name == "model_state.pt"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model_state.pt", "model_state.txt"]
    lin = nn.Linear(4, 4).eval()
    assert save_model(lin, (x,), tmp_path)["model"].name == "model.pt2"
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt2"]
    y = torch.randn(3, 4)
    with torch.no_grad():
        torch.testing.assert_close(artifact.load(tmp_path)(y), lin(y))
    save_model(_TopK(), (x,), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model_state.pt", "model_state.txt"]


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.b(self.a(x).relu())


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    torch.manual_seed(0)
    model = _Mlp().eval()
    result = optimize(
        model, (torch.randn(4, 8),), OptimizeConfig(bench=False, layers=False, samples=1)
    )
    out = tmp_path_factory.mktemp("run")
    paths = artifact.save(result, out)
    return model, result, out, paths


def test_a_saved_run_loads_back_at_another_batch_size(saved_run):
    model, result, out, paths = saved_run
    assert paths["model"] == out / "model.pt2" and paths["result"] == out / "result.json"
    loaded = artifact.load(out)
    assert [a.name for a in result.dynamic.axes] == ["batch"]
    with torch.no_grad():
        for rows in (1, 4, 9):  # the example's batch and others
            x = torch.randn(rows, 8)
            torch.testing.assert_close(loaded(x), model(x))
    with pytest.raises(InputError, match="must have size 8 in dim 1"):  # the one input check
        loaded(torch.randn(3, 7))


def test_describe_is_what_result_json_holds(saved_run):
    _, result, out, _ = saved_run
    data = json.loads((out / "result.json").read_text())
    assert data.pop("model_files") == {"model": "model.pt2"}
    described = json.loads(json.dumps(artifact.describe(result), default=artifact.json_default))
    assert described == data
    assert result.to_json() == artifact.describe(result)  # the public name delegates
    assert data["deploy"] == artifact.deploy(result) == result.deploy()


def test_the_in_memory_and_the_saved_model_refuse_a_fixed_size_alike(saved_run):
    _, result, out, _ = saved_run
    x = torch.randn(3, 7)
    with pytest.raises(InputError) as in_memory:
        result.candidate(x)
    with pytest.raises(InputError) as saved:
        artifact.load(out)(x)
    for e in (in_memory, saved):
        assert "input x must have size 8 in dim 1" in str(e.value)
        assert "got (3, 7)" in str(e.value)


def _writer(**files):
    def write(folder):
        for name, text in files.items():
            (folder / name).write_text(text)
        return {name.split(".")[0]: folder / name for name in files}

    return write


def test_a_new_folder_gets_the_run_and_paths_point_into_it(tmp_path):
    out = tmp_path / "a" / "run"
    paths = write_run(out, _writer(**{"plan.json": "1", "model.pt2": "m"}))
    assert paths == {"plan": out / "plan.json", "model": out / "model.pt2"}
    assert sorted(p.name for p in out.iterdir()) == ["model.pt2", "plan.json"]
    assert [p.name for p in out.parent.iterdir()] == ["run"]


def test_an_earlier_runs_files_go_and_the_users_stay(tmp_path):
    out = tmp_path / "run"
    write_run(out, _writer(**{"model.pt2": "old", "model_shapes.txt": "n", "result.json": "o"}))
    (out / "notes.txt").write_text("mine")
    write_run(out, _writer(**{"model_state.pt": "new", "result.json": "r"}))
    assert sorted(p.name for p in out.iterdir()) == ["model_state.pt", "notes.txt", "result.json"]
    assert (out / "result.json").read_text() == "r" and (out / "notes.txt").read_text() == "mine"


def test_a_failed_write_changes_nothing(tmp_path):
    out = tmp_path / "run"
    write_run(out, _writer(**{"model.pt2": "old"}))

    def fails(folder):
        (folder / "model_state.pt").write_text("half")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        write_run(out, fails)
    assert [p.name for p in out.iterdir()] == ["model.pt2"]
    assert (out / "model.pt2").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["run"]


def test_a_file_in_the_folders_place_is_refused(tmp_path):
    (tmp_path / "run").write_text("a file")
    with pytest.raises(OpswapError, match="is a file"):
        write_run(tmp_path / "run", _writer(**{"plan.json": "1"}))
