"""Chapter 19: recurrent networks.

Exact: a Python loop over an LSTMCell (T calls of one cell, as a user writes a decoder or
a custom recurrence) is planned with rnn.cell_loop, which replaces it by one nn.LSTM with
the cell's weights; the rewrite is checked against the loop at another batch size and
timed against it here (benchmarks/bench_rnn.py times the grid, and on CUDA opswap's own
Triton kernel, opswap::lstm_seq, beside cuDNN).
Lossy: an LSTM -> GRU classifier (zoo:seq's architecture) trained on scikit-learn's digits
read as 8 rows of 8 pixels is distilled into a one-layer Transformer encoder of about the
same size (opswap.train.distill_rnn), with its accuracy before and after.

    python examples/ch19_rnn.py
"""

from __future__ import annotations

import time

import torch
from torch import nn

from opswap.graph.capture import capture
from opswap.models.zoo_misc import RecurrentClassifier
from opswap.planner import apply_plan, make_plan
from opswap.train import distill_rnn


class Loop(nn.Module):
    """Every step's h of an LSTMCell run over x [B, T, F] from a given state."""

    def __init__(self, features: int, hidden: int, steps: int) -> None:
        super().__init__()
        self.cell, self.steps = nn.LSTMCell(features, hidden), steps

    def forward(self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        outs = []
        for t in range(self.steps):
            h, c = self.cell(x[:, t], (h, c))
            outs.append(h)
        return torch.stack(outs, 1)


def _ms(fn, *args, repeats: int = 20) -> float:
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(*args)
            times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[len(times) // 2]


def exact() -> None:
    torch.manual_seed(0)
    model = Loop(32, 64, steps=48).eval()
    xs = (torch.randn(4, 48, 32), torch.randn(4, 64), torch.randn(4, 64))
    cap = capture(model, xs)
    plan = make_plan(cap, rules=["rnn.*"])
    for d in plan.decisions:
        print(f"{d.rule:16s} {d.site.description}")
    for s in plan.skipped:
        print(f"{'skipped':16s} {s.where}: {s.reason}")
    gm = apply_plan(cap, plan).gm
    other = (torch.randn(1, 48, 32), torch.randn(1, 64), torch.randn(1, 64))
    with torch.no_grad():
        err = float((gm(*other) - model(*other)).abs().max())
    print(f"max |rewritten - loop| at batch 1: {err:.1e}")
    loop_ms, seq_ms = _ms(model, *xs), _ms(gm, *xs)
    print(f"cell loop {loop_ms:.2f} ms, one nn.LSTM {seq_ms:.2f} ms: {loop_ms / seq_ms:.1f}x")


def lossy() -> None:
    torch.manual_seed(0)
    data = distill_rnn.digits_sequences()
    teacher = RecurrentClassifier(8, 32, data.classes)
    distill_rnn.train_teacher(teacher, data, steps=120)
    student = distill_rnn.student_for(teacher, 8, data.classes, length=8)
    r = distill_rnn.distill(teacher, student, data, steps=120)
    print(
        f"digits rows as sequences: LSTM->GRU teacher {r.teacher_accuracy:.3f} "
        f"({r.teacher_params} parameters)"
    )
    print(
        f"  Transformer student ({r.student_params} parameters): "
        f"{r.student_accuracy_before:.3f} before, {r.student_accuracy_after:.3f} after "
        f"distillation ({r.steps} steps), agreeing with the teacher on "
        f"{r.agreement_after:.0%} of the test set"
    )
    print(
        f"  forward at batch {r.timed_batch} on this CPU: teacher {r.teacher_ms:.2f} ms, "
        f"student {r.student_ms:.2f} ms ({r.speed_ratio:.2f}x)"
    )


if __name__ == "__main__":
    exact()
    lossy()
