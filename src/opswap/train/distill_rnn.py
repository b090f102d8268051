"""Replace a recurrent sequence classifier by a small Transformer encoder and distil it:
the lossy route of chapter 19 (RNN -> Transformer).

    teacher = ...                                        # e.g. zoo:seq's LSTM -> GRU classifier
    student = opswap.train.distill_rnn.student_for(teacher, length=8, classes=10)
    report = opswap.train.distill_rnn.distill(teacher, student, data, steps=300)

A recurrence runs its T steps one after another; an encoder layer sees every position at
once (one attention and one MLP per layer, as batched GEMMs), so on a parallel device it
trades the T-step dependency chain for O(T^2) attention, which pays at the short and
medium lengths of most sequence classifiers. The function changes, so nothing here is
exact: the student starts from random weights, learns the teacher's soft outputs
(temperature-scaled KL divergence, plus cross-entropy where labels are given), and the
report gives the task accuracy of the teacher and of the student before and after, the
agreement of their top-1 answers, the parameter counts and the measured speed ratio.

`digits_sequences()` is the sample task: scikit-learn's 8x8 digits read as 8 time steps
of 8 pixels; `synthetic_sequences()` needs no download (the class is the frequency of a
noisy sinusoid).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from opswap.errors import OpswapError
from opswap.train._loop import train_steps


class DistillError(OpswapError, ValueError):
    """A model or data set the distillation cannot take."""


@dataclass(frozen=True)
class Sequences:
    """A classification task on sequences: x [N, T, F] float32, y [N] int64."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor

    @property
    def classes(self) -> int:
        return int(self.train_y.max()) + 1


def digits_sequences() -> Sequences:
    """scikit-learn's digits, each 8x8 image as 8 steps of 8 pixels (needs scikit-learn)."""
    from opswap.models.zoo_digits import digits

    d = digits("the digits sequences")
    return Sequences(d.train_x.view(-1, 8, 8), d.train_y, d.test_x.view(-1, 8, 8), d.test_y)


def synthetic_sequences(
    n: int = 1200, length: int = 12, features: int = 4, classes: int = 4, seed: int = 0
) -> Sequences:
    """Noisy sinusoids: class k oscillates at frequency (k + 1) / length over the steps,
    with a random phase and amplitude per feature; a quarter of the samples are the test."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    t = torch.arange(length, dtype=torch.float32)
    phase = torch.rand(n, 1, features, generator=g) * 2 * math.pi
    amp = 0.5 + torch.rand(n, 1, features, generator=g)
    freq = (y.float() + 1)[:, None, None] * 2 * math.pi / length
    x = amp * torch.sin(freq * t[None, :, None] + phase)
    x = x + 0.3 * torch.randn(n, length, features, generator=g)
    cut = n * 3 // 4
    return Sequences(x[:cut], y[:cut], x[cut:], y[cut:])


class SeqTransformer(nn.Module):
    """A Transformer-encoder sequence classifier: input projection, learned positions,
    `layers` pre-norm encoder layers (no dropout), the last position's state through a
    LayerNorm and a Linear head (as an RNN classifier reads its last step)."""

    def __init__(
        self, features: int, classes: int, length: int, width: int, layers: int = 1, heads: int = 4
    ) -> None:
        super().__init__()
        if width % heads:
            raise DistillError(f"the width {width} is not a multiple of the {heads} heads")
        self.length = length
        self.embed = nn.Linear(features, width)
        self.pos = nn.Parameter(torch.randn(length, width) * 0.02)
        layer = nn.TransformerEncoderLayer(
            width, heads, 2 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, T, F]
        if x.shape[1] > self.length:
            raise DistillError(
                f"a sequence of {x.shape[1]} steps is longer than the {self.length} positions "
                "the student was built for"
            )
        h = self.embed(x) + self.pos[: x.shape[1]]
        h = self.encoder(h)
        return self.head(self.norm(h[:, -1]))


def parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def student_for(
    teacher: nn.Module, features: int, classes: int, length: int, layers: int = 1, heads: int = 4
) -> SeqTransformer:
    """A SeqTransformer whose parameter count is closest to the teacher's, over widths
    that are multiples of `heads`."""
    target = parameters(teacher)
    best: tuple[int, int] | None = None
    for width in range(heads, 1025, heads):
        n = parameters(SeqTransformer(features, classes, length, width, layers, heads))
        if best is None or abs(n - target) < abs(best[1] - target):
            best = (width, n)
        if n > target:
            break
    assert best is not None
    return SeqTransformer(features, classes, length, best[0], layers, heads)


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(-1) == y).float().mean())


def agreement(a: nn.Module, b: nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        return float((a(x).argmax(-1) == b(x).argmax(-1)).float().mean())


def forward_ms(model: nn.Module, x: torch.Tensor, repeats: int = 20) -> float:
    """The median time of one forward on x (after two warm-up calls), in milliseconds."""
    model.eval()
    times = []
    with torch.no_grad():
        for i in range(repeats + 2):
            if x.is_cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(x)
            if x.is_cuda:
                torch.cuda.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - t0)
    times.sort()
    return 1e3 * times[len(times) // 2]


@dataclass(frozen=True)
class Report:
    """What the distillation did: task accuracies (teacher, student before and after),
    top-1 agreement with the teacher, parameter counts, forward times on the test set's
    first `timed_batch` samples and their ratio (teacher / student: > 1 is a faster
    student), and the loss at the first and last step."""

    teacher_accuracy: float
    student_accuracy_before: float
    student_accuracy_after: float
    agreement_before: float
    agreement_after: float
    teacher_params: int
    student_params: int
    teacher_ms: float
    student_ms: float
    speed_ratio: float
    timed_batch: int
    steps: int
    loss_first: float
    loss_last: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def distill(
    teacher: nn.Module,
    student: nn.Module,
    data: Sequences,
    *,
    steps: int = 300,
    batch: int = 64,
    lr: float = 3e-3,
    temperature: float = 2.0,
    label_weight: float = 0.5,
    timed_batch: int = 64,
    progress: Callable[[int, float], None] | None = None,
    seed: int = 0,
) -> Report:
    """Train `student` to match `teacher`'s outputs on `data`'s training sequences
    (KL at `temperature`, plus `label_weight` x cross-entropy on the labels); the teacher
    is not changed. Both are left in eval mode."""
    if data.train_x.dim() != 3 or len(data.train_x) != len(data.train_y):
        raise DistillError(
            "the training data must be sequences [N, T, F] with one label each; got "
            f"{list(data.train_x.shape)} and {list(data.train_y.shape)}"
        )
    teacher.eval()
    student.eval()
    before = accuracy(student, data.test_x, data.test_y)
    agree_before = agreement(student, teacher, data.test_x)
    with torch.no_grad():
        soft = teacher(data.train_x)
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(data.train_x), generator=g)
    batches = [order[i : i + batch] for i in range(0, len(order), batch)]

    def step_loss(idx: torch.Tensor) -> torch.Tensor:
        logits = student(data.train_x[idx])
        t = temperature
        kl = F.kl_div(
            F.log_softmax(logits / t, -1),
            F.log_softmax(soft[idx] / t, -1),
            log_target=True,
            reduction="batchmean",
        )
        return kl * t * t + label_weight * F.cross_entropy(logits, data.train_y[idx])

    losses = train_steps(student, batches, step_loss, steps=steps, lr=lr, progress=progress)
    student.eval()
    x = data.test_x[:timed_batch]
    t_ms, s_ms = forward_ms(teacher, x), forward_ms(student, x)
    return Report(
        accuracy(teacher, data.test_x, data.test_y),
        before,
        accuracy(student, data.test_x, data.test_y),
        agree_before,
        agreement(student, teacher, data.test_x),
        parameters(teacher),
        parameters(student),
        t_ms,
        s_ms,
        t_ms / s_ms,
        len(x),
        steps,
        losses[0],
        losses[-1],
    )


def train_teacher(
    model: nn.Module, data: Sequences, *, steps: int = 300, batch: int = 64, lr: float = 1e-2
) -> float:
    """Train a sequence classifier on `data`'s labels (cross-entropy); its test accuracy.
    For examples and tests that need a teacher worth distilling."""
    g = torch.Generator().manual_seed(1)
    order = torch.randperm(len(data.train_x), generator=g)
    batches = [order[i : i + batch] for i in range(0, len(order), batch)]
    train_steps(
        model,
        batches,
        lambda idx: F.cross_entropy(model(data.train_x[idx]), data.train_y[idx]),
        steps=steps,
        lr=lr,
    )
    model.eval()
    return accuracy(model, data.test_x, data.test_y)
