"""backends.executorch: a model and opswap's result lowered to ExecuTorch (XNNPACK), raced,
saved as the timed model.pte, reloaded, and refused in one sentence outside its bounds."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import opswap
from opswap import artifact
from opswap.backends.executorch import executorch_artifact, upper_bound
from opswap.errors import InputError


class _Net(nn.Module):
    """Conv + BN (eval, stateful) + in-place ReLU, a counter buffer the forward reads."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6)
        self.fc = nn.Linear(6, 5)
        self.register_buffer("shift", torch.tensor(0.25))

    def forward(self, x):
        h = self.bn(self.conv(x))
        h = torch.relu_(h)
        return self.fc(h.mean((2, 3))) + self.shift


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = _Net().eval()
    model.bn.running_var.uniform_(0.5, 2.0)
    model.bn.running_mean.uniform_(-0.3, 0.3)
    return model


def test_export_executorch_races_both_files_and_saves_the_timed_pte(tmp_path):
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 3, 12, 12)
    result = opswap.optimize(model, (x,), compare="none", export="executorch", name="net")
    rows = {v.name: v for v in result.variants}
    assert {"executorch", "opswap+executorch"} <= set(rows)
    assert rows["executorch"].verified and rows["opswap+executorch"].verified, (
        rows["executorch"].note,
        rows["opswap+executorch"].note,
    )
    assert "model.pte in ExecuTorch" in rows["opswap+executorch"].note
    assert result.best in ("executorch", "opswap+executorch")
    assert "batch 1" in result.verified_as["shapes"]
    timed = result.saved_artifact
    assert timed is not None and timed.path.suffix == ".pte"
    paths = result.save(tmp_path)
    assert paths["model"] == tmp_path / "model.pte"
    assert not (tmp_path / "model.pt2").exists() and not (tmp_path / "model.onnx").exists()
    assert (tmp_path / "model.pte").read_bytes() == timed.path.read_bytes()
    data = json.loads((tmp_path / "result.json").read_text())
    assert data["deploy"]["artifact"] == "model.pte" and "XNNPACK" in data["deploy"]["run_under"]
    loaded = artifact.load(tmp_path)  # in ExecuTorch's runtime
    xb = torch.randn(5, 3, 9, 9)  # another batch and another spatial size
    with torch.no_grad():
        want = model(xb)
    torch.testing.assert_close(loaded(xb), want, atol=1e-5, rtol=1e-4)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_opswap_ops_and_nhwc_weights_are_lowered_and_sizes_past_the_bound_are_refused():
    from opswap.api import capture
    from opswap.backends.pt2 import export

    model = _model()
    x = torch.randn(3, 3, 10, 10)
    cap = capture(model, (x,))
    # opswap's fused conv + ReLU op, put in by hand: the .pte must hold only ATen/XNNPACK ops
    gm = cap.gm
    from opswap.kernels import conv_relu  # noqa: F401  (registers opswap::conv_relu)

    class _Fused(nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x):
            c = self.net.conv
            h = torch.ops.opswap.conv_relu(x, c.weight, c.bias, [1, 1], [1, 1], [1, 1], 1)
            return self.net.fc(h.mean((2, 3)))

    fused = _Fused(model).eval()
    # as layout.channels_last leaves it: an NHWC weight, which XNNPACK's passes refuse
    w = model.conv.weight
    w.data = w.data.contiguous(memory_format=torch.channels_last)
    ex = export(fused, (x,), cap.dynamic)
    assert any("conv_relu" in str(n.target) for n in ex[0].graph.nodes)
    art = executorch_artifact(None, (x,), cap.dynamic, exported=ex)
    assert art.error is None, art.error
    with torch.no_grad():
        torch.testing.assert_close(art.module(x), fused(x), atol=1e-5, rtol=1e-4)
    batch = next(a for a in cap.dynamic.axes if a.name == "batch")
    assert upper_bound(batch) == 12 and "batch up to 12" in art.note
    with pytest.raises(InputError, match="accepts batch up to 12"):
        art.module(torch.randn(13, 3, 10, 10))
    assert gm is cap.gm  # the capture's graph is not replaced by the lowering
