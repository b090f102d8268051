"""Fused linear + cross-entropy, the language-model head's loss without its logits: the ops
`opswap::linear_cross_entropy` and `opswap::linear_cross_entropy_backward`.

The function (hidden [N, H], weight [V, H], target [N], bias [V] optional):

    logits = hidden @ weight.T + bias                       [N, V], never held in full
    loss = cross_entropy(softcap(logits), target, ignore_index, label_smoothing, reduction)

with softcap(x) = cap * tanh(x / cap) when a cap is given (Gemma 2's final logits). "mean"
divides by the count of rows whose target is not `ignore_index`; when every row is
ignored the loss is 0 and every gradient is 0 (PyTorch returns NaN there).

Why: at N = 8192 tokens and a 128256-word vocabulary the logits are 1.05 G elements,
2.1 GB in bf16 and 4.2 GB again for their fp32 softmax and its gradient. Here the rows go
in chunks of R (R * V <= CHUNK_ELEMENTS: 256 rows at that vocabulary, 131 MB of fp32
logits), and for each chunk

    1. logits = h_chunk @ W.T           cuBLAS, fp32 output where torch has `out_dtype`
    2. one Triton kernel (kernels/_lce_chunk.py): each row's log-sum-exp and loss, then
       dlogits written in the GEMM dtype (over the logits when the dtypes agree)
    3. dh_chunk = dlogits @ W;  dW += dlogits.T @ h_chunk;  db += column sums of dlogits

so peak memory is O(R * V) on top of the inputs and their gradients, not O(N * V).

Gradient in the forward (as Liger-Kernel does), not recomputed in the backward (as
cut-cross-entropy does): three GEMMs of N * V * H instead of four, for holding dh and dW
from the forward to the backward, which are the size of the gradients the backward
returns anyway. The backward multiplies them by the incoming gradient (in place in eager
mode). The forward computes them only when asked (`with_grad`, which the public API sets
when a gradient is needed), and reduction="none", whose incoming gradient differs per
row, takes the other route: the forward returns each row's log-sum-exp and the backward
op recomputes the logits chunk by chunk.

Precision: dlogits are rounded to the inputs' dtype before the two gradient GEMMs (the
GEMMs need one dtype), and dW of a bf16 weight is accumulated over the chunks in bf16 (one
rounding per chunk: N / R of them), as Liger does, so that peak memory holds no fp32 copy
of a [V, H] weight. Loss and log-sum-exp are fp32.

CPU, and float64: the same chunked algorithm with the kernel's arithmetic in PyTorch
(`_lce_chunk.torch_chunk`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from opswap.kernels._lce_chunk import torch_chunk, triton_chunk
from opswap.kernels._rows import runs_triton

#: at most this many logits a chunk on a GPU (2^25: 256 rows at V = 128256, as Liger's)
CHUNK_ELEMENTS = 1 << 25
#: and on the CPU (2^22: 16 MB of fp32 logits, 128 rows at V = 32000)
CPU_CHUNK_ELEMENTS = 1 << 22
#: the reductions the op takes
REDUCTIONS = ("mean", "sum", "none")

_ROWS_OVERRIDE: list[int] = []


@contextlib.contextmanager
def chunk_rows_set(rows: int) -> Iterator[None]:
    """Within the block, chunks of `rows` rows (tests use it to cross chunk edges at small
    shapes; benchmarks to sweep)."""
    _ROWS_OVERRIDE.append(rows)
    try:
        yield
    finally:
        _ROWS_OVERRIDE.pop()


def chunk_rows(n: int, v: int, cuda: bool = True) -> int:
    """Rows a chunk: the largest power of two with rows * v <= CHUNK_ELEMENTS (on the CPU,
    CPU_CHUNK_ELEMENTS), at least 1, at most n."""
    if _ROWS_OVERRIDE:
        return max(1, min(n, _ROWS_OVERRIDE[-1]))
    fit = max(1, (CHUNK_ELEMENTS if cuda else CPU_CHUNK_ELEMENTS) // max(v, 1))
    return max(1, min(n, 1 << (fit.bit_length() - 1)))


_OUT_DTYPE_MM: list[bool] = []


def _logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """h [R, H] @ weight.T: fp32 out of a bf16/fp16 cuBLAS GEMM where torch has
    `mm(..., out_dtype=)` (no rounding of the logits to bf16), else in the inputs' dtype."""
    if h.is_cuda and h.dtype in (torch.bfloat16, torch.float16):
        if not _OUT_DTYPE_MM:
            try:
                torch.mm(h[:1], weight[:1].t(), out_dtype=torch.float32)
                _OUT_DTYPE_MM.append(True)
            except (TypeError, RuntimeError, NotImplementedError):
                _OUT_DTYPE_MM.append(False)
        if _OUT_DTYPE_MM[0]:
            return torch.mm(h, weight.t(), out_dtype=torch.float32)
    return torch.mm(h, weight.t())


def _check(reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}, not {reduction!r}")


def _chunks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    smoothing: float,
    cap: float | None,
    scale: torch.Tensor | None,
    lse: torch.Tensor,
    loss: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunk loop. With `loss` given, fill it and `lse` [N]; else read `lse`. With
    `scale` ([1] or [N] fp32), return (dh, dW, db) (db empty without a bias); else empties."""
    n = hidden.shape[0]
    v = weight.shape[0]
    grads = scale is not None
    dh = hidden.new_empty(hidden.shape if grads else (0,))
    dw = weight.new_zeros(weight.shape) if grads else hidden.new_empty((0,))
    db = torch.zeros(v, device=hidden.device) if grads and bias is not None else dh.new_empty(0)
    r = chunk_rows(n, v, hidden.is_cuda)
    for s in range(0, n, r):
        e = min(n, s + r)
        h = hidden[s:e]
        x = _logits(h, weight)
        sc = None if scale is None else (scale[s:e] if scale.numel() != 1 else scale)
        if runs_triton(x) and hidden.dtype != torch.float64:
            g = None
            if grads:
                g = x if x.dtype == hidden.dtype else torch.empty_like(x, dtype=hidden.dtype)
            part_loss = loss[s:e] if loss is not None else None
            triton_chunk(
                x, g, bias, target[s:e], lse[s:e], part_loss,
                sc if sc is not None else lse, ignore_index, smoothing, cap,
            )  # fmt: skip
        else:
            li, ls, g = torch_chunk(
                x, grads, bias, target[s:e], None if loss is not None else lse[s:e],
                sc if sc is not None else lse.new_ones(1), ignore_index, smoothing, cap,
            )  # fmt: skip
            if loss is not None:
                loss[s:e] = li
                lse[s:e] = ls
            if g is not None:
                g = g.to(hidden.dtype)
        if grads and g is not None:
            torch.mm(g, weight, out=dh[s:e])
            dw.addmm_(g.t(), h)
            if bias is not None:
                db += g.sum(0, dtype=torch.float32)
    if grads and bias is not None:
        db = db.to(bias.dtype)
    return dh, dw, db


def _counted(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """The count of rows that are not ignored, as a float32 tensor, at least 1 (an all-
    ignored mean is 0 / 1 = 0, not NaN)."""
    return (target != ignore_index).sum().clamp(min=1).float()


# ----------------------------------------------------------------------------- the ops


@torch.library.custom_op("opswap::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    softcap: float | None,
    with_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, lse, dhidden, dweight, dbias): the loss (fp32; a scalar, or [N] for "none"),
    each row's log-sum-exp [N] fp32, and, with `with_grad` and a "mean" or "sum"
    reduction, the loss's gradients for an incoming gradient of 1 (empty tensors
    otherwise; dbias also without a bias). hidden [N, H], weight [V, H], target [N]."""
    _check(reduction)
    n = hidden.shape[0]
    lse = torch.empty(n, device=hidden.device)
    rows = torch.empty(n, device=hidden.device)
    scale = None
    if with_grad and reduction != "none":
        one = torch.ones(1, device=hidden.device)
        scale = one / _counted(target, ignore_index) if reduction == "mean" else one
    dh, dw, db = _chunks(
        hidden, weight, target, bias, ignore_index, label_smoothing, softcap, scale, lse, rows
    )
    if reduction == "none":
        loss = rows
    elif reduction == "sum":
        loss = rows.sum()
    else:
        loss = rows.sum() / _counted(target, ignore_index)
    return loss, lse, dh, dw, db


@linear_cross_entropy.register_fake
def _(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    *rest: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # the op's other arguments, in its order: ignore_index, label_smoothing, reduction,
    # softcap, with_grad
    reduction, with_grad = rest[2], rest[4]
    _check(reduction)
    n = hidden.shape[0]
    loss = hidden.new_empty((n,) if reduction == "none" else (), dtype=torch.float32)
    lse = hidden.new_empty((n,), dtype=torch.float32)
    if not with_grad or reduction == "none":
        e = hidden.new_empty((0,))
        return loss, lse, e, e.new_empty((0,)), e.new_empty((0,))
    db = hidden.new_empty((0,)) if bias is None else bias.new_empty(bias.shape)
    return loss, lse, hidden.new_empty(hidden.shape), weight.new_empty(weight.shape), db


@torch.library.custom_op("opswap::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward(
    grad: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    lse: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dhidden, dweight, dbias) of the loss for the incoming gradient `grad` (a scalar,
    or [N] for "none"), the logits recomputed chunk by chunk with the forward's `lse`;
    dbias is empty without a bias."""
    _check(reduction)
    scale = grad.float().reshape(-1)
    if reduction == "mean":
        scale = scale / _counted(target, ignore_index)
    return _chunks(
        hidden, weight, target, bias, ignore_index, label_smoothing, softcap, scale, lse, None
    )


@linear_cross_entropy_backward.register_fake
def _(
    grad: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, *rest: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # the op's other arguments, in its order: target, bias, lse, ignore_index,
    # label_smoothing, reduction, softcap
    bias, reduction = rest[1], rest[5]
    _check(reduction)
    db = hidden.new_empty((0,)) if bias is None else bias.new_empty(bias.shape)
    return hidden.new_empty(hidden.shape), weight.new_empty(weight.shape), db


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    hidden, weight, target, bias = inputs[:4]
    ctx.args = inputs[4:8]
    ctx.has_bias = bias is not None
    ctx.pre = bool(inputs[8]) and inputs[6] != "none"
    ctx.used = False
    lse, dh, dw, db = output[1:]
    if ctx.pre:
        ctx.save_for_backward(hidden, weight, target, bias, lse, dh, dw, db)
    else:
        ctx.save_for_backward(hidden, weight, target, bias, lse)


def _backward(ctx: Any, grad: torch.Tensor, *unused: Any) -> tuple:
    hidden, weight, target, bias, lse, *pre = ctx.saved_tensors
    ignore_index, smoothing, reduction, cap = ctx.args
    if ctx.pre and not ctx.used:
        dh, dw, db = pre
        g = grad.float()
        if torch.compiler.is_compiling() or type(dw) is not torch.Tensor:
            dh, dw, db = dh * g, dw * g, db * g  # a 0-dim g keeps each dtype
        else:
            # the gradients are the op's own outputs, held for this: scaled in place, once
            # (through `.data`, so that a second backward through a retained graph can
            # still unpack them; it recomputes instead)
            ctx.used = True
            dh, dw, db = dh.data.mul_(g), dw.data.mul_(g), db.data.mul_(g)
    else:
        dh, dw, db = linear_cross_entropy_backward(
            grad, hidden, weight, target, bias, lse, ignore_index, smoothing, reduction, cap
        )
    return dh, dw, None, (db if ctx.has_bias else None), None, None, None, None, None


linear_cross_entropy.register_autograd(_backward, setup_context=_setup)
