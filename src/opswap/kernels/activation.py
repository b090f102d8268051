"""Pointwise activations with an optional bias, forward and backward: `act(x + b)` as the
op `opswap::bias_act(x, bias, activation, negative_slope)`, with b a 1-D tensor [H]
broadcast along x's last dim (or None), and its backward `opswap::bias_act_backward`.

Why it is faster (bf16, n elements of x): eager runs the add and the activation as two
kernels, x + b writes a tensor of x's size and the activation reads it back: 2 + 2 + 2
+ 2 = 8 bytes per element; the kernel reads x and writes y, 4 (b is H values, read from
cache). An activation written out as a formula costs more in eager: GPT-2's gelu_new,
`0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))`, is 8 kernels that each write
a tensor of x's size (about 36 bytes an element); `x * relu6(x + 3) / 6` is 4 (16
bytes). The kernel is 4 bytes for any of them. The backward reads dy and x (and b) and
writes dx: 6 bytes an element, where eager's autograd of a formula walks every op back.
The math is fp32 inside, the output in x's dtype; eager rounds x + b (and every step of
a formula) to the input dtype, the kernel does not: fewer roundings, the same function.

Derivatives, of s = x + b (dx = dy * act'(s); db = dx summed over every leading dim):
    relu'(s)        = 1 for s > 0, else 0
    relu6'(s)       = 1 for 0 < s < 6, else 0
    leaky_relu'(s)  = 1 for s > 0, else negative_slope
    hardswish'(s)   = 0 for s <= -3, s / 3 + 1/2 for -3 < s < 3, 1 for s >= 3
    hardsigmoid'(s) = 1/6 for -3 < s < 3, else 0
    silu'(s)        = q (1 + s (1 - q)),                  q = sigmoid(s)
    gelu'(s)        = Phi(s) + s phi(s)                   (erf form)
    gelu_tanh'(s)   = (1 + t) / 2 + s (1 - t^2) k (1 + 3 * 0.044715 s^2) / 2,
                                                          t = tanh(k (s + 0.044715 s^3)),
                                                          k = sqrt(2 / pi)
    quick_gelu'(s)  = q + 1.702 s q (1 - q),              q = sigmoid(1.702 s)
At a kink the value is PyTorch autograd's for F.relu, F.relu6 (hardtanh's backward),
F.leaky_relu, F.hardswish and F.hardsigmoid, which is what the ranges above say:
relu'(0) = 0, relu6'(0) = relu6'(6) = 0, leaky_relu'(0) = negative_slope,
hardswish'(-3) = 0 and hardswish'(3) = 1, hardsigmoid'(+-3) = 0; and at NaN too (relu,
relu6, hardswish: 1; leaky_relu: the slope; hardsigmoid: 0). A formula the user wrote
out (`x * relu6(x + 3) / 6`) may differ from F.hardswish exactly at -3 or 3 by the
convention of the clamp it spells; the rule's replacement follows F.hardswish.

quick_gelu is x * sigmoid(1.702 x) (QuickGELUActivation in transformers); gelu_tanh is
F.gelu(approximate="tanh"), which GPT-2's gelu_new and FastGELU write out.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.library import wrap_triton

from opswap.kernels._rows import (
    ELEMENTWISE_BLOCK,
    KernelError,
    compiles_to_reference,
    jitted,
    rn,
    rn_flag,
    runs_triton,
    tl,
    triton,
)
from opswap.kernels._triton_op import triton_op

#: the activations the op computes, by the name it takes (the index is the kernel's ACT)
ACTIVATIONS = (
    "relu",
    "relu6",
    "leaky_relu",
    "hardswish",
    "hardsigmoid",
    "silu",
    "gelu",
    "gelu_tanh",
    "quick_gelu",
)
_ACT_ID = {a: i for i, a in enumerate(ACTIVATIONS)}
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
#: QuickGELU's constant (transformers' QuickGELUActivation)
QUICK = 1.702
#: the written-out formulas activation.pointwise replaces with the op: each is
#: measured under its own crossover name, "bias_act:FORM", since eager's cost differs
FORMS = ("gelu_new", "fast_gelu", "quick_gelu", "hardswish", "hardsigmoid")
#: the names the crossover table (kernels/crossover.py) measures this kernel under: an
#: activation of x + b, and each formula
CROSSOVER = ("bias_act", *(f"bias_act:{form}" for form in FORMS))


def _check_act(activation: str) -> int:
    if activation not in _ACT_ID:
        raise KernelError(
            f"activation {activation!r} is not one of {', '.join(ACTIVATIONS)}; pick one of those."
        )
    return _ACT_ID[activation]


def _check_bias(x: torch.Tensor, bias: torch.Tensor | None) -> None:
    if bias is None:
        return
    if bias.dim() != 1 or x.dim() == 0 or bias.shape[0] != x.shape[-1]:
        raise KernelError(
            f"the bias must be 1-D with x's last dim ({x.shape[-1] if x.dim() else 'none'}) "
            f"values; got shape {list(bias.shape)}."
        )
    if bias.device != x.device or not bias.dtype.is_floating_point:
        raise KernelError(
            f"the bias ({bias.dtype} on {bias.device}) must be a floating-point tensor on "
            f"x's device ({x.device})."
        )


def act(s: torch.Tensor, activation: str, negative_slope: float = 0.01) -> torch.Tensor:
    """act(s) in PyTorch, in s's dtype."""
    _check_act(activation)
    if activation == "relu":
        return F.relu(s)
    if activation == "relu6":
        return F.relu6(s)
    if activation == "leaky_relu":
        return F.leaky_relu(s, negative_slope)
    if activation == "hardswish":
        return F.hardswish(s)
    if activation == "hardsigmoid":
        return F.hardsigmoid(s)
    if activation == "silu":
        return F.silu(s)
    if activation == "quick_gelu":
        return s * torch.sigmoid(QUICK * s)
    return F.gelu(s, approximate="tanh" if activation == "gelu_tanh" else "none")


def reference(
    x: torch.Tensor, bias: torch.Tensor | None, activation: str, negative_slope: float
) -> torch.Tensor:
    """act(x + b) in fp32 (float64 for float64 inputs), cast to x's dtype: the op on a
    CPU, and on float64 inputs the tests' ground truth."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    s = x.to(work) if bias is None else x.to(work) + bias.to(work)
    return act(s, activation, negative_slope).to(x.dtype)


def derivative(s: torch.Tensor, activation: str, negative_slope: float) -> torch.Tensor:
    """act'(s) in PyTorch (the module docstring's formulas, PyTorch's values at kinks)."""
    _check_act(activation)
    one, zero = torch.ones_like(s), torch.zeros_like(s)
    if activation == "relu":
        return torch.where(s <= 0, zero, one)
    if activation == "relu6":
        return torch.where((s <= 0) | (s >= 6), zero, one)
    if activation == "leaky_relu":
        return torch.where(s > 0, one, one * negative_slope)
    if activation == "hardswish":
        return torch.where(s <= -3, zero, torch.where(s < 3, s / 3 + 0.5, one))
    if activation == "hardsigmoid":
        return torch.where((s > -3) & (s < 3), one / 6, zero)
    if activation == "silu":
        q = torch.sigmoid(s)
        return q * (1 + s * (1 - q))
    if activation == "quick_gelu":
        q = torch.sigmoid(QUICK * s)
        return q + QUICK * s * q * (1 - q)
    if activation == "gelu":
        return 0.5 * (1 + torch.erf(s * _INV_SQRT_2)) + s * _INV_SQRT_2PI * torch.exp(-0.5 * s * s)
    t = torch.tanh(_SQRT_2_OVER_PI * (s + 0.044715 * s**3))
    return 0.5 * (1 + t) + 0.5 * s * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 0.134145 * s * s)


def _torch_backward(dy, x, bias, activation, negative_slope):
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    s = x.to(work) if bias is None else x.to(work) + bias.to(work)
    return (dy.to(work) * derivative(s, activation, negative_slope)).to(x.dtype)


# ----------------------------------------------------------------------------- the kernels

if triton is not None:
    # named where they are defined: Inductor copies a helper under its def's name
    @triton.jit
    def bias_act_value(s, slope, ACT: tl.constexpr):
        """act(s) for fp32 s; the comparisons are written so that NaN passes through, as
        in PyTorch."""
        if ACT == 0:
            a = tl.where(s < 0.0, 0.0, s)
        elif ACT == 1:
            a = tl.where(s < 0.0, 0.0, tl.where(s > 6.0, 6.0, s))
        elif ACT == 2:
            a = tl.where(s > 0.0, s, s * slope)
        elif ACT == 3:
            c = s + 3.0
            a = s * tl.where(c < 0.0, 0.0, tl.where(c > 6.0, 6.0, c)) / 6.0
        elif ACT == 4:
            c = s + 3.0
            a = tl.where(c < 0.0, 0.0, tl.where(c > 6.0, 6.0, c)) / 6.0
        elif ACT == 5:
            a = s * tl.sigmoid(s)
        elif ACT == 6:
            a = 0.5 * s * (1.0 + tl.erf(s * 0.7071067811865476))
        elif ACT == 7:
            z = 0.7978845608028654 * (s + 0.044715 * s * s * s)
            a = s * tl.sigmoid(2.0 * z)  # 0.5 (1 + tanh z) = sigmoid(2 z)
        else:
            a = s * tl.sigmoid(1.702 * s)
        return a

    @triton.jit
    def bias_act_derivative(s, slope, ACT: tl.constexpr):
        """act'(s) for fp32 s, with PyTorch autograd's values at the kinks and at NaN."""
        if ACT == 0:
            d = tl.where(s <= 0.0, 0.0, 1.0)
        elif ACT == 1:
            d = tl.where((s <= 0.0) | (s >= 6.0), 0.0, 1.0)
        elif ACT == 2:
            d = tl.where(s > 0.0, 1.0, slope)
        elif ACT == 3:
            d = tl.where(s <= -3.0, 0.0, tl.where(s < 3.0, s / 3.0 + 0.5, 1.0))
        elif ACT == 4:
            d = tl.where((s > -3.0) & (s < 3.0), 1.0 / 6.0, 0.0)
        elif ACT == 5:
            q = tl.sigmoid(s)
            d = q * (1.0 + s * (1.0 - q))
        elif ACT == 6:
            d = 0.5 * (1.0 + tl.erf(s * 0.7071067811865476)) + s * 0.3989422804014327 * tl.exp(
                -0.5 * s * s
            )
        elif ACT == 7:
            z = 0.7978845608028654 * (s + 0.044715 * s * s * s)
            t = 2.0 * tl.sigmoid(2.0 * z) - 1.0
            d = 0.5 * (1.0 + t) + 0.5 * s * (1.0 - t * t) * 0.7978845608028654 * (
                1.0 + 0.134145 * s * s
            )
        else:
            q = tl.sigmoid(1.702 * s)
            d = q + 1.702 * s * q * (1.0 - q)
        return d

else:  # pragma: no cover
    bias_act_value = bias_act_derivative = None  # type: ignore[assignment]


def _bias_act_fwd_fn(
    x_ptr,  # [n] contiguous: x [..., H] flattened
    b_ptr,  # [H] (x_ptr itself when HAS_BIAS is off; never read then)
    y_ptr,  # [n] contiguous, x's dtype
    n,
    H,
    slope,
    ACT: tl.constexpr,  # the index in ACTIVATIONS
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    RN: tl.constexpr,  # the interpreter's bf16 rounding (kernels/_rows.py)
):
    # a float argument may arrive as fp64 (inductor types a SymFloat so): fp32 math
    slope = tl.cast(slope, tl.float32)
    # one program, BLOCK elements of the flat tensor: x read once, y written once
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    s = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        s += tl.load(b_ptr + offs % H, mask=ok, other=0.0).to(tl.float32)
    a = bias_act_value(s, slope, ACT)
    tl.store(y_ptr + offs, rn(a, RN).to(y_ptr.dtype.element_ty), mask=ok)


def _bias_act_bwd_fn(
    dy_ptr,  # [n] contiguous
    x_ptr,  # [n] contiguous
    b_ptr,  # [H], or x_ptr without a bias
    dx_ptr,  # [n] contiguous, x's dtype
    n,
    H,
    slope,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    RN: tl.constexpr,
):
    # a float argument may arrive as fp64 (inductor types a SymFloat so): fp32 math
    slope = tl.cast(slope, tl.float32)
    # s = x + b is recomputed, not stored by the forward: 6 bytes an element in bf16
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    dy = tl.load(dy_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    s = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        s += tl.load(b_ptr + offs % H, mask=ok, other=0.0).to(tl.float32)
    d = bias_act_derivative(s, slope, ACT)
    tl.store(dx_ptr + offs, rn(dy * d, RN).to(dx_ptr.dtype.element_ty), mask=ok)


def _launch(fn, tensors: tuple, x: torch.Tensor, bias, activation: str, slope: float) -> None:
    n = x.numel()
    if not n:
        return
    wrap_triton(jitted(fn))[(triton.cdiv(n, ELEMENTWISE_BLOCK),)](
        *tensors,
        n,
        x.shape[-1] if x.dim() else 1,
        float(slope),
        ACT=_ACT_ID[activation],
        HAS_BIAS=bias is not None,
        BLOCK=ELEMENTWISE_BLOCK,
        RN=rn_flag(x.dtype),
    )


def triton_forward(
    x: torch.Tensor, bias: torch.Tensor | None, activation: str, negative_slope: float
) -> torch.Tensor:
    """act(x + b) through the kernel; a non-contiguous x is read through a contiguous copy
    (the output is contiguous either way)."""
    xc = x.contiguous()
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    b = bias.contiguous() if bias is not None else xc
    _launch(_bias_act_fwd_fn, (xc, b, y), xc, bias, activation, negative_slope)
    return y


def triton_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    negative_slope: float,
) -> torch.Tensor:
    """dx = dy * act'(x + b), in x's dtype."""
    xc = x.contiguous()
    dx = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    b = bias.contiguous() if bias is not None else xc
    _launch(_bias_act_bwd_fn, (dy.contiguous(), xc, b, dx), xc, bias, activation, negative_slope)
    return dx


def _kernel_takes(x: torch.Tensor) -> bool:
    return runs_triton(x) and x.dtype in (torch.float32, torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------- the ops


@triton_op("opswap::bias_act", mutates_args=())
def bias_act(
    x: torch.Tensor, bias: torch.Tensor | None, activation: str, negative_slope: float
) -> torch.Tensor:
    """act(x + bias) for x [..., H] and bias [H] (or None), in x's dtype; activation is one
    of ACTIVATIONS, negative_slope leaky_relu's (the others ignore it)."""
    _check_act(activation)
    _check_bias(x, bias)
    if _kernel_takes(x) and not compiles_to_reference("bias_act", x):
        return triton_forward(x, bias, activation, negative_slope)
    return reference(x, bias, activation, negative_slope).contiguous()  # as the kernel's


@triton_op("opswap::bias_act_backward", mutates_args=())
def bias_act_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    negative_slope: float,
) -> torch.Tensor:
    """dx of bias_act: dy * act'(x + bias), in x's dtype (db is its sum over the rows)."""
    _check_act(activation)
    if _kernel_takes(x):
        return triton_backward(dy, x, bias, activation, negative_slope)
    return _torch_backward(dy, x, bias, activation, negative_slope)


def _setup(ctx: Any, inputs: tuple, output: Any) -> None:
    x, bias, activation, negative_slope = inputs
    ctx.save_for_backward(x, bias)
    ctx.activation, ctx.negative_slope = activation, negative_slope


def _backward(ctx: Any, dy: torch.Tensor) -> tuple:
    x, bias = ctx.saved_tensors
    dx = bias_act_backward(dy, x, bias, ctx.activation, ctx.negative_slope)
    db = None
    if bias is not None and ctx.needs_input_grad[1]:
        db = dx.reshape(-1, bias.shape[0]).sum(0, dtype=torch.float32).to(bias.dtype)
    return (dx if ctx.needs_input_grad[0] else None), db, None, None


bias_act.register_autograd(_backward, setup_context=_setup)
