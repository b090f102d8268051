"""Chapter 27: operator replacement in training: the fused linear + cross-entropy loss and
the fused AdamW step.

A tiny language model (embedding, two residual MLP blocks, an lm_head) is trained for a
few steps twice from the same start on the same batches: once as a model is usually
written (logits = lm_head(h), F.cross_entropy, torch.optim.AdamW), once with
opswap.train.losses.LinearCrossEntropy (the head's logits never held in full) and
opswap.train.optim.AdamW. Some targets are padding (-100). The two loss curves agree to
float32 rounding; then the fused step once more under torch.compile(fullgraph=True).

    python examples/ch27_training.py
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from opswap.train.losses import LinearCrossEntropy
from opswap.train.optim import AdamW

VOCAB, DIM, SEQ, BATCH, STEPS = 301, 48, 24, 4, 12


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(DIM), nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM)
            )
            for _ in range(2)
        )
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for b in self.blocks:
            h = h + b(h)
        return self.norm(h)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        # a learnable language: each token is followed by (7 * token + 3) mod VOCAB
        x = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
        x[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=g)
        for t in range(SEQ):
            x[:, t + 1] = (7 * x[:, t] + 3) % VOCAB
        labels = x[:, 1:].clone()
        labels[:, -3:] = -100  # padding at the end of each row
        out.append((x[:, :-1], labels))
    return out


def train(model: TinyLM, fused: bool) -> list[float]:
    if fused:
        loss_fn = LinearCrossEntropy(model.lm_head)  # shares the head's weight
        opt: torch.optim.Optimizer = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    curve = []
    for tokens, labels in batches():
        h = model.hidden(tokens)
        if fused:
            loss = loss_fn(h, labels)
        else:
            logits = model.lm_head(h)  # [BATCH, SEQ, VOCAB], held with its gradient
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        curve.append(float(loss.detach()))
    return curve


def main() -> None:
    torch.manual_seed(0)
    model = TinyLM()
    plain = train(copy.deepcopy(model), fused=False)
    fused = train(copy.deepcopy(model), fused=True)
    print("step  unfused loss  fused loss")
    for i, (a, b) in enumerate(zip(plain, fused, strict=True)):
        print(f"{i:4d}  {a:12.6f}  {b:10.6f}")
    worst = max(abs(a - b) for a, b in zip(plain, fused, strict=True))
    print(f"largest difference over {STEPS} steps: {worst:.2e}")
    assert worst < 1e-4, "the fused loss and optimizer must follow the unfused curve"
    assert fused[-1] < fused[0], "the model should learn"

    # the fused loss traced into one graph with the model (the loss is one op in it; the
    # "aot_eager" backend keeps this quick on a CPU, Inductor compiles the same graph)
    m = copy.deepcopy(model)
    loss_fn = LinearCrossEntropy(m.lm_head)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step_loss(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loss_fn(m.hidden(tokens), labels)

    tokens, labels = batches()[0]
    loss = step_loss(tokens, labels)
    loss.backward()
    print(
        f"compiled (fullgraph) first-step loss: {float(loss.detach()):.6f} (eager {plain[0]:.6f})"
    )


if __name__ == "__main__":
    main()
