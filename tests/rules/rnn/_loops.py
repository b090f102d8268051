"""Cell-loop models for the rnn rule tests: a Python loop over one LSTMCell / GRUCell /
RNNCell, FX-traceable (a fixed number of steps), in the spellings users write."""

from __future__ import annotations

import torch
from torch import nn

CELLS = {"lstm": nn.LSTMCell, "gru": nn.GRUCell, "rnn": nn.RNNCell}


class CellLoop(nn.Module):
    """`steps` calls of one cell over x ([B, T, F] when batch_first, else [T, B, F]);
    returns the last h (and c), or every h stacked along the time axis."""

    def __init__(
        self,
        kind: str,
        features: int,
        hidden: int,
        steps: int,
        *,
        batch_first: bool = True,
        initial: bool = True,
        returns: str = "last",
    ) -> None:
        super().__init__()
        self.kind, self.steps, self.hidden = kind, steps, hidden
        self.batch_first, self.initial, self.returns = batch_first, initial, returns
        self.cell = CELLS[kind](features, hidden)

    def step_input(self, x: torch.Tensor, t: int) -> torch.Tensor:
        return x[:, t] if self.batch_first else x[t]

    def forward(self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        state = (h, c) if self.kind == "lstm" else h
        outs = []
        for t in range(self.steps):
            xt = self.step_input(x, t)
            if t == 0 and not self.initial:
                state = self.cell(xt)
            else:
                state = self.cell(xt, state)
            outs.append(state[0] if self.kind == "lstm" else state)
        if self.returns == "all":
            return torch.stack(outs, 1 if self.batch_first else 0)
        if self.returns == "cat":
            return torch.cat([o.unsqueeze(0) for o in outs], 0)
        last = outs[-1]
        return torch.cat([last, state[1]], -1) if self.kind == "lstm" else last


def inputs(model: CellLoop, batch: int, features: int) -> tuple[torch.Tensor, ...]:
    shape = (batch, model.steps, features) if model.batch_first else (model.steps, batch, features)
    return (torch.randn(*shape), torch.randn(batch, model.hidden), torch.randn(batch, model.hidden))
