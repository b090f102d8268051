"""The modules precision.int8_dynamic_rnn installs: an LSTM or GRU whose weights are int8,
with every matrix product quantised dynamically, as opswap.kernels.int8_linear does.

The input projection of all time steps is one int8 GEMM (T x B rows, where int8 pays);
each step's recurrent product h W_hh^T is another, on B rows. The gate arithmetic
(sigmoid, tanh, the cell update) stays float32, as in torch's own dynamic quantised RNNs.
Layers run one after another; the time loop is Python, so a model with a small hidden
size and many steps pays its per-step overhead, which is why the rule times the layer at
the site's shape before taking it.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from opswap.kernels.int8_linear import direct, quantize_weight


class _Int8Projection(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        wq, scale = quantize_weight(weight)
        self.register_buffer("weight_int8", wq)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return direct(x, self.weight_int8, self.weight_scale, self.bias)


class Int8DynamicRNN(nn.Module):
    """nn.LSTM or nn.GRU (unidirectional, no projection) with int8 weights."""

    opswap_kind = "rnn"

    def __init__(self, rnn: nn.LSTM | nn.GRU):
        super().__init__()
        self.mode = "LSTM" if isinstance(rnn, nn.LSTM) else "GRU"
        self.hidden_size = rnn.hidden_size
        self.num_layers = rnn.num_layers
        self.batch_first = rnn.batch_first
        self.gates = 4 if self.mode == "LSTM" else 3
        self.ih = nn.ModuleList()
        self.hh = nn.ModuleList()
        for layer in range(rnn.num_layers):
            w_ih = getattr(rnn, f"weight_ih_l{layer}")
            w_hh = getattr(rnn, f"weight_hh_l{layer}")
            b_ih = getattr(rnn, f"bias_ih_l{layer}", None) if rnn.bias else None
            b_hh = getattr(rnn, f"bias_hh_l{layer}", None) if rnn.bias else None
            self.ih.append(_Int8Projection(w_ih, b_ih))
            self.hh.append(_Int8Projection(w_hh, b_hh))

    def extra_repr(self) -> str:
        return (
            f"{self.mode}, hidden_size={self.hidden_size}, num_layers={self.num_layers}, "
            f"batch_first={self.batch_first}, weights=int8 per channel, inputs=int8 per row"
        )

    def forward(
        self, x: torch.Tensor, hx: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | tuple[torch.Tensor, torch.Tensor]]:
        batched = x.dim() == 3
        batch_first = self.batch_first and batched  # an unbatched input is [T, features]
        if not batched:
            x = x.unsqueeze(1)
        if batch_first:
            x = x.transpose(0, 1)
        steps, batch = x.shape[0], x.shape[1]
        zeros = x.new_zeros(self.num_layers, batch, self.hidden_size)
        if self.mode == "LSTM":
            h0, c0 = hx if hx is not None else (zeros, zeros)
            if not batched and hx is not None:
                h0, c0 = h0.unsqueeze(1), c0.unsqueeze(1)
        else:
            h0 = cast(torch.Tensor, hx) if hx is not None else zeros  # GRU: one tensor
            if not batched and hx is not None:
                h0 = h0.unsqueeze(1)
        h_last, c_last = [], []
        seq = x
        for layer in range(self.num_layers):
            gx = self.ih[layer](seq.reshape(steps * batch, -1)).reshape(steps, batch, -1)
            h = h0[layer]
            c = c0[layer] if self.mode == "LSTM" else None
            outs = []
            for t in range(steps):
                gh = self.hh[layer](h)
                if c is not None:  # LSTM
                    i, f, g, o = (gx[t] + gh).chunk(4, dim=1)
                    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                    h = torch.sigmoid(o) * torch.tanh(c)
                else:
                    xr, xz, xn = gx[t].chunk(3, dim=1)
                    hr, hz, hn = gh.chunk(3, dim=1)
                    r = torch.sigmoid(xr + hr)
                    z = torch.sigmoid(xz + hz)
                    n = torch.tanh(xn + r * hn)
                    h = (1 - z) * n + z * h
                outs.append(h)
            seq = torch.stack(outs)
            h_last.append(h)
            if c is not None:
                c_last.append(c)
        out = seq.transpose(0, 1) if batch_first else seq
        h_n = torch.stack(h_last)
        if not batched:
            out = out.squeeze(1)
            h_n = h_n.squeeze(1)
        if self.mode == "LSTM":
            c_n = torch.stack(c_last)
            return out, (h_n, c_n.squeeze(1) if not batched else c_n)
        return out, h_n
