"""Chapter 27: planning replacements for training with opswap.train.prepare.

A digits CNN (conv, BatchNorm in train mode, ReLU, a dropout before its head) is prepared
with its loss: opswap plans only the rules valid in training, fuses the head and the
cross-entropy into opswap::linear_cross_entropy, and checks every parameter's gradient
against eager float32. Then one epoch is trained twice from the same weights and the
same random state, eager and prepared; the two loss curves agree step by step. The same
for a small language model (zoo:gpt's decoder: RMSNorm, rotary attention, SwiGLU, a tied
lm_head) learning to continue a repeating token pattern.

    python examples/ch27_prepare.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from opswap.models.zoo_digits import DigitsCNN, digits
from opswap.models.zoo_transformer import gpt
from opswap.train.prepare import prepare


class CNN(nn.Module):
    """zoo:digits_cnn's layers, untrained, with a dropout before the head."""

    def __init__(self) -> None:
        super().__init__()
        base = DigitsCNN()
        self.features, self.drop, self.head = base.features, nn.Dropout(0.2), base.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.features(x).flatten(1)))


def epoch(step_loss, params, x: torch.Tensor, y: torch.Tensor, batch: int) -> list[float]:
    opt = torch.optim.AdamW(params, lr=3e-3)
    torch.manual_seed(1)  # the same dropout masks for both runs
    curve = []
    for i in range(0, len(x) - batch + 1, batch):
        loss = step_loss(x[i : i + batch], y[i : i + batch])
        loss.backward()
        opt.step()
        opt.zero_grad()
        curve.append(float(loss.detach()))
    return curve


def main() -> None:
    torch.manual_seed(0)
    data = digits()
    x, y = data.train_x.view(-1, 1, 8, 8), data.train_y
    eager = CNN().train()
    model = CNN().train()
    model.load_state_dict(eager.state_dict())

    start = time.perf_counter()
    # on a CPU target the fused loss is left out by default (its CPU path does not pay);
    # fuse_loss=True forces it here, to show it trains as eager does
    prepared = prepare(model, (x[:64], y[:64]), F.cross_entropy, fuse_loss=True)
    print(f"prepared in {time.perf_counter() - start:.1f} s")
    print(prepared.report)

    want = epoch(lambda a, b: F.cross_entropy(eager(a), b), eager.parameters(), x, y, 64)
    got = epoch(prepared, model.parameters(), x, y, 64)  # the optimizer holds the model's own
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))
    print(
        f"{len(got)} steps: loss {want[0]:.3f} -> {want[-1]:.3f} (eager), "
        f"{got[0]:.3f} -> {got[-1]:.3f} (prepared); largest relative difference {worst:.1e}"
    )
    assert worst < 1e-3, "the prepared model's loss curve left eager's"

    model.eval()  # evaluate with the model itself: it holds what the prepared module trained
    with torch.no_grad():
        acc = (model(data.test_x.view(-1, 1, 8, 8)).argmax(1) == data.test_y).float().mean()
    print(f"held-out accuracy after one epoch: {float(acc):.3f}")


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))


def language_model() -> None:
    eager, _ = gpt(batch=4, seq=24, vocab=97, layers=2)
    model, _ = gpt(batch=4, seq=24, vocab=97, layers=2)  # the same seed: the same weights
    eager.train(), model.train()
    gen = torch.Generator().manual_seed(0)
    # sequences that repeat a random 6-token motif: learnable from the context
    motifs = torch.randint(0, 97, (40, 4, 6), generator=gen)
    tokens = motifs.repeat(1, 1, 5)[..., :25]
    batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]
    prepared = prepare(model, batches[0], lm_loss, fuse_loss=True)
    print("language model:", ", ".join(sorted({r for r, _ in prepared.report.replaced})))

    def curve(step_loss, params) -> list[float]:
        opt = torch.optim.AdamW(params, lr=3e-3)
        out = []
        for ids, labels in batches:
            loss = step_loss(ids, labels)
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(float(loss.detach()))
        return out

    want = curve(lambda i, y: lm_loss(eager(i), y), eager.parameters())
    got = curve(prepared, model.parameters())
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))
    print(
        f"{len(got)} steps: loss {want[0]:.3f} -> {want[-1]:.3f} (eager), "
        f"{got[0]:.3f} -> {got[-1]:.3f} (prepared); largest relative difference {worst:.1e}"
    )
    assert worst < 1e-3, "the prepared language model's loss curve left eager's"


def mixed_precision() -> None:
    """The same language model trained in bf16 autocast (softmax, norms and loss kept in
    float32), beside float32 eager."""
    eager, _ = gpt(batch=4, seq=24, vocab=97, layers=2)
    model, _ = gpt(batch=4, seq=24, vocab=97, layers=2)
    eager.train(), model.train()
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 97, (12, 4, 6), generator=gen).repeat(1, 1, 5)[..., :25]
    batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]
    prepared = prepare(model, batches[0], lm_loss, precision="bf16")
    print(next(n for n in prepared.report.notes if n.startswith("bf16")))
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (model, eager))
    worst = 0.0
    for ids, labels in batches:
        want = lm_loss(eager(ids), labels)
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        got = prepared(ids, labels)
        worst = max(worst, abs(float(got.detach()) - float(want.detach())) / float(want.detach()))
        prepared.step(opt, got)  # backward, step, zero_grad (with fp16: loss scaling)
    print(f"{len(batches)} bf16 steps: largest relative difference from float32 {worst:.1e}")
    assert worst < 2e-2, "bf16 training left float32's loss curve"


if __name__ == "__main__":
    main()
    language_model()
    mixed_precision()
