"""opswap::lstm_seq -> ONNX LSTM, opswap::gru_seq -> ONNX GRU (linear_before_reset=1, as
PyTorch computes the n gate), one direction, float32 inside. ONNX orders the gates
(i, o, f, c) for LSTM and (z, r, h) for GRU where PyTorch has (i, f, g, o) and (r, z, n):
the weights and biases are split by gate and concatenated in ONNX's order. ONNX Runtime
takes the time-major layout only (layout=0), so a batch-first sequence is transposed on
the way in and out."""

from __future__ import annotations

from typing import Any  # onnxscript values: see _onnx

from opswap.backends.lowerings._onnx import as_float, back, ints, op
from opswap.backends.lowerings._registry import lowering

#: PyTorch's gate blocks in the order ONNX wants them
_LSTM_ORDER = (0, 3, 1, 2)  # i, f, g, o -> i, o, f, c(=g)
_GRU_ORDER = (1, 0, 2)  # r, z, n -> z, r, h(=n)


def _gates(t: Any, order: tuple[int, ...]) -> Any:
    """t's gate blocks (along dim 0) in `order`, float32, with a leading direction dim."""
    parts = op.Split(as_float(t), axis=0, num_outputs=len(order))
    return op.Unsqueeze(op.Concat(*[parts[i] for i in order], axis=0), ints([0]))


def _bias(b_ih: Any, b_hh: Any, order: tuple[int, ...]) -> Any:
    """ONNX's B: [1, 2 * gates * H], the input biases then the hidden ones (a missing one
    as zeros); None when there is no bias at all."""
    if b_ih is None and b_hh is None:
        return None
    wb = b_ih if b_ih is not None else op.Sub(b_hh, b_hh)
    rb = b_hh if b_hh is not None else op.Sub(b_ih, b_ih)
    return op.Concat(_gates(wb, order), _gates(rb, order), axis=1)


def _hidden(w_hh: Any) -> int:
    size = w_hh.shape[1] if w_hh.shape is not None else None
    if not isinstance(size, int):
        raise ValueError("the recurrent weight's hidden size must be static to export an RNN")
    return size


def _initial(s: Any) -> Any:
    """ONNX's initial state [1, B, H], or None (zeros) where the op had none."""
    return None if s is None else op.Unsqueeze(as_float(s), ints([0]))


def _seq_in(x: Any, batch_first: bool) -> Any:
    xf = as_float(x)
    return op.Transpose(xf, perm=[1, 0, 2]) if batch_first else xf


def _seq_out(y: Any, x: Any, batch_first: bool) -> Any:
    y = op.Squeeze(y, ints([1]))  # [T, 1, B, H] -> [T, B, H]
    return back(op.Transpose(y, perm=[1, 0, 2]) if batch_first else y, x)


@lowering("opswap::lstm_seq", "LSTM (gates reordered to i, o, f, c; float32 inside)")
def lstm_seq(
    x: Any,
    h0: Any,
    c0: Any,
    w_ih: Any,
    w_hh: Any,
    b_ih: Any,
    b_hh: Any,
    batch_first: bool,
) -> tuple[Any, Any, Any]:
    y, y_h, y_c = op.LSTM(
        _seq_in(x, batch_first),
        _gates(w_ih, _LSTM_ORDER),
        _gates(w_hh, _LSTM_ORDER),
        _bias(b_ih, b_hh, _LSTM_ORDER),
        None,
        _initial(h0),
        _initial(c0),
        hidden_size=_hidden(w_hh),
    )
    squeeze = ints([0])
    return (
        _seq_out(y, x, batch_first),
        back(op.Squeeze(y_h, squeeze), x),
        back(op.Squeeze(y_c, squeeze), x),
    )


@lowering("opswap::gru_seq", "GRU, linear_before_reset=1 (gates reordered to z, r, h)")
def gru_seq(
    x: Any,
    h0: Any,
    w_ih: Any,
    w_hh: Any,
    b_ih: Any,
    b_hh: Any,
    batch_first: bool,
) -> tuple[Any, Any]:
    y, y_h = op.GRU(
        _seq_in(x, batch_first),
        _gates(w_ih, _GRU_ORDER),
        _gates(w_hh, _GRU_ORDER),
        _bias(b_ih, b_hh, _GRU_ORDER),
        None,
        _initial(h0),
        hidden_size=_hidden(w_hh),
        linear_before_reset=1,
    )
    return _seq_out(y, x, batch_first), back(op.Squeeze(y_h, ints([0])), x)
