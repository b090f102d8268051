"""Gated activations, forward and backward: `act(g) * u` for act = silu (SwiGLU), gelu
(GeGLU, erf) and gelu_tanh (GeGLU, tanh approximation), as the ops `opswap::glu` (two
tensors g, u [..., H]) and `opswap::glu_packed` (one tensor [..., 2H], g its first half
and u its second: the output of one Linear projecting to both, as merged gate_up layers
and `x.chunk(2, -1)` produce), with `_backward` ops of their own.

Why it is faster (bf16, H elements per row): eager runs act(g), then the product: the
activation reads g and writes a tensor of its size, the product reads it back with u and
writes y: 2 + 2 + 2 + 2 + 2 = 10 bytes per output element; the kernel reads g and u and
writes y, 6. The backward in eager recomputes act(g) and act'(g) in several kernels
(autograd of silu and of mul: about 5 passes); ours reads dy, g and u once and writes dg
and du once (10 bytes per element). The math is fp32 inside; eager rounds act(g) to bf16
before the product, the kernel does not (one rounding fewer: differences are rounding).

Derivatives (s = sigmoid(g), for gelu_tanh k = sqrt(2/pi), z = k (g + 0.044715 g^3),
t = tanh z):
    silu'(g)      = s (1 + g (1 - s))
    gelu'(g)      = Phi(g) + g phi(g)                          (erf form)
    gelu_tanh'(g) = 0.5 (1 + t) + 0.5 g (1 - t^2) k (1 + 3 * 0.044715 g^2)
and dg = dy * u * act'(g), du = dy * act(g).
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
)
from opswap.kernels._triton_op import triton_op

#: the names the crossover table (kernels/crossover.py) measures this kernel under
CROSSOVER = ("swiglu",)  # glu and glu_packed

#: the activations the kernels compute, by the name the ops take
ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
_ACT_ID = {a: i for i, a in enumerate(ACTIVATIONS)}
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _check_act(activation: str) -> int:
    if activation not in _ACT_ID:
        raise KernelError(
            f"activation {activation!r} is not one of {', '.join(ACTIVATIONS)}; pick one of those."
        )
    return _ACT_ID[activation]


def act(g: torch.Tensor, activation: str) -> torch.Tensor:
    """act(g) in PyTorch."""
    _check_act(activation)
    if activation == "silu":
        return F.silu(g)
    return F.gelu(g, approximate="tanh" if activation == "gelu_tanh" else "none")


def reference(g: torch.Tensor, u: torch.Tensor, activation: str) -> torch.Tensor:
    """act(g) * u in fp32 (float64 for float64 inputs), cast to g's dtype: the tests'
    ground truth on float64 inputs."""
    work = torch.float64 if g.dtype == torch.float64 else torch.float32
    return (act(g.to(work), activation) * u.to(work)).to(g.dtype)


def halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, u): the two halves of x [..., 2H] along its last dim, as views."""
    h = x.shape[-1] // 2
    if x.shape[-1] != 2 * h:
        raise KernelError(
            f"a packed gated input needs an even last dim (g and u side by side); got "
            f"{x.shape[-1]}."
        )
    return x[..., :h], x[..., h:]


# ----------------------------------------------------------------------------- the kernels


def _glu_fwd_fn(
    g_ptr,  # [M, H], row stride sg
    u_ptr,  # [M, H], row stride su
    y_ptr,  # [M, H] contiguous
    H,
    sg,
    su,
    ACT: tl.constexpr,  # 0 silu, 1 gelu (erf), 2 gelu (tanh)
    BLOCK: tl.constexpr,
    RN: tl.constexpr,  # the interpreter's bf16 rounding (kernels/_rows.py)
    FLAT: tl.constexpr,  # g, u, y contiguous: H is every element, row 0
):
    # program (row, block of H): read g and u once, write y once. FLAT: program i takes
    # elements i * BLOCK.. of the whole tensor (no half-empty last block per row)
    row = tl.program_id(0).to(tl.int64)
    if FLAT:
        cols = row * BLOCK + tl.arange(0, BLOCK)
        row = row * 0
    else:
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    g = tl.load(g_ptr + row * sg + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * su + cols, mask=ok, other=0.0).to(tl.float32)
    if ACT == 0:
        a = g * tl.sigmoid(g)
    elif ACT == 1:
        a = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    else:
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = 0.5 * g * (2.0 * tl.sigmoid(2.0 * z))  # 1 + tanh z = 2 sigmoid(2 z)
    tl.store(y_ptr + row * H + cols, rn(a * u, RN).to(y_ptr.dtype.element_ty), mask=ok)


def _glu_bwd_fn(
    dy_ptr,  # [M, H] contiguous
    g_ptr,  # [M, H], row stride sg
    u_ptr,  # [M, H], row stride su
    dg_ptr,  # [M, H], row stride sdg (a half of a packed [M, 2H] gradient, or its own)
    du_ptr,  # [M, H], row stride sdu
    H,
    sg,
    su,
    sdg,
    sdu,
    ACT: tl.constexpr,
    BLOCK: tl.constexpr,
    RN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    dy = tl.load(dy_ptr + row * H + cols, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * sg + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * su + cols, mask=ok, other=0.0).to(tl.float32)
    if ACT == 0:
        s = tl.sigmoid(g)
        a = g * s
        da = s * (1.0 + g * (1.0 - s))
    elif ACT == 1:
        cdf = 0.5 * (1.0 + tl.erf(g * 0.7071067811865476))
        a = g * cdf
        da = cdf + g * 0.3989422804014327 * tl.exp(-0.5 * g * g)
    else:
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        t = 2.0 * tl.sigmoid(2.0 * z) - 1.0
        a = 0.5 * g * (1.0 + t)
        da = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * 0.7978845608028654 * (
            1.0 + 0.134145 * g * g
        )
    tl.store(dg_ptr + row * sdg + cols, rn(dy * u * da, RN).to(dg_ptr.dtype.element_ty), mask=ok)
    tl.store(du_ptr + row * sdu + cols, rn(dy * a, RN).to(du_ptr.dtype.element_ty), mask=ok)


def _rows2(t: torch.Tensor) -> torch.Tensor:
    """t [..., H] as [M, H] with unit column stride; views of a packed tensor stay views."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _grid(m: int, h: int) -> tuple[int, int]:
    return (m, -(-h // ELEMENTWISE_BLOCK))


#: the forward on contiguous g and u as one flat run of elements (FLAT_BLOCK a program,
#: FLAT_WARPS warps) instead of rows of ELEMENTWISE_BLOCK blocks; g and u of a packed
#: tensor (strided) take a row a program (`_row_block`). On an H100 at 32768 x 5632
#: (results/tune_rows_h100.json): 3.05 TB/s flat and 3.06 a row a program, against 2.93 for
#: blocks of 1024, torch.compile's 3.05 and Liger-Kernel's 3.06
FLAT = True
FLAT_BLOCK, FLAT_WARPS = 1024, 4


def _row_block(h: int) -> tuple[int, int]:
    """(BLOCK, warps) of the forward's programs along a row of h: the whole row up to 8192
    elements (16 warps at 8192), so a row has no half-empty last block."""
    block = min(8192, max(1024, 1 << (h - 1).bit_length()))
    return block, max(4, block // 512)


def triton_forward(g: torch.Tensor, u: torch.Tensor, activation: str) -> torch.Tensor:
    ident = _check_act(activation)
    g2, u2 = _rows2(g), _rows2(u)
    m, h = g2.shape
    y = torch.empty((m, h), device=g.device, dtype=g.dtype)
    if m and h and FLAT and g2.stride(0) == h and u2.stride(0) == h:
        n = m * h
        wrap_triton(jitted(_glu_fwd_fn))[(-(-n // FLAT_BLOCK),)](
            g2,
            u2,
            y,
            n,
            0,
            0,
            ACT=ident,
            BLOCK=FLAT_BLOCK,
            RN=rn_flag(g.dtype),
            FLAT=True,
            num_warps=FLAT_WARPS,
        )
    elif m and h:
        block, warps = _row_block(h)
        wrap_triton(jitted(_glu_fwd_fn))[(m, -(-h // block))](
            g2,
            u2,
            y,
            h,
            g2.stride(0),
            u2.stride(0),
            ACT=ident,
            BLOCK=block,
            RN=rn_flag(g.dtype),
            FLAT=False,
            num_warps=warps,
        )
    return y.reshape(g.shape)


def triton_backward(
    dy: torch.Tensor,
    g: torch.Tensor,
    u: torch.Tensor,
    dg: torch.Tensor,
    du: torch.Tensor,
    activation: str,
) -> None:
    """Writes dg and du ([..., H] each, possibly the halves of one packed gradient)."""
    ident = _check_act(activation)
    g2, u2 = _rows2(g), _rows2(u)
    m, h = g2.shape
    dg2, du2 = dg.reshape(m, h), du.reshape(m, h)  # views: the caller allocated them
    if m and h:
        wrap_triton(jitted(_glu_bwd_fn))[_grid(m, h)](
            dy.reshape(m, h).contiguous(),
            g2,
            u2,
            dg2,
            du2,
            h,
            g2.stride(0),
            u2.stride(0),
            dg2.stride(0),
            du2.stride(0),
            ACT=ident,
            BLOCK=ELEMENTWISE_BLOCK,
            RN=rn_flag(g.dtype),
        )


def _torch_backward(dy, g, u, activation):
    gf, uf, dyf = g.float(), u.float(), dy.float()
    if activation == "silu":
        s = torch.sigmoid(gf)
        a, da = gf * s, s * (1 + gf * (1 - s))
    elif activation == "gelu":
        cdf = 0.5 * (1 + torch.erf(gf * _INV_SQRT_2))
        a, da = gf * cdf, cdf + gf * _INV_SQRT_2PI * torch.exp(-0.5 * gf * gf)
    else:
        t = torch.tanh(_SQRT_2_OVER_PI * (gf + 0.044715 * gf**3))
        a = 0.5 * gf * (1 + t)
        da = 0.5 * (1 + t) + 0.5 * gf * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 0.134145 * gf * gf)
    return (dyf * uf * da).to(g.dtype), (dyf * a).to(u.dtype)


def _kernel_takes(g: torch.Tensor, u: torch.Tensor) -> bool:
    return (
        runs_triton(g)
        and g.shape == u.shape
        and g.dtype == u.dtype
        and g.device == u.device
        and g.dtype != torch.float64
    )


# ----------------------------------------------------------------------------- the ops


@triton_op("opswap::glu", mutates_args=())
def glu(g: torch.Tensor, u: torch.Tensor, activation: str) -> torch.Tensor:
    """act(g) * u for g, u [..., H] (activation: silu, gelu or gelu_tanh)."""
    _check_act(activation)
    if _kernel_takes(g, u) and not compiles_to_reference("swiglu", g):
        return triton_forward(g, u, activation)
    return reference(g, u, activation).contiguous()  # as the kernel writes it


@triton_op("opswap::glu_backward", mutates_args=())
def glu_backward(
    dy: torch.Tensor, g: torch.Tensor, u: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dg, du) of glu."""
    if _kernel_takes(g, u):
        # contiguous: triton_backward writes through [M, H] views of them, which a
        # transposed or channels-last empty_like(g) would not give (reshape would copy)
        dg = torch.empty(g.shape, device=g.device, dtype=g.dtype)
        du = torch.empty(u.shape, device=u.device, dtype=u.dtype)
        triton_backward(dy, g, u, dg, du, activation)
        return dg, du
    dg, du = _torch_backward(dy, g, u, activation)
    return dg.contiguous(), du.contiguous()


@triton_op("opswap::glu_packed", mutates_args=())
def glu_packed(x: torch.Tensor, activation: str) -> torch.Tensor:
    """act(g) * u for x = [g | u] of shape [..., 2H]; returns [..., H]."""
    _check_act(activation)
    g, u = halves(x)
    if _kernel_takes(g, u) and not compiles_to_reference("swiglu", g):
        return triton_forward(g, u, activation)
    return reference(g, u, activation).contiguous()  # as the kernel writes it


@triton_op("opswap::glu_packed_backward", mutates_args=())
def glu_packed_backward(dy: torch.Tensor, x: torch.Tensor, activation: str) -> torch.Tensor:
    """d(glu_packed)/dx: [..., 2H], dg in the first half and du in the second."""
    g, u = halves(x)
    if _kernel_takes(g, u):
        dx = torch.empty(x.shape, device=x.device, dtype=x.dtype)
        dg, du = halves(dx)
        triton_backward(dy, g, u, dg, du, activation)
        return dx
    return torch.cat(_torch_backward(dy, g, u, activation), dim=-1)


def _setup(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.activation = inputs[2]


def _backward(ctx: Any, dy: torch.Tensor) -> tuple:
    g, u = ctx.saved_tensors
    dg, du = glu_backward(dy, g, u, ctx.activation)
    return dg, du, None


def _setup_packed(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.save_for_backward(inputs[0])
    ctx.activation = inputs[1]


def _backward_packed(ctx: Any, dy: torch.Tensor) -> tuple:
    (x,) = ctx.saved_tensors
    return glu_packed_backward(dy, x, ctx.activation), None


glu.register_autograd(_backward, setup_context=_setup)
glu_packed.register_autograd(_backward_packed, setup_context=_setup_packed)
