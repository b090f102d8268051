"""Fused AdamW step over a list of tensors: the op `opswap::adamw` (in place on the params
and their states), which `opswap.train.optim.AdamW` calls.

For each parameter p with gradient g (negated when maximizing), at its step t:

    p  = p * (1 - lr * weight_decay)                    (decoupled weight decay)
    m  = m + (1 - beta1) * (g - m)                      (torch's lerp)
    v  = v * beta2 + (1 - beta2) * g * g
    v' = max(v_max, v)  and v_max = v'  with amsgrad; else v' = v
    p  = p - (lr / (1 - beta1^t)) * m / (sqrt(v') / sqrt(1 - beta2^t) + eps)

as torch.optim.AdamW writes it. States (m, v, v_max) are float32 whatever the param's
dtype: a bf16 parameter is read, updated in fp32 and rounded once when written.

Why it is faster: torch's foreach path runs the formula as some ten multi-tensor kernels,
each reading and writing whole tensors (p twice, m, v and their square-root temporary
several times); one pass reads p, g, m, v once and writes p, m, v once: for bf16 params
and fp32 states 2 + 2 + 4 + 4 bytes in and 2 + 4 + 4 out, 22 bytes a parameter (30 with
amsgrad). torch's fused=True moves the same bytes; the peer to match.

Multi-tensor launch: one kernel for all the tensors of a dtype pair, through a pointer
table. Each tensor's addresses (p, g, m, v, v_max) are a row of an int64 table and its
bias-corrected coefficients a row of a float32 table; the work is cut into items of
`CHUNK` elements (tensor index, first element) that depend only on the sizes and are
kept on the device between steps; only the address table (grads are new tensors after
each zero_grad) and the coefficients cross from the host each step, about 56 bytes a
tensor. One program a work item.

CPU (and tensors the kernel does not take: non-contiguous, float64): the same steps with
torch's `_foreach` ops, in the order torch.optim.AdamW(foreach=True) applies them, so an
fp32 model takes the same steps as torch's.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from opswap.kernels._rows import jitted, rn, rn_flag, runs_triton, tl

#: elements a work item (a program) updates
CHUNK = 65536
#: elements a program holds per step of its loop
BLOCK = 1024


def _adamw_fn(
    tab_ptr,  # [T, 5] int64: addresses of p, g, m, v, v_max
    num_ptr,  # [T] int64: numel
    coef_ptr,  # [T, 2] fp32: lr / (1 - beta1^t), sqrt(1 - beta2^t)
    work_ptr,  # [W, 2] int64: tensor index, first element
    p0_ptr,  # the first param: the element type of every param address
    g0_ptr,  # the first grad: the element type of every grad address
    decay,  # 1 - lr * weight_decay
    beta1,
    beta2,
    eps,
    AMSGRAD: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    RN_P: tl.constexpr,  # the interpreter's bf16 rounding (kernels/_rows.py)
    ALIGNED: tl.constexpr,  # every address a multiple of 16 bytes: vector loads
):
    w = tl.program_id(0).to(tl.int64)
    t = tl.load(work_ptr + 2 * w)
    first = tl.load(work_ptr + 2 * w + 1)
    n = tl.load(num_ptr + t)
    p_ptr = tl.load(tab_ptr + 5 * t).to(p0_ptr.dtype)
    g_ptr = tl.load(tab_ptr + 5 * t + 1).to(g0_ptr.dtype)
    m_ptr = tl.load(tab_ptr + 5 * t + 2).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(tab_ptr + 5 * t + 3).to(tl.pointer_type(tl.float32))
    if ALIGNED:  # addresses loaded from a table carry no alignment the compiler can see
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
    step_size = tl.load(coef_ptr + 2 * t)
    bc2_sqrt = tl.load(coef_ptr + 2 * t + 1)
    decay = tl.cast(decay, tl.float32)
    beta1 = tl.cast(beta1, tl.float32)
    beta2 = tl.cast(beta2, tl.float32)
    eps = tl.cast(eps, tl.float32)
    for off in range(0, CHUNK, BLOCK):
        i = first + off + tl.arange(0, BLOCK)
        if ALIGNED:  # first is a multiple of CHUNK, off of BLOCK
            i = tl.max_contiguous(tl.multiple_of(i, BLOCK), BLOCK)
        ok = i < n
        g = tl.load(g_ptr + i, mask=ok, other=0.0).to(tl.float32)
        if MAXIMIZE:
            g = -g
        p = tl.load(p_ptr + i, mask=ok, other=0.0).to(tl.float32) * decay
        m = tl.load(m_ptr + i, mask=ok, other=0.0)
        v = tl.load(v_ptr + i, mask=ok, other=0.0)
        m = m + (1.0 - beta1) * (g - m)
        v = v * beta2 + (1.0 - beta2) * (g * g)
        tl.store(m_ptr + i, m, mask=ok)
        tl.store(v_ptr + i, v, mask=ok)
        if AMSGRAD:
            x_ptr = tl.load(tab_ptr + 5 * t + 4).to(tl.pointer_type(tl.float32))
            if ALIGNED:
                x_ptr = tl.multiple_of(x_ptr, 16)
            v = tl.maximum(tl.load(x_ptr + i, mask=ok, other=0.0), v)
            tl.store(x_ptr + i, v, mask=ok)
        p = p - step_size * (m / (tl.sqrt(v) / bc2_sqrt + eps))
        tl.store(p_ptr + i, rn(p, RN_P).to(p0_ptr.dtype.element_ty), mask=ok)


_WORK: dict[tuple, torch.Tensor] = {}
#: set when this Triton refused the alignment hints (see triton_step)
_UNALIGNED_ONLY: list[bool] = []


def _work_items(sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """[W, 2] int64 (tensor index, first element) on `device`, kept per list of sizes."""
    key = (sizes, str(device))
    if key not in _WORK:
        items = [(t, s) for t, n in enumerate(sizes) for s in range(0, n, CHUNK)]
        _WORK[key] = torch.tensor(items or [(0, 0)], dtype=torch.int64).reshape(-1, 2).to(device)
        if len(_WORK) > 64:  # a process that builds many optimizers: keep the last few
            _WORK.pop(next(iter(_WORK)))
    return _WORK[key]


def _coefficients(steps: list[float], lr: float, beta1: float, beta2: float) -> list[float]:
    """Per tensor: lr / (1 - beta1^t) and sqrt(1 - beta2^t), in Python floats as torch
    computes them."""
    out: list[float] = []
    for t in steps:
        out += [lr / (1 - beta1**t), math.sqrt(1 - beta2**t)]
    return out


class Tensors(NamedTuple):
    """The lists a step updates, one entry a param; max_exp_avg_sqs is empty without
    amsgrad."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    max_exp_avg_sqs: list[torch.Tensor]
    steps: list[float]

    def pick(self, idx: list[int]) -> Tensors:
        """The entries at `idx` of every list (an empty list stays empty)."""
        p, g, m, v, x, s = self
        return Tensors(
            [p[i] for i in idx],
            [g[i] for i in idx],
            [m[i] for i in idx],
            [v[i] for i in idx],
            [x[i] for i in idx] if x else [],
            [s[i] for i in idx],
        )


class Hyper(NamedTuple):
    """The settings one step shares across its tensors."""

    lr: float
    beta1: float
    beta2: float
    weight_decay: float
    eps: float
    maximize: bool


def triton_step(t: Tensors, h: Hyper) -> None:
    """One launch of `_adamw_fn` over tensors of one param dtype and one grad dtype, all
    contiguous, on one device, with float32 states."""
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = t
    lr, beta1, beta2, weight_decay, eps, maximize = h
    if not params:
        return
    dev = params[0].device
    amsgrad = bool(max_exp_avg_sqs)
    rows = []
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)):
        x = max_exp_avg_sqs[i].data_ptr() if amsgrad else 0
        rows += [p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), x]
    tab = torch.tensor(rows, dtype=torch.int64).to(dev, non_blocking=True)
    work = _work_items(tuple(p.numel() for p in params), dev)
    num = torch.tensor([p.numel() for p in params], dtype=torch.int64).to(dev, non_blocking=True)
    coef = torch.tensor(_coefficients(steps, lr, beta1, beta2), dtype=torch.float32)
    coef = coef.to(dev, non_blocking=True)
    aligned = not _UNALIGNED_ONLY and all(a % 16 == 0 for a in rows)
    args = (tab, num, coef, work, params[0], grads[0], 1.0 - lr * weight_decay, beta1, beta2, eps)
    meta = {
        "AMSGRAD": amsgrad,
        "MAXIMIZE": maximize,
        "CHUNK": CHUNK,
        "BLOCK": BLOCK,
        "RN_P": rn_flag(params[0].dtype),
        "num_warps": 4,
    }
    try:
        jitted(_adamw_fn)[(work.shape[0],)](*args, ALIGNED=aligned, **meta)
    except Exception:
        # the alignment hints on addresses read from a table are the one construct a
        # Triton build could refuse; a compile error comes before any store, so the step
        # runs again without them (and later steps skip them); any other error recurs
        if not aligned:
            raise
        _UNALIGNED_ONLY.append(True)
        jitted(_adamw_fn)[(work.shape[0],)](*args, ALIGNED=False, **meta)


def foreach_step(t: Tensors, h: Hyper) -> None:
    """The step with torch's `_foreach` ops, in torch.optim.AdamW(foreach=True)'s order; a
    param whose states are wider (bf16 param, fp32 states) is updated in the states'
    dtype and written back."""
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = t
    lr, beta1, beta2, weight_decay, eps, maximize = h
    if not params:
        return
    wide = [
        p if p.dtype == m.dtype else p.to(m.dtype) for p, m in zip(params, exp_avgs, strict=True)
    ]
    g = [x if x.dtype == m.dtype else x.to(m.dtype) for x, m in zip(grads, exp_avgs, strict=True)]
    if maximize:
        g = list(torch._foreach_neg(g))
    if weight_decay != 0:
        torch._foreach_mul_(wide, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, g, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, g, g, 1 - beta2)
    coef = _coefficients(steps, lr, beta1, beta2)
    if max_exp_avg_sqs:
        torch._foreach_maximum_(max_exp_avg_sqs, exp_avg_sqs)
        den = torch._foreach_sqrt(max_exp_avg_sqs)
    else:
        den = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(den, coef[1::2])
    torch._foreach_add_(den, eps)
    torch._foreach_addcdiv_(wide, exp_avgs, den, [-s for s in coef[0::2]])
    for p, w in zip(params, wide, strict=True):
        if w is not p:
            p.copy_(w)


def _kernel_takes(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor) -> bool:
    return (
        runs_triton(p)
        and p.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and m.dtype == torch.float32
        and p.is_contiguous()
        and g.is_contiguous()
        and m.is_contiguous()
        and g.device == p.device
    )


@torch.library.custom_op(
    "opswap::adamw", mutates_args=("params", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs")
)
def adamw(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    max_exp_avg_sqs: list[torch.Tensor],
    steps: list[float],
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    maximize: bool,
) -> None:
    """One AdamW step, in place, for each params[i] with grads[i], its float32 (or the
    param's dtype) states exp_avgs[i], exp_avg_sqs[i] (and max_exp_avg_sqs[i] with
    amsgrad: an empty list without), at step steps[i] (counted from 1, this step
    included)."""
    lists = (grads, exp_avgs, exp_avg_sqs, steps) + ((max_exp_avg_sqs,) if max_exp_avg_sqs else ())
    if any(len(x) != len(params) for x in lists):
        raise ValueError(
            "adamw takes one grad, exp_avg, exp_avg_sq, step (and max_exp_avg_sq with "
            "amsgrad) per param."
        )
    groups: dict[tuple, list[int]] = {}
    rest: list[int] = []
    for i, p in enumerate(params):
        if _kernel_takes(p, grads[i], exp_avgs[i]):
            groups.setdefault((p.device, p.dtype, grads[i].dtype), []).append(i)
        else:
            rest.append(i)
    every = Tensors(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
    hyper = Hyper(lr, beta1, beta2, weight_decay, eps, maximize)
    for idx in [*groups.values(), rest]:
        if not idx:
            continue
        step = triton_step if idx is not rest else foreach_step
        step(every.pick(idx), hyper)


@adamw.register_fake
def _(*args: object) -> None:  # in place on its inputs, no output: nothing to describe
    return None
