"""How opswap::flash_attention launches its Triton kernels (`_flash_fwd`, `_flash_bwd`):
what the kernels take, the autotuned config lists and their prune, the mask's strides,
the tensor-descriptor switch, and the forward and backward launches.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.library import wrap_triton

from opswap.kernels import _flash_bwd, _flash_fwd
from opswap.kernels._rows import KernelError, _is_fake, interpreting, jitted, rn_flag, tl, triton

HEAD_DIMS = (16, 32, 64, 128, 256)
LOG2E = 1.4426950408889634

#: (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel, Hopper-sized tiles first; the
#: prune keeps those a sequence fills. Short lists: autotuning is part of the GPU run.
FWD_CONFIGS = ((128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 4), (64, 64, 4, 3), (64, 32, 4, 4))
DKDV_CONFIGS = ((64, 128, 8, 3), (32, 128, 4, 3), (64, 64, 4, 3), (32, 64, 4, 4))
DQ_CONFIGS = ((128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 4))
#: the interpreter's one tile
INTERP_BLOCK = 16
_TMA = {"on": os.environ.get("OPSWAP_FLASH_TMA", "0") == "1"}


def set_tma(on: bool) -> None:
    """Load the forward's k, v tiles through tensor descriptors where the GPU has them."""
    _TMA["on"] = bool(on)


def unsupported(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> str | None:
    """Why the kernel cannot take these tensors, or None when it can."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "q, k and v must be [batch, heads, seq, head_dim]"
    d = q.shape[-1]
    if d not in HEAD_DIMS or k.shape[-1] != d or v.shape[-1] != d:
        return f"head dim {d} (q), {k.shape[-1]} (k), {v.shape[-1]} (v): the kernel takes one of {HEAD_DIMS}"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or not (
        q.dtype == k.dtype == v.dtype
    ):
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype}: the kernel takes one of fp16, bf16, fp32"
    if q.shape[0] != k.shape[0] or k.shape[:3] != v.shape[:3]:
        return "q, k and v disagree on batch, or k and v on heads or length"
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads"
    if mask is not None:
        full = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        try:
            fits = mask.dim() <= 4 and torch.broadcast_shapes(mask.shape, full) == full
        except RuntimeError:
            fits = False
        if not fits:
            return f"a mask of shape {tuple(mask.shape)} does not broadcast to {full}"
        if not (mask.dtype == torch.bool or mask.dtype.is_floating_point):
            return f"a mask of dtype {mask.dtype}: the kernel takes bool or a float (additive)"
    return None


def _prune() -> Any:
    """An early_config_prune: drop tiles larger than the sequence they cover (a decode step's
    single query row gets the smallest BLOCK_M) and large tiles at head dim 256."""

    def prune(configs: list, named_args: dict, **kwargs: Any) -> list:
        a = {**named_args, **kwargs}
        m = 1 << max(0, int(a["M"]) - 1).bit_length()
        n = 1 << max(0, int(a["N"]) - 1).bit_length()
        d = int(a["D"])
        keep = [
            c
            for c in configs
            if c.kwargs["BLOCK_M"] <= max(m, 32)  # BLOCK_M tiles the queries in every kernel
            and c.kwargs["BLOCK_N"] <= max(n, 32)
            and not (d >= 256 and c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] > 64 * 64)
        ]
        return keep or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]

    return prune


_KERNELS: dict[tuple[Any, ...], Any] = {}
_KEY = ["M", "N", "D", "CAUSAL", "HAS_LEN", "HAS_MASK"]


def _kernel(name: str) -> Any:
    """The kernel `name` ("fwd", "dkdv", "dq", "pre"): autotuned on a GPU, plain in the
    interpreter (which takes the one INTERP_BLOCK tile)."""
    key = (name, interpreting())
    if key not in _KERNELS:
        kernels: dict[str, tuple[Any, Any]] = {
            "fwd": (_flash_fwd._flash_fwd_fn, FWD_CONFIGS),
            "dkdv": (_flash_bwd._flash_bwd_dkdv_fn, DKDV_CONFIGS),
            "dq": (_flash_bwd._flash_bwd_dq_fn, DQ_CONFIGS),
            "pre": (_flash_bwd._flash_bwd_pre_fn, None),
        }
        fn, table = kernels[name]
        k = jitted(fn)
        if table is not None and not interpreting():
            configs = [
                triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
                for bm, bn, w, st in table
            ]
            keys = _KEY + (["USE_TMA"] if name == "fwd" else [])
            k = triton.autotune(
                configs, key=keys, prune_configs_by={"early_config_prune": _prune()}
            )(k)
        _KERNELS[key] = k
    return _KERNELS[key]


def _flags(q: torch.Tensor, lengths: torch.Tensor | None, mask: torch.Tensor | None) -> dict:
    kw: dict[str, Any] = {
        "HAS_LEN": lengths is not None,
        "HAS_MASK": mask is not None,
        "MASK_BOOL": mask is not None and mask.dtype == torch.bool,
        "D": q.shape[-1],
        "PREC": "ieee" if q.dtype == torch.float32 else "tf32",
        "RN": rn_flag(q.dtype),
        "DOT_F32": interpreting(),  # every constexpr passed: inductor's wrapper takes no defaults
    }
    if interpreting():
        kw.update(BLOCK_M=INTERP_BLOCK, BLOCK_N=INTERP_BLOCK)
    return kw


def _mask_args(mask: torch.Tensor | None, full: tuple[int, ...], dummy: torch.Tensor) -> tuple:
    """The mask (bool viewed as uint8) broadcast to `full` by strides, and those strides."""
    if mask is None:
        return dummy, (0, 0, 0, 0)
    m = mask.expand(full)
    if m.dtype == torch.bool:
        m = m.view(torch.uint8)
    return m, tuple(m.stride())


def _tma_ok(k: torch.Tensor, v: torch.Tensor) -> bool:
    if not _TMA["on"] or not hasattr(tl, "make_tensor_descriptor"):
        return False
    if interpreting():
        return True
    if k.device.type != "cuda" or _is_fake(k) or torch.cuda.get_device_capability(k.device)[0] < 9:
        return False
    es = k.element_size()
    return all(
        t.data_ptr() % 16 == 0 and all(s * es % 16 == 0 for s in t.stride()[:-1]) for t in (k, v)
    )


def _set_allocator() -> None:
    """Device-side tensor descriptors need a scratch allocation per launch."""
    triton.set_allocator(
        lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda")
    )


def _checked(q, k, v, mask) -> tuple[torch.Tensor, ...]:
    why = unsupported(q, k, v, mask)
    if why is not None:
        raise KernelError(f"flash_attention: {why}.")
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))


def triton_forward(q, k, v, causal, scale, lengths=None, mask=None):
    """(o, lse) by `_flash_fwd_fn`: o like q (contiguous), lse [B, H, S_q] fp32."""
    q, k, v = _checked(q, k, v, mask)
    bsz, h, m, _ = q.shape
    hk, n = k.shape[1], k.shape[2]
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((bsz, h, m), device=q.device, dtype=torch.float32)
    if o.numel() == 0:
        return o, lse
    lens = lengths.to(device=q.device, dtype=torch.int32) if lengths is not None else lse
    mk, ms = _mask_args(mask, (bsz, h, m, n), lse)
    tma = _tma_ok(k, v)
    if tma and not interpreting():
        _set_allocator()

    def grid(meta: dict[str, Any]) -> tuple[int, int]:
        return (triton.cdiv(m, meta["BLOCK_M"]), bsz * h)

    strides = [*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], *ms]
    wrap_triton(_kernel("fwd"))[grid](
        q, k, v, o, lse, lens, mk, scale * LOG2E, *strides, h, h // hk, m, n,
        CAUSAL=causal, USE_TMA=tma, **_flags(q, lengths, mask),
    )  # fmt: skip
    return o, lse


def triton_backward(do, q, k, v, o, lse, causal, scale, lengths=None, mask=None):
    """(dq, dk, dv) by the three `_flash_bwd` kernels."""
    q, k, v = _checked(q, k, v, mask)
    bsz, h, m, d = q.shape
    hk, n = k.shape[1], k.shape[2]
    do = do.to(q.dtype)
    if do.stride() != q.stride():  # the kernels read dO with q's strides
        q, do = q.contiguous(), do.contiguous()
    o = o.contiguous()
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    delta = torch.empty((bsz, h, m), device=q.device, dtype=torch.float32)
    lens = lengths.to(device=q.device, dtype=torch.int32) if lengths is not None else delta
    mk, ms = _mask_args(mask, (bsz, h, m, n), delta)
    pre_block = INTERP_BLOCK if interpreting() else 64
    wrap_triton(_kernel("pre"))[(triton.cdiv(m, pre_block), bsz * h)](
        o, do, delta, *o.stride()[:3], *do.stride()[:3], h, m, D=d, BLOCK_M=pre_block
    )
    kw = {"CAUSAL": causal, **_flags(q, lengths, mask)}
    qkv = [*q.stride()[:3], *k.stride()[:3], *v.stride()[:3]]

    def grid_kv(meta: dict[str, Any]) -> tuple[int, int]:
        return (triton.cdiv(n, meta["BLOCK_N"]), bsz * hk)

    wrap_triton(_kernel("dkdv"))[grid_kv](
        q, k, v, do, dk, dv, lse, delta, lens, mk, scale * LOG2E, scale,
        *qkv, *dk.stride()[:3], *ms, h, hk, h // hk, m, n, **kw,
    )  # fmt: skip

    def grid_q(meta: dict[str, Any]) -> tuple[int, int]:
        return (triton.cdiv(m, meta["BLOCK_M"]), bsz * h)

    wrap_triton(_kernel("dq"))[grid_q](
        q, k, v, do, dq, lse, delta, lens, mk, scale * LOG2E, scale,
        *qkv, *dq.stride()[:3], *ms, h, h // hk, m, n, **kw,
    )  # fmt: skip
    return dq, dk, dv
