"""opswap.train.qat: prepare wraps the layers static int8 quantises (a copy; the model is not
changed), the straight-through estimator trains through the rounding, convert builds the
real int8 model from the trained ranges and it computes what the QAT model computed,
and training through the rounding learns."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opswap.errors import RuleError
from opswap.kernels import int8_static
from opswap.rules.precision._int8_static_module import Int8StaticConv2d, Int8StaticLinear
from opswap.train import qat

pytestmark = pytest.mark.skipif(
    not int8_static.onednn_available(), reason="onednn's int8 kernels need an x86 CPU torch"
)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 4 * 4, 32)
        self.head = nn.Linear(32, 4)  # too small for int8: stays float

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x)))
        x = torch.relu(self.conv2(x))
        x = F.max_pool2d(x, 2).flatten(1)
        return self.head(torch.relu(self.fc(x)))


def _data(n=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=g)
    # a label that depends on the sign pattern of the quadrants
    q = x.reshape(n, 2, 4, 2, 4).mean(dim=(2, 4)).reshape(n, 4)
    return x, q.argmax(dim=1)


def _train(model, x, y, steps=60, lr=1e-2):
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for i in range(steps):
        sl = slice((i * 64) % len(x), (i * 64) % len(x) + 64)
        opt.zero_grad()
        F.cross_entropy(model(x[sl]), y[sl]).backward()
        opt.step()
    return model.eval()


def test_prepare_wraps_a_copy_and_the_gradient_passes_the_rounding():
    torch.manual_seed(0)
    model = Net().eval()
    before = copy.deepcopy(model.state_dict())
    q = qat.prepare(model)
    assert isinstance(q.conv, qat.QATConv2d) and isinstance(q.fc, qat.QATLinear)
    assert isinstance(q.head, nn.Linear) and not isinstance(q.head, qat.QATLinear)
    assert isinstance(model.conv, nn.Conv2d) and q.training
    x, y = _data(32)
    loss = F.cross_entropy(q(x), y)
    loss.backward()
    for p in (q.conv.inner.weight, q.fc.inner.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0  # straight through
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # eval mode: the rounding is there (differs from float) but small
    q.eval()
    with torch.no_grad():
        float_out, fq_out = qat.unwrap(q)(x), q(x)
    rel = float((fq_out - float_out).norm() / float_out.norm())
    assert 0 < rel < 0.05


def test_convert_computes_what_the_qat_model_computed():
    torch.manual_seed(1)
    x, y = _data()
    q = qat.prepare(_train(Net(), x, y))
    losses = qat.fine_tune(q, [(x[i : i + 64], y[i : i + 64]) for i in range(0, 256, 64)],
                           F.cross_entropy, steps=20, lr=1e-3)  # fmt: skip
    assert len(losses) == 20
    int8 = qat.convert(q, (x[:8],))
    mods = list(int8.modules())
    assert sum(isinstance(m, Int8StaticConv2d) for m in mods) == 2
    assert sum(isinstance(m, Int8StaticLinear) for m in mods) == 1
    assert not any(isinstance(m, nn.BatchNorm2d) for m in mods)  # folded before quantising
    q.eval()
    xt, _ = _data(40, seed=5)  # another batch size than the example's
    with torch.no_grad():
        want, got = q(xt), int8(xt)
    # same rounding, same ranges: only the BatchNorm fold's float rounding may differ, which
    # can move a value across a rounding boundary now and then
    rel = float((got - want).norm() / want.norm())
    assert rel < 0.01, rel


def test_training_from_scratch_through_the_rounding_learns_the_task():
    """If the straight-through gradient were broken (zero, or the rounding's own), a QAT
    model trained from scratch would stay near chance (25%); float training of the same
    net reaches about 82% here. The int8 model converted from it keeps its accuracy."""
    torch.manual_seed(2)
    x, y = _data(512)
    xt, yt = _data(512, seed=9)

    def acc(fn):
        with torch.no_grad():
            return float((fn(xt).argmax(1) == yt).float().mean())

    q = qat.prepare(Net())
    batches = [(x[i : i + 64], y[i : i + 64]) for i in range(0, 512, 64)]
    losses = qat.fine_tune(q, batches, F.cross_entropy, steps=120, lr=1e-2)
    assert sum(losses[-10:]) < sum(losses[:10])
    q.eval()
    int8 = qat.convert(q, (x[:8],))
    assert acc(q) > 0.7, acc(q)
    assert abs(acc(int8) - acc(q)) <= 0.02, (acc(q), acc(int8))


def test_clear_errors():
    with pytest.raises(RuleError, match="no Conv2d or Linear"):
        qat.prepare(nn.Sequential(nn.ReLU()))
    q = qat.prepare(Net())
    with pytest.raises(RuleError, match="never saw an input"):
        qat.convert(q, (torch.randn(2, 1, 8, 8),))
    with pytest.raises(RuleError, match="no batches"):
        qat.fine_tune(q, [], F.cross_entropy)
