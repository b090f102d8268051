"""Quantisation-aware training: train a model with int8 rounding simulated in its forward,
then convert it to the real int8 model that opswap's static rules build.

    qat = opswap.train.qat.prepare(model)                  # a copy; the model is not changed
    opswap.train.qat.fine_tune(qat, batches, loss_fn, steps=200)
    int8 = opswap.train.qat.convert(qat, example_inputs)   # onednn int8 convolutions and GEMMs

`prepare` wraps every Conv2d and Linear of a copy in a module that rounds its input and
its weight the way the int8 kernels will (`torch.fake_quantize_per_tensor_affine` for
the input, uint8 with a zero point over a range tracked while training; per output
channel for the weight, int8 at this CPU's weight range), in the forward only: the
backward passes the gradient straight through the rounding (where the value was inside
the range; zero where it was clipped), which is the straight-through estimator. The
network learns weights whose rounded form works, and an input range it can live with.

`convert` captures the trained model without the wrappers, hands each layer's input the
range training settled on (in place of calibration), and plans `fusion.*` and
`precision.int8_static_*` on it: BatchNorms fold into the convolutions first (per-
channel weight rounding commutes with the fold: scaling a channel scales its step), and
each layer becomes the int8 layer static quantisation would build, with the learned
range. The result is what the QAT model computed in eval mode, up to the float rounding
of the fold (a test checks it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from opswap.errors import RuleError
from opswap.graph.calibrate import Calibration, attach
from opswap.graph.capture import capture, copy_module
from opswap.graph.observers import Observer, qparams
from opswap.kernels import int8_static
from opswap.rules.precision.int8_static_conv import MIN_CHANNELS
from opswap.rules.precision.int8_static_linear import MIN_FEATURES
from opswap.train._loop import args_of, train_steps

_OBSERVER = "opswap.observer"


class _FakeQuant(nn.Module):
    """Rounds what passes through to uint8 over a range that follows the values seen in
    training (a moving average of each batch's min and max, `momentum` per step), fixed
    in eval mode; the gradient passes straight through inside the range."""

    lo: torch.Tensor
    hi: torch.Tensor

    def __init__(self, momentum: float = 0.1):
        super().__init__()
        self.momentum = momentum
        self.register_buffer("lo", torch.tensor(math.inf))
        self.register_buffer("hi", torch.tensor(-math.inf))

    @property
    def ready(self) -> bool:
        return bool(torch.isfinite(self.lo) and torch.isfinite(self.hi))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                lo, hi = x.detach().min(), x.detach().max()
                if not self.ready:
                    self.lo.copy_(lo)
                    self.hi.copy_(hi)
                else:
                    self.lo.lerp_(lo, self.momentum)
                    self.hi.lerp_(hi, self.momentum)
        if not self.ready:
            return x
        p = qparams(float(self.lo), float(self.hi), symmetric=False)
        return torch.fake_quantize_per_tensor_affine(x, p.scale, p.zero_point, 0, 255)


def _fake_weight(w: torch.Tensor, qmax: int) -> torch.Tensor:
    flat = w.detach().reshape(w.shape[0], -1).abs().amax(dim=1)
    scale = (flat.clamp_min(1e-12) / qmax).float()
    zero = torch.zeros(w.shape[0], dtype=torch.int32)
    return torch.fake_quantize_per_channel_affine(w, scale, zero, 0, -qmax, qmax)


class QATLinear(nn.Module):
    """A Linear whose input and weight are rounded as the int8 kernel will round them."""

    def __init__(self, linear: nn.Linear, qmax: int):
        super().__init__()
        self.inner = linear
        self.qmax = qmax
        self.input_quant = _FakeQuant()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = _fake_weight(self.inner.weight, self.qmax)
        return F.linear(self.input_quant(x), w, self.inner.bias)


class QATConv2d(nn.Module):
    """A Conv2d whose input and weight are rounded as the int8 kernel will round them."""

    def __init__(self, conv: nn.Conv2d, qmax: int):
        super().__init__()
        self.inner = conv
        self.qmax = qmax
        self.input_quant = _FakeQuant()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.inner
        w = _fake_weight(c.weight, self.qmax)
        return c._conv_forward(self.input_quant(x), w, c.bias)


_WRAPPERS = (QATLinear, QATConv2d)


def _swap(module: nn.Module, make: Callable[[nn.Module], nn.Module | None]) -> int:
    n = 0
    for name, child in list(module.named_children()):
        new = make(child)
        if new is not None:
            setattr(module, name, new)
            n += 1
        else:
            n += _swap(child, make)
    return n


def prepare(model: nn.Module, *, qmax: int | None = None) -> nn.Module:
    """A copy of `model` in training mode with each Conv2d (zero padding, at least
    MIN_CHANNELS outputs) and Linear (at least MIN_FEATURES in and out) wrapped for
    quantisation-aware training, the layers static int8 quantises; `model` itself is
    not changed."""
    qmax = int8_static.weight_qmax() if qmax is None else qmax
    out = copy_module(model)

    def make(child: nn.Module) -> nn.Module | None:
        # the layers precision.int8_static_* would quantise; smaller ones stay float32
        if isinstance(child, _WRAPPERS):
            return None
        if isinstance(child, nn.Linear) and min(child.weight.shape) >= MIN_FEATURES:
            return QATLinear(child, qmax)
        if (
            isinstance(child, nn.Conv2d)
            and child.padding_mode == "zeros"
            and not isinstance(child.padding, str)
            and child.out_channels >= MIN_CHANNELS
        ):
            return QATConv2d(child, qmax)
        return None

    if _swap(out, make) == 0:
        raise RuleError(
            f"{type(model).__name__} has no Conv2d or Linear to train for int8; "
            "quantisation-aware training wraps those layers."
        )
    return out.train()


def fine_tune(
    model: nn.Module,
    batches: Iterable[tuple[Any, torch.Tensor]],
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    *,
    steps: int = 100,
    lr: float = 1e-4,
    progress: Callable[[int, float], None] | None = None,
) -> list[float]:
    """A short fine-tuning of a `prepare`d model: Adam at `lr` for `steps` steps over
    `batches` ((inputs, target) pairs, cycled; inputs a tensor or a tuple of them),
    `loss_fn(output, target)`. Returns the loss of each step; `progress(step, loss)` is
    called after each. BatchNorm statistics keep updating (the model is in train mode)."""
    data = list(batches)
    if not data:
        raise RuleError("fine_tune got no batches; pass (inputs, target) pairs to train on.")

    def step_loss(batch: tuple[Any, torch.Tensor]) -> torch.Tensor:
        inputs, target = batch
        return loss_fn(model(*args_of(inputs)), target)

    return train_steps(model, data, step_loss, steps=steps, lr=lr, progress=progress)


def _ranges(model: nn.Module) -> dict[str, tuple[float, float]]:
    """'path' (the layer's path in the unwrapped model) -> its input's trained range."""
    out = {}
    for path, mod in model.named_modules():
        if isinstance(mod, _WRAPPERS):
            fq = mod.input_quant
            assert isinstance(fq, _FakeQuant)
            if not fq.ready:
                raise RuleError(
                    f"QAT layer {path} never saw an input in training mode; run fine_tune "
                    "(or a forward in train mode) before convert."
                )
            out[path] = (float(fq.lo), float(fq.hi))
    return out


def unwrap(model: nn.Module) -> nn.Module:
    """A copy of a `prepare`d model with its plain Conv2d and Linear layers back, holding
    the trained weights, in eval mode."""
    out = copy_module(model)
    _swap(out, lambda c: c.inner if isinstance(c, _WRAPPERS) else None)
    return out.eval()


def _fixed(lo: float, hi: float) -> Observer:
    obs = Observer()
    obs.lo, obs.hi, obs.count = lo, hi, 1
    return obs


def convert(model: nn.Module, example_inputs: Any) -> nn.Module:
    """The real int8 model of a `prepare`d and trained model: opswap's static int8 rules
    (after the BatchNorm folds) with each layer's input range the one QAT trained."""
    from opswap.planner import apply_plan, make_plan
    from opswap.targets.base import Target

    ranges = _ranges(model)
    plain = unwrap(model)
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    cap = capture(plain, inputs)
    attach(cap.gm, Calibration([inputs], method="minmax", source="QAT-trained ranges"))
    for node in cap.gm.graph.nodes:
        r = ranges.get(str(node.target)) if node.op == "call_module" else None
        if r is not None and node.args and isinstance(node.args[0], torch.fx.Node):
            src = node.args[0]
            src.meta[_OBSERVER] = _fixed(*r)
            src.meta["opswap.observed_once"] = True
    for node in cap.gm.graph.nodes:  # nodes no QAT layer reads: no calibration run for them
        node.meta.setdefault("opswap.observed_once", True)
    # a fixed profile where int8 pays, so that the conversion does not depend on timing
    # this machine: QAT asked for int8, and every wrapped layer is converted
    always = Target(
        name="qat-convert",
        description="converts every QAT layer",
        kind="cpu",
        peak_flops={"float32": 1e11, "int8": 1e14},
        mem_bandwidth=1e12,
        memory_bytes=2**40,
        dtypes=("float32", "int8"),
    )
    plan = make_plan(
        cap,
        rules=["fusion.conv_bn", "fusion.linear_bn", "precision.int8_static_*"],
        exactness="approx",
        target=always,
    )
    return apply_plan(cap, plan).gm
