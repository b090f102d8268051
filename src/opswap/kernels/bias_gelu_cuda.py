"""gelu(x + b) (erf form) as a CUDA C++ kernel: the op `opswap::bias_gelu_cuda`, built
from `cuda/bias_gelu.cu` and its binding `cuda/bias_gelu.cpp` with
torch.utils.cpp_extension.load at first use, into a cache directory
(OPSWAP_EXTENSIONS_DIR, default ~/.cache/opswap/extensions), so later processes load it
without compiling.

Why a CUDA C++ kernel next to the Triton ones (chapter 20): the same registration makes
any compiled code a torch op. `torch.library.custom_op` with a fake implementation lets
torch.compile and torch.export trace through it (they record the op, not the kernel),
and the autograd formula makes it trainable:
    d/dx gelu(x + b) = Phi(z) + z phi(z),  z = x + b;  db = that, summed over rows,
computed by a second CUDA kernel, `opswap::bias_gelu_cuda_backward`: dy and x read once,
dx written once, the column sums kept in registers per chunk of rows.

The kernel reads x and b and writes y once (4 bytes per element in half precision,
against eager's add then gelu: 8), with fp32 math and paired loads (half2 /
__nv_bfloat162 / float2) where the pointers are aligned and N is even (see the .cu).

Without a CUDA device or nvcc the op cannot be built: `build()` raises an
ExtensionError naming what is missing; the op on CPU tensors computes the reference.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from opswap.errors import OpswapError

#: the names the crossover table (kernels/crossover.py) measures this kernel under
CROSSOVER = ("bias_gelu_cuda",)

SOURCES = [
    Path(__file__).with_name("cuda") / "bias_gelu.cpp",
    Path(__file__).with_name("cuda") / "bias_gelu.cu",
]
_MODULE: Any = None


class ExtensionError(OpswapError, RuntimeError):
    """A CUDA C++ extension that cannot be built or loaded here."""


def reference(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """gelu(x + b) with fp32 math (float64 for float64), in x's dtype."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    return F.gelu(x.to(work) + b.to(work)).to(x.dtype)


def cache_dir() -> Path:
    return Path(
        os.environ.get("OPSWAP_EXTENSIONS_DIR", Path.home() / ".cache" / "opswap" / "extensions")
    )


def unavailable() -> str | None:
    """Why the extension cannot be built here, or None when it can."""
    if not torch.cuda.is_available():
        return "no CUDA device is visible (torch.cuda.is_available() is False)"
    if torch.version.cuda is None:
        return "this PyTorch build has no CUDA support"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None and shutil.which("nvcc") is None:
        return "nvcc (the CUDA toolkit) is not installed; set CUDA_HOME or install it"
    missing = [str(p) for p in SOURCES if not p.is_file()]
    if missing:
        return f"the kernel sources are missing from the installed package: {', '.join(missing)}"
    return None


def build() -> Any:
    """The compiled extension module, built on first use (minutes) and cached."""
    global _MODULE
    if _MODULE is not None:
        return _MODULE
    why = unavailable()
    if why:
        raise ExtensionError(
            f"opswap::bias_gelu_cuda cannot be built: {why}; run it on a machine with a "
            "CUDA GPU and the CUDA toolkit, or use the eager gelu(x + b)."
        )
    from torch.utils.cpp_extension import load

    out = cache_dir()
    out.mkdir(parents=True, exist_ok=True)
    try:
        _MODULE = load(
            name="opswap_bias_gelu",
            sources=[str(p) for p in SOURCES],
            build_directory=str(out),
            extra_cuda_cflags=["-O3"],  # no fast math: erff must stay accurate
            verbose=False,
        )
    except Exception as e:  # a compiler error: say which and where the log is
        raise ExtensionError(
            f"building opswap::bias_gelu_cuda in {out} failed ({type(e).__name__}: "
            f"{str(e)[-400:]}); check the CUDA toolkit matches torch.version.cuda "
            f"({torch.version.cuda})."
        ) from None
    return _MODULE


def _kernel_takes(x: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        x.is_cuda
        and b.is_cuda
        and x.dtype == b.dtype
        and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and b.dim() == 1
        and x.dim() >= 1
        and b.shape[0] == x.shape[-1]
    )


@torch.library.custom_op("opswap::bias_gelu_cuda", mutates_args=())
def bias_gelu_cuda(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """gelu(x + b), erf form, for x [..., N] and b [N]: the CUDA C++ kernel on CUDA
    tensors of one dtype, the reference otherwise. Contiguous whatever x's layout, as the
    kernel writes it (and the fake kernel says)."""
    if _kernel_takes(x, b):
        return build().bias_gelu(x, b)
    return reference(x, b).contiguous()


@bias_gelu_cuda.register_fake
def _(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.save_for_backward(inputs[0], inputs[1])


def reference_backward(
    dy: torch.Tensor, x: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, db) of gelu(x + b) with fp32 math (float64 for float64); db in fp32."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    z = x.to(work) + b.to(work)
    d = dy.to(work) * (
        0.5 * (1 + torch.erf(z / math.sqrt(2)))
        + z * torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
    )
    return d.to(x.dtype), d.reshape(-1, x.shape[-1]).sum(0)


@torch.library.custom_op("opswap::bias_gelu_cuda_backward", mutates_args=())
def bias_gelu_cuda_backward(
    dy: torch.Tensor, x: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, db) of bias_gelu_cuda, db in fp32: one CUDA kernel that reads dy and x once,
    writes dx and sums each column's dx in registers (see the .cu), on CUDA tensors of one
    dtype; the reference otherwise."""
    if _kernel_takes(x, b) and dy.shape == x.shape and dy.dtype == x.dtype and dy.is_cuda:
        dx, part = build().bias_gelu_backward(dy, x, b)
        return dx, part.sum(0)
    dx, db = reference_backward(dy, x, b)
    return dx.contiguous(), db


@bias_gelu_cuda_backward.register_fake
def _(dy: torch.Tensor, x: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    return dx, x.new_empty((x.shape[-1],), dtype=torch.float32)


def _backward(ctx: Any, dy: torch.Tensor) -> tuple:
    x, b = ctx.saved_tensors
    dx, db = bias_gelu_cuda_backward(dy, x, b)
    return dx, (db.to(b.dtype) if ctx.needs_input_grad[1] else None)


bias_gelu_cuda.register_autograd(_backward, setup_context=_setup)
