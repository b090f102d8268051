"""activation.pointwise: takes GPT-2's gelu_new (transformers, from a config), each
written-out spelling (gelu_new, FastGELU, QuickGELU, hard-swish and hard-sigmoid with
relu6, nn.ReLU6, clamp and hardtanh) and every activation of x + a 1-D bias, in both
capture flavours, where the crossover table says the kernel wins; the rewritten model
matches the user's at other batch sizes and lengths; refuses other broadcasts, integer
and promoting sums, a sum read elsewhere and other clamp bounds, with their reasons;
without a measurement a CUDA target keeps eager's ops and a CPU target skips."""

from __future__ import annotations

import math
from functools import cache

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opswap.graph.capture import capture
from opswap.kernels import crossover
from opswap.models import load
from opswap.rules._triton import CPU_REASON

from .._triton_models import fired, ops_in, plan, reasons

RULE = "activation.pointwise"
H = 24


@pytest.fixture
def measured_win(monkeypatch):
    """A crossover table in which every bias_act form beats eager at every shape (a test's
    stand-in for a measurement; the shipped table has none)."""
    real = crossover.lookup

    def lookup(kernel, device, dtype, hidden, rows, pass_="forward", entries=None, shape=None):
        if kernel.startswith("bias_act"):
            cls = crossover.shape_class(hidden, rows)
            return crossover.Entry(
                kernel, device, str(dtype).removeprefix("torch."), cls, pass_, True, None, 1.5
            )
        return real(kernel, device, dtype, hidden, rows, pass_, entries, shape)

    monkeypatch.setattr(crossover, "lookup", lookup)


def sites(p) -> list[tuple[str, str, bool]]:
    """(form, activation, whether the bias went in) of each decision, sorted."""
    return sorted(
        (d.site.data["form"], d.site.data["activation"], d.site.data["bias"])
        for d in p.decisions
        if d.rule == RULE
    )


@cache
def gpt2():
    lm = load("hf:gpt2")  # 2 layers, n_embd 64: the MLP's gelu_new on [B, S, 256]
    return lm, capture(lm.module, lm.example_inputs)


def test_fires_on_the_gelu_new_of_a_tiny_gpt2(measured_win):
    lm, cap = gpt2()
    p, applied, _ = plan(lm.module, lm.example_inputs, [RULE], captured=cap)
    assert sites(p) == [("gelu_new", "gelu_tanh", False)] * 2, (p.decisions, p.misses)
    assert ops_in(applied.gm).count(torch.ops.opswap.bias_act.default) == 2
    assert torch.ops.aten.tanh.default not in ops_in(applied.gm)


def test_without_a_measurement_cuda_keeps_eager_and_cpu_skips():
    lm, cap = gpt2()
    p, applied, _ = plan(lm.module, lm.example_inputs, [RULE], captured=cap)
    assert not p.decisions and torch.ops.opswap.bias_act.default not in ops_in(applied.gm)
    skipped = [s.reason for s in p.skipped if s.rule == RULE]
    assert len(skipped) == 2
    assert all("no measured crossover for bias_act:gelu_new" in r for r in skipped)
    p2, _, _ = plan(lm.module, lm.example_inputs, [RULE], target="cpu", captured=cap)
    assert not p2.decisions and all(CPU_REASON in s.reason for s in p2.skipped)


def gelu_new(x):  # transformers' NewGELUActivation
    return (
        0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    )


class Spellings(nn.Module):
    """Each written-out formula, and each activation of x + b (a parameter, a buffer, a
    BatchNorm's output), with an in-place op on a result."""

    def __init__(self):
        super().__init__()
        self.b = nn.Parameter(torch.randn(H))
        self.register_buffer("shift", torch.randn(H))
        self.relu6 = nn.ReLU6()
        self.gelu = nn.GELU()
        self.gelu_tanh = nn.GELU(approximate="tanh")
        self.leaky = nn.LeakyReLU(0.2)
        self.bn = nn.BatchNorm1d(H)  # eval: its running statistics (a stateful module)

    def forward(self, x):
        out = [
            gelu_new(x),
            0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x))),  # FastGELU
            x * torch.sigmoid(1.702 * x),  # QuickGELU
            x * F.relu6(x + 3) / 6,
            x * (self.relu6(x + 3) / 6),  # the hard-sigmoid inside is the hard-swish's
            x * torch.clamp(x + 3, 0, 6) / 6,
            F.hardtanh(x + 3, 0.0, 6.0) / 6,  # hard-sigmoid
            F.relu(x + self.b),
            F.relu6(x + self.b),
            self.leaky(self.b + x),
            F.hardswish(x + self.shift),
            F.hardsigmoid(x + self.b),
            self.gelu(x + self.b),
            self.gelu_tanh(x + self.shift),
            gelu_new(x + self.b),  # the bias goes in with the formula
            self.gelu(self.bn(x.transpose(1, 2)).transpose(1, 2) + self.b),  # non-contiguous x
        ]
        s = x + self.b
        out.append(s * torch.sigmoid(1.702 * s))  # QuickGELU of x + b
        y = F.silu(x + self.b)
        y.mul_(2)  # in place, on the kernel's output
        return torch.stack([*out, y])


def _spellings():
    torch.manual_seed(11)
    m = Spellings().eval()
    with torch.no_grad():
        m.bn.running_mean.uniform_(-0.5, 0.5)
        m.bn.running_var.uniform_(0.5, 1.5)
    return m


@pytest.mark.parametrize("method", ["fx", "export"])
def test_fires_on_every_spelling_and_activation_of_x_plus_b(measured_win, method):
    x = torch.randn(2, 5, H) * 3
    p, applied, cap = plan(_spellings(), (x,), [RULE], method=method)
    assert cap.dynamic.axis("batch") and len(cap.dynamic.axes) == 2, cap.dynamic.describe()
    assert sites(p) == sorted(
        [
            ("gelu_new", "gelu_tanh", False),
            ("fast_gelu", "gelu_tanh", False),
            ("quick_gelu", "quick_gelu", False),
            ("hardswish", "hardswish", False),
            ("hardswish", "hardswish", False),
            ("hardswish", "hardswish", False),
            ("hardsigmoid", "hardsigmoid", False),
            *[("bias", a, True) for a in ("relu", "relu6", "leaky_relu", "hardswish")],
            *[("bias", a, True) for a in ("hardsigmoid", "gelu", "gelu_tanh", "gelu", "silu")],
            ("gelu_new", "gelu_tanh", True),
            ("quick_gelu", "quick_gelu", True),
        ]
    ), (p.decisions, p.misses)
    assert ops_in(applied.gm).count(torch.ops.opswap.bias_act.default) == 18
    slopes = {n.args[3] for n in applied.gm.graph.nodes if n.args[2:3] == ("leaky_relu",)}
    assert slopes == {0.2}
    assert not [m for m in p.misses if m.rule == RULE], p.misses


class Refusals(nn.Module):
    def __init__(self):
        super().__init__()
        self.b = nn.Parameter(torch.randn(H))
        self.register_buffer("ib", torch.arange(H))

    def forward(self, x):
        s = x + self.b
        return torch.stack(
            [
                F.relu(x.transpose(1, 2) + self.b.view(H, 1)).transpose(1, 2),  # along dim 1
                F.gelu(s) + s,  # the sum read again
                F.relu((x * 10).long() + self.ib).float(),  # integers
                F.gelu(x.half() + self.b),  # float16 + float32: promotes
                x * F.hardtanh(x + 3, -1.0, 1.0) / 6,  # not hard-swish's clamp
                F.relu(x + self.b, inplace=True) * 2,  # in place into a temporary: taken
            ]
        )


@pytest.mark.parametrize("method", ["fx", "export"])
def test_refuses_what_the_kernel_does_not_compute_with_reasons(measured_win, method):
    torch.manual_seed(3)
    p, _, _ = plan(Refusals().eval(), (torch.randn(2, 5, H),), [RULE], method=method)
    why = reasons(p, RULE)
    assert "other than a 1-D bias along the last dim" in why, why
    assert "also read by" in why and "outside the ops this rewrite replaces" in why, why
    assert "is torch.int64; the kernel takes bfloat16, float16 or float32" in why, why
    assert "from torch.float16 to torch.float32; the op keeps x's dtype" in why, why
    assert "clamps to other bounds than [0, 6]" in why, why
    # the in-place relu writes into a sum nothing else reads: safe to take in both flavours
    assert sites(p) == [("bias", "relu", True)] and fired(p, RULE) == 1
