"""Every op opswap registers (`torch.ops.opswap.*`): its fake kernel, which torch.compile and
torch.export trace with, gives the sizes, strides, storage offset, dtype and device that
the real kernel returns, for inputs in every memory format the op takes: contiguous,
channels-last (2-D and 3-D), transposed and sliced views, batch 1, one channel, odd sizes
and size-1 dims with arbitrary strides (the case where "channels-last" and "contiguous"
read the same memory and only a size-1 stride tells them apart).

The check is `torch.library.opcheck`'s own (test_faketensor: the op on real tensors and
again on fake copies, strides compared over the dims longer than one, which are the only
ones Inductor's `assert_size_stride` compares too), plus the fake kernel under symbolic
sizes, as a dynamic compile runs it. `SAMPLES` must name every registered op: a new op
without sample inputs fails `test_every_registered_op_has_samples`.

On this CPU the real kernel of a Triton op is its PyTorch path; the Triton kernels run in a
child Python under TRITON_INTERPRET=1 (`test_triton_kernels_match_their_fake_kernels`),
where each op's real result comes from its Triton kernel and the fake one from tracing the
op, as on a GPU. On a CUDA machine the child runs the same samples on the GPU.
"""

from __future__ import annotations

import json
import os
import pkgutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree

SRC = Path(__file__).resolve().parents[2] / "src"
if str(SRC) not in sys.path:  # the child Python runs this file as a script
    sys.path.insert(0, str(SRC))

import opswap.kernels  # noqa: E402  (registers the ops)

DEVICE = os.environ.get("OPSWAP_FAKE_DEVICE", "cpu")


def registered_ops() -> list[str]:
    """Every op in the opswap namespace, after importing each module of opswap.kernels."""
    for mod in pkgutil.iter_modules(opswap.kernels.__path__):
        __import__(f"opswap.kernels.{mod.name}")
    names = torch._C._dispatch_get_all_op_names()
    return sorted(n.split("::", 1)[1] for n in names if n.startswith("opswap::"))


# ----------------------------------------------------------------------------- layouts


def _randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, device=DEVICE).to(dtype)


def layouts(*shape: int, dtype: torch.dtype = torch.float32) -> list[tuple[str, torch.Tensor]]:
    """A tensor of `shape` in each memory layout a caller may hand an op."""
    out = [("contiguous", _randn(*shape, dtype=dtype))]
    if len(shape) >= 2:
        a, b, *rest = shape
        out.append(("dims 0, 1 swapped", _randn(b, a, *rest, dtype=dtype).transpose(0, 1)))
        *lead, m, n = shape
        out.append(("last dim strided", _randn(*lead, n, m, dtype=dtype).transpose(-1, -2)))
    *lead, n = shape
    out.append(("sliced, offset", _randn(*lead, n + 3, dtype=dtype)[..., 1 : n + 1]))
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(len(shape))
    if fmt is not None:
        name = "channels_last" if len(shape) == 4 else "channels_last_3d"
        out.append((name, _randn(*shape, dtype=dtype).contiguous(memory_format=fmt)))
        if 1 in shape:  # channels-last strides written out, size-1 dims included
            t = torch.empty_strided(shape, _cl_strides(shape), device=DEVICE, dtype=dtype)
            out.append((name + " (size-1 strides too)", t.copy_(_randn(*shape, dtype=dtype))))
    if 1 in shape:
        t = _randn(*shape, dtype=dtype)
        odd = [7 if s == 1 else st for s, st in zip(shape, t.stride(), strict=True)]
        out.append(("size-1 dims with stride 7", t.as_strided(shape, odd)))
    return out


def _cl_strides(shape: tuple[int, ...]) -> list[int]:
    order = [1, *range(len(shape) - 1, 1, -1), 0]  # innermost first
    strides, step = [0] * len(shape), 1
    for d in order:
        strides[d] = step
        step *= max(shape[d], 1)
    return strides


@dataclass
class Sample:
    label: str
    args: tuple
    kwargs: dict[str, Any] = field(default_factory=dict)


def _over(shapes, make: Callable[[torch.Tensor], tuple], **kw) -> list[Sample]:
    """A sample for each layout of each shape, its args built by `make` from the tensor."""
    return [
        Sample(f"{list(shape)} {name}", make(t))
        for shape in shapes
        for name, t in layouts(*shape, **kw)
    ]


ROWS = [(3, 5, 8), (1, 1, 8), (2, 3, 1, 6)]  # batch >1 and 1, size-1 dims, a 4-D input


def _row_norm_samples() -> dict[str, list[Sample]]:
    w = _randn(8)
    out = {
        "rms_norm": _over(ROWS[:2], lambda x: (x, w, 1e-6, 0.0, True))
        + _over([(2, 3, 1, 8)], lambda x: (x, None, 1e-6, 1.0, False))
        + _over([(3, 8)], lambda x: (x, w, 1e-6, 0.0, True), dtype=torch.bfloat16),
        "add_rms_norm": _over(ROWS[:2], lambda x: (x, _randn(*x.shape), w, 1e-6, 0.0, True))
        + _over([(3, 8)], lambda x: (x, x.clone(), None, 1e-6, 0.0, False), dtype=torch.bfloat16),
        "rms_norm_backward": _over(
            ROWS[:2], lambda x: (_randn(*x.shape), x, w, None, 1e-6, 0.0, True)
        )
        + _over(
            [(3, 8)], lambda x: (_randn(*x.shape), x, None, _randn(*x.shape), 1e-6, 0.0, False)
        ),
        "layer_norm": _over(ROWS[:2], lambda x: (x, w, _randn(8), 1e-5))
        + _over([(2, 3, 1, 8)], lambda x: (x, None, None, 1e-5)),
        "layer_norm_backward": _over(ROWS[:2], lambda x: (_randn(*x.shape), x, w, 1e-5))
        + _over([(3, 8)], lambda x: (_randn(*x.shape), x, None, 1e-5)),
    }
    return out


def _group_norm_samples() -> dict[str, list[Sample]]:
    shapes = [(2, 6, 5, 3), (1, 4, 1, 1), (3, 4, 7), (2, 4, 3, 1, 5)]

    def fwd(x):
        c = x.shape[1]
        return (x, 2, _randn(c), _randn(c), 1e-5)

    def bwd(x):
        return (_randn(*x.shape), x, 2, _randn(x.shape[1]), 1e-5)

    return {
        "group_norm": _over(shapes, fwd) + _over([(2, 6, 5)], lambda x: (x, 3, None, None, 1e-5)),
        "group_norm_backward": _over(shapes, bwd),
    }


def _activation_samples() -> dict[str, list[Sample]]:
    def bias(x):
        return _randn(x.shape[-1])

    return {
        "bias_act": _over(ROWS, lambda x: (x, bias(x), "gelu", 0.01))
        + _over([(5, 7)], lambda x: (x, None, "leaky_relu", 0.2)),
        "bias_act_backward": _over(ROWS, lambda x: (_randn(*x.shape), x, bias(x), "silu", 0.01)),
        "bias_gelu_cuda": _over(ROWS, lambda x: (x, bias(x))),
        "bias_gelu_cuda_backward": _over(ROWS, lambda x: (_randn(*x.shape), x, bias(x))),
        "glu": _over(ROWS, lambda g: (g, _randn(*g.shape), "silu"))
        + _over([(4, 6)], lambda u: (_randn(*u.shape), u, "gelu_tanh")),
        "glu_backward": _over(ROWS, lambda g: (_randn(*g.shape), g, _randn(*g.shape), "gelu")),
        "glu_packed": _over([(3, 5, 12), (1, 1, 6), (2, 3, 1, 8)], lambda x: (x, "silu")),
        "glu_packed_backward": _over(
            [(3, 5, 12), (1, 1, 6)],
            lambda x: (_randn(*x.shape[:-1], x.shape[-1] // 2), x, "gelu"),
        ),
    }


def _softmax_samples() -> dict[str, list[Sample]]:
    shapes = [(3, 5, 7), (1, 1, 9), (2, 3, 1, 6)]
    return {
        "softmax": _over(shapes, lambda x: (x,))
        + _over([(4, 7)], lambda x: (x, torch.float32), dtype=torch.bfloat16),
        "log_softmax": _over(shapes, lambda x: (x,))
        + _over([(4, 7)], lambda x: (x, torch.float64)),
        "masked_softmax": _over(shapes, lambda x: (x, _randn(*x.shape[-1:]), 0.5))
        + _over([(2, 3, 4, 5)], lambda x: (x, _randn(4, 5) > 0, 1.0))
        + _over([(2, 3, 4, 5)], lambda x: (x, None, 0.3, torch.float32)),
        "softmax_backward": _over(
            shapes, lambda y: (_randn(*y.shape), y, False, 1.0, torch.float32)
        )
        + _over([(4, 7)], lambda y: (_randn(*y.shape), y, True, 0.5, torch.bfloat16)),
    }


def _reduction_samples() -> dict[str, list[Sample]]:
    shapes = [(3, 5, 7), (1, 1, 9), (2, 3, 1, 6)]
    out = {
        "row_reduce": [
            Sample(f"{op} keepdim={keep}: {s.label}", (*s.args, op, True, keep))
            for op, keep in (("sum", False), ("var", True), ("max", False), ("meansq", True))
            for s in _over(shapes[:2], lambda x: (x,))
        ],
        "row_dot": _over(shapes, lambda x: (x, _randn(*x.shape), False))
        + _over([(4, 7)], lambda y: (_randn(*y.shape), y, True)),
        "row_sumsq_backward": _over(shapes, lambda x: (_randn(*x.shape[:-1], 1), x, 2.0)),
    }
    return out


def _rope_samples() -> dict[str, list[Sample]]:
    def tables(s, d=8):
        return _randn(s, d), _randn(s, d)

    def fwd(q):
        b, h, s, d = q.shape
        cos, sin = tables(s, d)
        return (q, _randn(b, 1, s, d), cos, sin, None, False)

    def bwd(dq):
        b, h, s, d = dq.shape
        cos, sin = tables(s, d)
        return (dq, _randn(b, 2, s, d), cos, sin, None, True, torch.float32, torch.float32)

    shapes = [(2, 4, 5, 8), (1, 1, 3, 8), (2, 3, 1, 8)]
    pos = torch.tensor([3, 0, 2], device=DEVICE)
    return {
        "rope": _over(shapes, fwd)
        + _over([(2, 2, 3, 8)], lambda k: (_randn(*k.shape), k, *tables(6), pos, True)),
        "rope_backward": _over(shapes, bwd),
    }


def _attention_samples() -> dict[str, list[Sample]]:
    def fwd(q, causal=False):
        b, h, s, d = q.shape
        return (q, _randn(b, 2, 6, d), _randn(b, 2, 6, d), causal, d**-0.5, None, None)

    def bwd(q):
        b, h, s, d = q.shape
        k, v = _randn(b, 2, 6, d), _randn(b, 2, 6, d)
        o, lse = torch.ops.opswap.flash_attention(q, k, v, True, 0.25, None, None)
        return (_randn(*q.shape), q, k, v, o, lse, True, 0.25, None, None)

    def decode(q):
        b, h, _, d = q.shape
        lengths = torch.tensor([5, 16, 1][:b], device=DEVICE, dtype=torch.int32)
        return (q, _randn(b, 2, 16, d), _randn(b, 2, 16, d), lengths, d**-0.5, 0)

    def paged(q, prefill):
        d = q.shape[-1]
        kc, vc = _randn(6, 4, 2, d), _randn(6, 4, 2, d)
        tables = torch.tensor([[3, 0, 5], [1, 2, 4], [4, 5, 0]], device=DEVICE)
        if not prefill:
            lens = torch.tensor([5, 1, 8][: q.shape[0]], device=DEVICE, dtype=torch.int32)
            return (q, kc, vc, tables[: q.shape[0]].int(), lens, d**-0.5)
        t = q.shape[0]
        cu = torch.tensor([0, 2, t], device=DEVICE, dtype=torch.int32)
        lens = torch.tensor([5, t + 1], device=DEVICE, dtype=torch.int32)
        return (q, kc, vc, tables[:2].int(), cu, lens, d**-0.5)

    shapes = [(2, 4, 5, 16), (1, 2, 1, 16)]
    lengths = torch.tensor([4, 6], device=DEVICE, dtype=torch.int32)
    return {
        "flash_attention": _over(shapes, fwd)
        + _over([(2, 2, 3, 16)], lambda q: (q, q.clone(), q.clone(), True, 0.3, lengths, None))
        + _over(
            [(1, 2, 3, 16)], lambda q: (q, q.clone(), q.clone(), False, 0.3, None, _randn(3, 3))
        ),
        "flash_attention_backward": _over(shapes, bwd),
        "decode_attention": _over([(2, 4, 1, 64), (1, 2, 1, 64)], decode),
        # q [B, H, D] over a paged cache of 6 blocks of 4 (2 KV heads); sequences of 5, 1, 8
        "paged_decode_attention": _over([(3, 4, 16), (1, 2, 16)], lambda q: paged(q, False)),
        # q [T, H, D]: chunks of 2 and of T - 2 rows ending contexts of 5 and T + 1
        "paged_prefill_attention": _over([(6, 4, 16), (3, 2, 16)], lambda q: paged(q, True)),
    }


def _conv_samples() -> list[Sample]:
    cl = torch.channels_last
    out = []
    for label, x in layouts(4, 1, 8, 8) + layouts(1, 3, 7, 5) + layouts(2, 3, 7, 5):
        c = x.shape[1]
        for wname, w in (
            ("w", _randn(6, c, 3, 3)),
            ("w cl", _randn(6, c, 3, 3).contiguous(memory_format=cl)),
        ):
            out.append(
                Sample(
                    f"{wname}: {list(x.shape)} {label}",
                    (x, w, _randn(6), [1, 1], [1, 1], [1, 1], 1),
                )
            )
        # a one-input-channel weight written channels-last (the layout rule does this)
        w1 = torch.empty_strided((6, c, 3, 3), _cl_strides((6, c, 3, 3)), device=DEVICE)
        w1.copy_(_randn(6, c, 3, 3))
        out.append(
            Sample(
                f"w cl strides: {list(x.shape)} {label}", (x, w1, None, [2, 1], [0, 1], [1, 1], 1)
            )
        )
    for label, x in layouts(2, 4, 5, 7):
        w = _randn(6, 2, 3, 1)
        out.append(Sample(f"groups=2 {label}", (x, w, None, [1, 1], [1, 0], [2, 1], 2)))
    for label, x in layouts(2, 3, 9):
        out.append(Sample(f"conv1d {label}", (x, _randn(4, 3, 3), _randn(4), [1], [1], [1], 1)))
    for label, x in layouts(2, 3, 4, 5, 3) + layouts(1, 1, 3, 4, 5):
        c = x.shape[1]
        w = _randn(4, c, 3, 3, 3)
        out.append(
            Sample(
                f"conv3d {list(x.shape)} {label}",
                (x, w, _randn(4), [1, 1, 1], [1, 1, 1], [1, 1, 1], 1),
            )
        )
        w3 = w.contiguous(memory_format=torch.channels_last_3d)
        out.append(
            Sample(
                f"conv3d, w cl3d: {list(x.shape)} {label}",
                (x, w3, None, [1, 1, 1], [1, 1, 1], [1, 1, 1], 1),
            )
        )
    return out


def _int8_samples() -> dict[str, list[Sample]]:
    from opswap.kernels.int8_linear import quantize_weight as q_dyn
    from opswap.kernels.int8_static import quantize_weight as q_static

    wq, ws = (t.to(DEVICE) for t in q_dyn(torch.randn(6, 16)))  # [K, N]
    sq, ss = (t.to(DEVICE) for t in q_static(torch.randn(6, 16)))  # [N, K]
    cq, cs = (t.to(DEVICE) for t in q_static(torch.randn(5, 3, 3, 3)))
    cq1, cs1 = (t.to(DEVICE) for t in q_static(torch.randn(5, 1, 3, 3)))
    shapes = [(3, 5, 16), (1, 1, 16), (2, 3, 1, 16)]

    def conv(x):
        w, s = (cq1, cs1) if x.shape[1] == 1 else (cq, cs)
        return (x, w, s, 0.05, 128, _randn(5), [1, 1], [1, 1], [1, 1], 1, "relu")

    return {
        "int8_linear": _over(shapes, lambda x: (x, wq, ws, _randn(6))),
        "int8_linear_fbgemm": _over(shapes, lambda x: (x, wq, ws, None)),
        "int8_static_linear": _over(shapes, lambda x: (x, sq, ss, 0.05, 128, _randn(6)))
        + _over([(3, 16)], lambda x: (x, sq, ss, 0.05, 128, None, "gelu", 0.1, 120)),
        "int8_static_conv2d": _over([(2, 3, 7, 5), (1, 3, 1, 6), (4, 1, 8, 8)], conv)
        + [
            Sample(
                "uint8 in, uint8 out",
                (
                    torch.randint(0, 255, (2, 3, 6, 5), dtype=torch.uint8, device=DEVICE),
                    cq,
                    cs,
                    0.05,
                    128,
                    None,
                    [2, 1],
                    [0, 1],
                    [1, 1],
                    1,
                    "none",
                    0.1,
                    128,
                ),
            )
        ],
    }


def _conv_algorithm_samples() -> dict[str, list[Sample]]:
    """conv_im2col (any stride, dilation, groups) and conv_fft (stride 1), 1-D and 2-D: the
    output is contiguous whatever the input's layout."""
    im2col, fft = [], []
    for label, x in layouts(2, 6, 9, 7) + layouts(1, 3, 5, 8):
        c = x.shape[1]
        im2col.append(
            Sample(
                f"2-D {list(x.shape)} {label}",
                (x, _randn(4, c, 3, 2), _randn(4), [2, 1], [1, 0], [1, 2], 1),
            )
        )
        fft.append(
            Sample(f"2-D {list(x.shape)} {label}", (x, _randn(2 * c, 1, 3, 5), None, [1, 2], c))
        )
    for label, x in layouts(2, 4, 17):
        im2col.append(Sample(f"1-D {label}", (x, _randn(6, 2, 5), None, [2], [3], [2], 2)))
        fft.append(Sample(f"1-D {label}", (x, _randn(5, 4, 9), _randn(5), [4], 1)))
    # oneDNN's packed conv and NNPACK: conv2d in float32; the output keeps a channels-last
    # input's format
    onednn, nnpack = [], []
    for label, x in layouts(2, 6, 9, 7) + layouts(1, 3, 5, 8):
        c = x.shape[1]
        onednn.append(
            Sample(
                f"{list(x.shape)} {label}",
                (x, _randn(c, 1, 3, 3), _randn(c), [2, 1], [1, 0], [2, 1], c),
            )
        )
        nnpack.append(
            Sample(
                f"{list(x.shape)} {label}", (x, _randn(4, c, 3, 2), None, [2, 1], [1, 0], [1, 1], 1)
            )
        )
    return {"conv_im2col": im2col, "conv_fft": fft, "conv_onednn": onednn, "conv_nnpack": nnpack}


def _low_bit_samples() -> dict[str, list[Sample]]:
    from opswap.kernels.fp8_linear import quantize_weight as q_fp8
    from opswap.kernels.weight_only import quantize

    w = torch.randn(6, 32)
    fq, fs = q_fp8(w)
    tq, ts = q_fp8(w, rowwise=False)
    q4, s4, o4, _ = quantize(w, 4, 32)
    q8, s8, _o8, _ = quantize(w, 8)
    shapes = [(3, 5, 32), (1, 1, 32), (2, 3, 1, 32)]
    dev = lambda *ts: tuple(t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in ts)  # noqa: E731
    return {
        "fp8_linear": _over(shapes, lambda x: (x, *dev(fq, fs), _randn(6), True))
        + _over([(3, 32)], lambda x: (x, *dev(tq, ts), None, False)),
        "wo_linear": _over(shapes, lambda x: (x, *dev(q4, s4, o4), None, 4, 32))
        + _over(shapes[:2], lambda x: (x, *dev(q8, s8), None, _randn(6), 8, 32))
        # bfloat16: what the Triton kernel takes (on CUDA, or called directly below)
        + _over(shapes, lambda x: (x, *dev(q4, s4, o4), None, 4, 32), dtype=torch.bfloat16)
        + _over([(3, 32)], lambda x: (x, *dev(q8, s8), None, None, 8, 32), dtype=torch.bfloat16),
        "gemm": _over(shapes, lambda x: (x, *dev(w), _randn(6), None, "relu", True, "ieee"))
        + _over(
            shapes[:1],
            lambda x: (x, *dev(w.t().contiguous()), None, _randn(3, 5, 6), "silu", False, "ieee"),
        ),
    }


def _winograd_samples() -> dict[str, list[Sample]]:
    w, b = _randn(6, 3, 3, 3), _randn(6)
    wg = _randn(6, 2, 3, 3)
    return {
        "conv_winograd": _over([(2, 3, 7, 5), (1, 3, 1, 4)], lambda x: (x, w, b, [1, 1], 1, 4))
        + _over([(2, 4, 5, 6)], lambda x: (x, wg, None, [0, 2], 2, 2))
    }


def _sparse_samples() -> dict[str, list[Sample]]:
    """x [M, K] against a [6, 8] weight with half its entries zero, in CSR and in 2x2 BSR."""
    w = _randn(6, 8)
    w = w * (torch.arange(48, device=DEVICE).reshape(6, 8) % 2)
    b = _randn(6)
    csr, bsr = w.to_sparse_csr(), w.to_sparse_bsr((2, 2))
    parts = [
        (m.crow_indices().clone(), m.col_indices().clone(), m.values().clone()) for m in (csr, bsr)
    ]  # values [nnz] for CSR, [blocks, 2, 2] for BSR
    return {
        "sparse_linear": [
            Sample(f"{kind}: {s.label}", (*s.args, *p, b, 6))
            for kind, p in zip(("csr", "bsr"), parts, strict=True)
            for s in _over([(3, 8), (1, 8)], lambda x: (x,))
        ]
    }


def _topk_samples() -> dict[str, list[Sample]]:
    shapes = [(3, 5, 7), (1, 1, 9), (2, 3, 1, 6)]
    return {
        "topk": [
            Sample(f"k={k} largest={big}: {s.label}", (*s.args, k, big, True))
            for k, big in ((1, True), (4, False))
            for s in _over(shapes[:2], lambda x: (x,))
        ],
        "approx_topk": _over([(3, 8), (1, 1, 12)], lambda x: (x, 2, True, 2, 2)),
        "batched_embedding_bag": [
            Sample(
                f"B={b} T={t} L={n} mean={mean} weighted={w}",
                (
                    _randn(30, 7, dtype=dt),
                    torch.tensor([0, 12, 20][:t], device=DEVICE),
                    torch.randint(0, 10, (b, t, n), device=DEVICE),
                    _randn(b, t, n) if w else None,
                    mean,
                    None,
                    None,
                    torch.float32 if dt != torch.float32 else None,
                ),
            )
            for b, t, n, mean, w, dt in (
                (4, 3, 5, False, False, torch.float32),
                (1, 2, 1, True, True, torch.float32),
                (3, 1, 4, True, False, torch.float16),
            )
        ],
    }


def _rnn_samples() -> dict[str, list[Sample]]:
    """x [B, T, F] in each layout, batch-first, and [T, B, F] time-major; hidden 5."""
    w_ih4, w_hh4, b4 = _randn(20, 4), _randn(20, 5), _randn(20)
    w_ih3, w_hh3, b3 = _randn(15, 4), _randn(15, 5), _randn(15)

    def h(x: torch.Tensor, first: bool) -> torch.Tensor:
        return _randn(x.shape[0] if first else x.shape[1], 5)

    return {
        "lstm_seq": _over(
            [(3, 6, 4), (1, 1, 4)],
            lambda x: (x, h(x, True), h(x, True), w_ih4, w_hh4, b4, b4, True),
        )
        + _over(
            [(6, 2, 4)], lambda x: (x, h(x, False), h(x, False), w_ih4, w_hh4, None, None, False)
        ),
        "gru_seq": _over(
            [(3, 6, 4), (1, 1, 4)], lambda x: (x, h(x, True), w_ih3, w_hh3, b3, b3, True)
        )
        + _over([(6, 2, 4)], lambda x: (x, h(x, False), w_ih3, w_hh3, None, b3, False)),
    }


def _loss_samples() -> dict[str, list[Sample]]:
    """hidden [N, H] in each layout against a [V, H] weight (fused linear + cross-entropy)."""
    t = torch.tensor([3, -100, 0, 4, 1, 2, -100], device=DEVICE)
    w, b = _randn(5, 8), _randn(5)

    def fwd(reduction, with_grad, bias):
        return lambda h: (h, w, t[: h.shape[0]], bias, -100, 0.1, reduction, 3.0, with_grad)

    def bwd(reduction):
        def make(h):
            n = h.shape[0]
            lse = torch.randn(n, device=DEVICE)
            g = _randn(n) if reduction == "none" else _randn(1)[0]
            return (g, h, w, t[:n], b, lse, -100, 0.0, reduction, None)

        return make

    return {
        "linear_cross_entropy": _over([(7, 8)], fwd("mean", True, b))
        + _over([(1, 8)], fwd("none", True, None))
        + _over([(6, 8)], fwd("sum", False, b)),
        "linear_cross_entropy_backward": _over([(7, 8)], bwd("mean"))
        + _over([(3, 8)], bwd("none")),
    }


def _optimizer_samples() -> dict[str, list[Sample]]:
    """The fused AdamW step over lists of params (in place; it returns nothing)."""

    def step(amsgrad, dtype=torch.float32):
        def make(p):
            p = p.to(dtype)
            st = [torch.zeros(p.shape, device=DEVICE) for _ in range(3 if amsgrad else 2)]
            q = _randn(5)
            sq = [torch.zeros(5, device=DEVICE) for _ in range(3 if amsgrad else 2)]
            ps, gs = [p, q], [_randn(*p.shape).to(dtype), _randn(5)]
            mx = [st[2], sq[2]] if amsgrad else []
            hyper = (1e-3, 0.9, 0.999, 0.01, 1e-8, False)
            return (ps, gs, [st[0], sq[0]], [st[1], sq[1]], mx, [1.0, 3.0], *hyper)

        return make

    return {
        "adamw": _over([(4, 6)], step(False))
        + _over([(7,)], step(True))
        + _over([(3, 5)], step(False, torch.bfloat16))
    }


def samples() -> dict[str, list[Sample]]:
    """Sample inputs for every op, by its name in the opswap namespace."""
    torch.manual_seed(0)
    out: dict[str, list[Sample]] = {"conv_relu": _conv_samples()}
    for part in (
        _row_norm_samples,
        _group_norm_samples,
        _activation_samples,
        _softmax_samples,
        _reduction_samples,
        _rope_samples,
        _attention_samples,
        _int8_samples,
        _low_bit_samples,
        _conv_algorithm_samples,
        _winograd_samples,
        _sparse_samples,
        _topk_samples,
        _rnn_samples,
        _loss_samples,
        _optimizer_samples,
    ):
        out.update(part())
    return out


# ----------------------------------------------------------------------------- checks


def _hinted(v: Any) -> Any:
    return v.node.hint if isinstance(v, torch.SymInt) else v


def _meta(t: torch.Tensor) -> tuple:
    """(sizes, strides of the dims longer than 1, storage offset, dtype, device)."""
    sizes = [_hinted(s) for s in t.shape]
    strides = [_hinted(st) if s > 1 else None for s, st in zip(sizes, t.stride(), strict=True)]
    return sizes, strides, _hinted(t.storage_offset()), t.dtype, t.device.type


def fake_mismatch(op, sample: Sample, real: Any, symbolic: bool = True) -> str | None:
    """The op's fake kernel run on the sample, with each input's first size symbolic (a
    compile with a dynamic batch; sizes 0 and 1 stay static, as torch specializes them)
    or static: where its outputs (at the sizes' hints) differ from `real`, else None."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())

    def fake(t):
        if not symbolic:
            return mode.from_tensor(t, static_shapes=True)
        dims = [DimDynamic.DYNAMIC] + [DimDynamic.STATIC] * (t.dim() - 1) if t.dim() else []
        ctx = StatelessSymbolicContext(dynamic_sizes=dims)
        return mode.from_tensor(t, symbolic_context=ctx)

    with mode:
        args, kwargs = pytree.tree_map_only(torch.Tensor, fake, (sample.args, sample.kwargs))
        out = op(*args, **kwargs)
    for i, (r, f) in enumerate(zip(pytree.tree_leaves(real), pytree.tree_leaves(out), strict=True)):
        if isinstance(r, torch.Tensor) and _meta(r) != _meta(f):
            how = "with symbolic sizes" if symbolic else "kernel"
            return f"output {i}: real {_meta(r)}, fake {how} {_meta(f)}"
    return None


#: the layouts also run with a symbolic batch size, as a compile that marks the batch
#: dynamic traces the op
SYMBOLIC = ("contiguous", "channels_last", "channels_last_3d", "size-1 dims with stride 7")


def check(name: str, sample: Sample, symbolic: bool = False) -> str | None:
    """Why the op's fake kernel disagrees with its real one on this sample, or None."""
    op = getattr(torch.ops.opswap, name).default
    try:
        torch.library.opcheck(op, sample.args, sample.kwargs, test_utils=("test_faketensor",))
    except Exception as e:  # opcheck's message says what differs
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:400]}"
    if not symbolic:
        return None
    with torch.no_grad():
        real = op(*sample.args, **sample.kwargs)
    return fake_mismatch(op, sample, real)


SAMPLES = samples()
CASES = [(name, s) for name in sorted(SAMPLES) for s in SAMPLES[name]]


def test_every_registered_op_has_samples():
    ops = registered_ops()
    assert len(ops) >= 30, ops  # the enumeration found the namespace
    assert sorted(SAMPLES) == ops, (
        f"ops without samples: {sorted(set(ops) - set(SAMPLES))}; "
        f"samples of no op: {sorted(set(SAMPLES) - set(ops))}"
    )
    assert all(len(v) >= 3 for v in SAMPLES.values())


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_fake_kernel_gives_the_real_sizes_and_strides(name):
    failed = [
        f"{s.label}: {why}"
        for s in SAMPLES[name]
        if (why := check(name, s, symbolic=s.label.endswith(SYMBOLIC))) is not None
    ]
    assert not failed, "\n".join(failed)


def test_the_checks_catch_a_fake_kernel_with_the_wrong_strides():
    """The test above can fail: a fake kernel that returns NCHW for a channels-last input is
    caught, by opcheck and under symbolic sizes."""

    @torch.library.custom_op("opswap_test::nhwc_relu", mutates_args=())
    def nhwc_relu(x: torch.Tensor) -> torch.Tensor:
        return x.relu()  # keeps x's layout

    @nhwc_relu.register_fake
    def _(x):
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)  # always NCHW

    x = torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    sample = Sample("channels_last", (x,))
    with pytest.raises(Exception, match="Stride mismatch"):
        torch.library.opcheck(nhwc_relu, sample.args, test_utils=("test_faketensor",))
    why = fake_mismatch(torch.ops.opswap_test.nhwc_relu.default, sample, x.relu())
    assert why is not None and "symbolic" in why


# ----------------------------------------------------------------------------- Triton


def cuda_kernels() -> dict[str, Callable[..., Any]]:
    """Kernels registered for CUDA only that run their Triton code on CPU tensors under the
    interpreter: the dispatcher never reaches them on a CPU, so the child calls them."""
    from opswap.kernels import weight_only

    return {"wo_linear": weight_only._cuda}


def run_in_child() -> dict[str, list[str]]:
    """Every sample run in this Python (the child): {op: [what differs]}."""
    bad: dict[str, list[str]] = {}
    for name, sample in CASES:
        why = check(name, sample)
        if why is not None:
            bad.setdefault(name, []).append(f"{sample.label}: {why}")
    if DEVICE == "cpu":
        for name, kernel in cuda_kernels().items():
            op = getattr(torch.ops.opswap, name).default
            for sample in SAMPLES[name]:
                with torch.no_grad():
                    real = kernel(*sample.args, **sample.kwargs)
                why = fake_mismatch(op, sample, real, symbolic=False)
                if why is not None:
                    bad.setdefault(name, []).append(f"{sample.label}, CUDA kernel: {why}")
    return bad


def test_triton_kernels_match_their_fake_kernels():
    """The samples again in a child Python where the Triton kernels run (the interpreter on
    CPU, the GPU where there is one): each Triton kernel's output layout is the fake's."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(SRC)}
    if torch.cuda.is_available():
        env.pop("TRITON_INTERPRET")
        env["OPSWAP_FAKE_DEVICE"] = "cuda"
    run = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    bad = json.loads(run.stdout.strip().splitlines()[-1])
    assert not bad, "\n".join(f"{op}: {line}" for op, lines in bad.items() for line in lines)


if __name__ == "__main__":
    print(json.dumps(run_in_child()))
