import torch
from torch import nn

from opswap.graph import capture
from opswap.models import load
from opswap.planner import apply_plan, make_plan
from opswap.report.model_io import load_model, save_model


def test_optimized_model_round_trips_through_pt2(tmp_path):
    m = load("zoo:resnet")
    c = capture(m.module, m.example_inputs)
    plan = make_plan(c, rules="fusion.*")
    gm = apply_plan(c, plan).gm
    files = save_model(gm, c.example_inputs, plan, tmp_path)
    assert files["model"].name == "model.pt2"
    back = load_model(tmp_path)
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
    files = save_model(m, (torch.randn(2, 4),), None, tmp_path)
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
    assert save_model(_TopK(), (x,), None, tmp_path)["model"].name == "model_state.pt"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model_state.pt", "model_state.txt"]
    lin = nn.Linear(4, 4).eval()
    assert save_model(lin, (x,), None, tmp_path)["model"].name == "model.pt2"
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt2"]
    y = torch.randn(3, 4)
    with torch.no_grad():
        torch.testing.assert_close(load_model(tmp_path)(y), lin(y))
    save_model(_TopK(), (x,), None, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model_state.pt", "model_state.txt"]
