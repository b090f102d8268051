"""A one-layer LSTM and GRU over a whole sequence as one persistent Triton kernel: the ops
`opswap::lstm_seq` and `opswap::gru_seq`.

    LSTM (gates i, f, g, o, as nn.LSTM orders them):
        a = x_t W_ih^T + b_ih + h W_hh^T + b_hh
        c = sigmoid(a_f) * c + sigmoid(a_i) * tanh(a_g);  h = sigmoid(a_o) * tanh(c)
    GRU (gates r, z, n; the n gate's hidden bias inside r * (...), as nn.GRU has it):
        r, z = sigmoid(x_t W_ir/z^T + b_ir/z + h W_hr/z^T + b_hr/z)
        n = tanh(x_t W_in^T + b_in + r * (h W_hn^T + b_hn));  h = (1 - z) * n + z * h

Two parts. The input projection of every step does not depend on the recurrence, so it is
one GEMM over all T * B rows up front (cuBLAS; T small GEMMs in a cell loop). The
recurrence is one launch: a program owns a tile of BLOCK_B batch rows and loops over the
time steps itself; at each step it multiplies h_{t-1} [BLOCK_B, H] by its slice of W_hh
(`tl.dot`, every gate of a BLOCK_H-wide hidden block at once) and applies the gate
arithmetic in registers, writing h_t into the output sequence and c_t into an fp32 buffer.
A cell loop launches about ten kernels a step (two GEMMs, adds, three sigmoids, two tanh,
muls); here a step costs one pass of the recurrent product, so the per-step cost is the
recurrent GEMM's, not T x 10 launches. Where the whole W_hh slice of a program fits
(4 x BLOCK_H x H values, up to RESIDENT_MAX), it is loaded once before the time loop and
stays in registers, read once per sequence instead of once per step.

More programs per step: with SPLIT hidden blocks taken by SPLIT programs (on a GPU with
enough SMs for every program to be resident at once), the programs of one batch tile meet
at a barrier after every step (an atomic counter each spins on) before reading h_t. The
interpreter runs programs one after another, so there SPLIT is 1 and one program walks
every hidden block of its tile.

fp32 products use `input_precision="ieee"` (no TF32), so float32 results agree with
nn.LSTM to float32 rounding; bf16/fp16 products run on tensor cores with fp32
accumulation, and the gates and c stay fp32 throughout.

CPU (and anything the kernel does not take): `reference`, the same two parts in PyTorch.
"""

from __future__ import annotations

import torch
from torch.library import wrap_triton

from opswap.kernels._rows import KernelError, interpreting, jitted, rn, rn_flag, runs_triton, tl
from opswap.kernels._triton_op import triton_op

#: the names the crossover table (kernels/crossover.py) measures this kernel under
CROSSOVER = ("lstm_seq", "gru_seq")
#: the most W_hh values (4 gates x BLOCK_H x padded H) a program keeps in registers
RESIDENT_MAX = 8192
_GATES = {"lstm": 4, "gru": 3}


def _projection(x: torch.Tensor, w_ih: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Every step's input projection, one GEMM: [.., .., I] -> [.., .., G * H]."""
    return torch.nn.functional.linear(x, w_ih, b)


def reference(
    kind: str,
    x: torch.Tensor,
    h0: torch.Tensor,
    c0: torch.Tensor | None,
    w_ih: torch.Tensor,
    w_hh: torch.Tensor,
    b_ih: torch.Tensor | None,
    b_hh: torch.Tensor | None,
    batch_first: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(out, h_n, c_n) in PyTorch: the projection as one GEMM, then the recurrence step by
    step with the gates of the module docstring (c_n None for a GRU). Run on float64
    inputs it is the tests' ground truth."""
    xs = x.transpose(0, 1) if batch_first else x  # [T, B, I]
    hidden = w_hh.shape[1]
    proj = _projection(xs, w_ih, b_ih)
    h, c = h0, c0
    outs = []
    for t in range(xs.shape[0]):
        rec = torch.nn.functional.linear(h, w_hh, b_hh)
        a = proj[t]
        if kind == "lstm":
            assert c is not None
            i, f, g, o = (a + rec).split(hidden, -1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
        else:
            xr, xz, xn = a.split(hidden, -1)
            hr, hz, hn = rec.split(hidden, -1)
            r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
            n = torch.tanh(xn + r * hn)
            h = (1 - z) * n + z * h
        outs.append(h)
    if not outs:
        out = x.new_empty((x.shape[0], 0, hidden) if batch_first else (0, x.shape[1], hidden))
    else:
        out = torch.stack(outs, 1 if batch_first else 0)
    fresh = torch.contiguous_format  # never h0 / c0 themselves (an empty sequence)
    h_n = h.clone(memory_format=fresh)
    return out, h_n, (c.clone(memory_format=fresh) if c is not None else None)


# ----------------------------------------------------------------------------- the kernel


def _rnn_seq_fn(
    xp_ptr,  # [T, B, G*H] input projections (+ b_ih, and b_hh where it adds), strides sxt, sxb
    w_ptr,  # [G*H, H] W_hh, contiguous
    bn_ptr,  # [H] the GRU's n-gate hidden bias (HAS_BN)
    h0_ptr,  # [B, H] contiguous
    c_ptr,  # [B, H] fp32: c0 in, c_T out (LSTM)
    out_ptr,  # [T, B, H] output sequence, strides sot, sob (unit stride along H)
    sync_ptr,  # [batch tiles] int32 step counters (SPLIT > 1)
    T,
    B,
    H,
    sxt,
    sxb,
    sot,
    sob,
    LSTM: tl.constexpr,
    HAS_BN: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,  # padded H when RESIDENT, else a K tile
    SPLIT: tl.constexpr,
    RESIDENT: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,  # the interpreter: its half-precision dot is not a GPU's
    RN: tl.constexpr,  # the interpreter's bf16 rounding (kernels/_rows.py)
):
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    rows = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)  # batch rows of this tile
    row_ok = rows < B
    ks = tl.arange(0, BLOCK_K)
    n_blocks = tl.cdiv(H, BLOCK_H)
    if RESIDENT:  # one hidden block per program and K in one tile: W_hh slice kept
        cols = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        wm = (ks[:, None] < H) & (cols[None, :] < H)
        wk = ks[:, None] + cols[None, :] * H  # W_hh^T tile [K, BLOCK_H] of gate 0
        w0 = tl.load(w_ptr + wk, mask=wm, other=0.0)
        w1 = tl.load(w_ptr + H * H + wk, mask=wm, other=0.0)
        w2 = tl.load(w_ptr + 2 * H * H + wk, mask=wm, other=0.0)
        if LSTM:
            w3 = tl.load(w_ptr + 3 * H * H + wk, mask=wm, other=0.0)
        if DOT_F32:
            w0, w1, w2 = w0.to(tl.float32), w1.to(tl.float32), w2.to(tl.float32)
            if LSTM:
                w3 = w3.to(tl.float32)
    for t in range(0, T):
        for blk in range(pid_h, n_blocks, SPLIT):
            cols = blk * BLOCK_H + tl.arange(0, BLOCK_H)
            col_ok = cols < H
            m = row_ok[:, None] & col_ok[None, :]
            acc0 = tl.zeros((BLOCK_B, BLOCK_H), dtype=tl.float32)
            acc1 = tl.zeros((BLOCK_B, BLOCK_H), dtype=tl.float32)
            acc2 = tl.zeros((BLOCK_B, BLOCK_H), dtype=tl.float32)
            acc3 = tl.zeros((BLOCK_B, BLOCK_H), dtype=tl.float32)
            # h_{t-1}: h0 at the first step, else the output row written at t - 1
            if t == 0:
                hp = h0_ptr + rows[:, None] * H
            else:
                hp = out_ptr + (t - 1) * sot + rows[:, None] * sob
            if RESIDENT:
                hk = tl.load(hp + ks[None, :], mask=row_ok[:, None] & (ks[None, :] < H), other=0.0)
                hk = hk.to(w0.dtype)
                acc0 = tl.dot(hk, w0, acc0, input_precision=PRECISION)
                acc1 = tl.dot(hk, w1, acc1, input_precision=PRECISION)
                acc2 = tl.dot(hk, w2, acc2, input_precision=PRECISION)
                if LSTM:
                    acc3 = tl.dot(hk, w3, acc3, input_precision=PRECISION)
            else:
                for k0 in range(0, H, BLOCK_K):
                    kk = k0 + ks
                    hm = row_ok[:, None] & (kk[None, :] < H)
                    hk = tl.load(hp + kk[None, :], mask=hm, other=0.0)
                    wm = (kk[:, None] < H) & col_ok[None, :]
                    wk = w_ptr + kk[:, None] + cols[None, :] * H
                    wdt = tl.float32 if DOT_F32 else w_ptr.dtype.element_ty
                    hk = hk.to(wdt)
                    wt = tl.load(wk, mask=wm, other=0.0).to(wdt)
                    acc0 = tl.dot(hk, wt, acc0, input_precision=PRECISION)
                    wt = tl.load(wk + H * H, mask=wm, other=0.0).to(wdt)
                    acc1 = tl.dot(hk, wt, acc1, input_precision=PRECISION)
                    wt = tl.load(wk + 2 * H * H, mask=wm, other=0.0).to(wdt)
                    acc2 = tl.dot(hk, wt, acc2, input_precision=PRECISION)
                    if LSTM:
                        wt = tl.load(wk + 3 * H * H, mask=wm, other=0.0).to(wdt)
                        acc3 = tl.dot(hk, wt, acc3, input_precision=PRECISION)
            xrow = xp_ptr + t * sxt + rows[:, None] * sxb + cols[None, :]
            x0 = tl.load(xrow, mask=m, other=0.0).to(tl.float32)
            x1 = tl.load(xrow + H, mask=m, other=0.0).to(tl.float32)
            x2 = tl.load(xrow + 2 * H, mask=m, other=0.0).to(tl.float32)
            if LSTM:
                x3 = tl.load(xrow + 3 * H, mask=m, other=0.0).to(tl.float32)
                cp = c_ptr + rows[:, None] * H + cols[None, :]
                c = tl.load(cp, mask=m, other=0.0)
                ig = tl.sigmoid(x0 + acc0)
                fg = tl.sigmoid(x1 + acc1)
                gg = 2 * tl.sigmoid(2 * (x2 + acc2)) - 1  # tanh
                og = tl.sigmoid(x3 + acc3)
                c = fg * c + ig * gg
                h = og * (2 * tl.sigmoid(2 * c) - 1)
                tl.store(cp, c, mask=m)
            else:
                if HAS_BN:
                    acc2 += tl.load(bn_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
                hprev = tl.load(hp + cols[None, :], mask=m, other=0.0).to(tl.float32)
                r = tl.sigmoid(x0 + acc0)
                z = tl.sigmoid(x1 + acc1)
                n = 2 * tl.sigmoid(2 * (x2 + r * acc2)) - 1
                h = (1 - z) * n + z * hprev
            op = out_ptr + t * sot + rows[:, None] * sob + cols[None, :]
            tl.store(op, rn(h, RN).to(out_ptr.dtype.element_ty), mask=m)
        # every thread's h_t written before any thread of any program reads it
        tl.debug_barrier()
        if SPLIT > 1:
            tl.atomic_add(sync_ptr + pid_b, 1, sem="acq_rel")
            want = (t + 1) * SPLIT
            seen = tl.atomic_add(sync_ptr + pid_b, 0, sem="acquire")
            while seen < want:
                seen = tl.atomic_add(sync_ptr + pid_b, 0, sem="acquire")
            tl.debug_barrier()


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _settings(
    batch: int, hidden: int, gates: int, device: torch.device, resident: bool | None = None
) -> dict:
    """Tile sizes, how many programs share a batch tile's hidden blocks, and whether each
    keeps its W_hh slice resident. `resident` forces the choice (tests): True makes one
    program take every hidden block of its tile at once, False streams W_hh."""
    block_b = min(64, max(16, _pow2(batch)))
    kpad = max(16, _pow2(hidden))
    block_h = kpad if resident else (16 if hidden <= 64 else 32)
    blocks = -(-hidden // block_h)
    tiles = -(-batch // block_b)
    split = 1
    if device.type == "cuda" and not resident:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        split = max(1, min(blocks, sms // tiles))
    keep = split == blocks and gates * block_h * kpad <= RESIDENT_MAX
    keep = keep if resident is None else bool(resident)
    return dict(
        BLOCK_B=block_b,
        BLOCK_H=block_h,
        BLOCK_K=kpad if keep else min(64, kpad),
        SPLIT=split,
        RESIDENT=keep,
        grid=(tiles, split),
    )


def triton_forward(
    kind: str,
    x: torch.Tensor,
    h0: torch.Tensor,
    c0: torch.Tensor | None,
    w_ih: torch.Tensor,
    w_hh: torch.Tensor,
    b_ih: torch.Tensor | None,
    b_hh: torch.Tensor | None,
    batch_first: bool,
    resident: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(out, h_n, c_n) by the projection GEMM and `_rnn_seq_fn`; `resident` forces the
    W_hh-in-registers choice (tests)."""
    hidden = w_hh.shape[1]
    lstm = kind == "lstm"
    bias = b_ih
    if b_hh is not None:
        if lstm:
            bias = b_hh if bias is None else bias + b_hh
        else:  # r and z take b_hh with the projection; n's stays inside r * (...)
            zero = torch.zeros_like(b_hh[2 * hidden :])
            folded = torch.cat([b_hh[: 2 * hidden], zero])
            bias = folded if bias is None else bias + folded
    proj = _projection(x, w_ih, bias)  # [B, T, G*H] or [T, B, G*H]
    proj = proj if proj.stride(-1) == 1 else proj.contiguous()  # the kernel's unit stride
    steps, batch = (x.shape[1], x.shape[0]) if batch_first else (x.shape[0], x.shape[1])
    out = x.new_empty((batch, steps, hidden) if batch_first else (steps, batch, hidden))
    c = (c0 if c0 is not None else h0).float().contiguous().clone()
    h0c = h0.to(x.dtype).contiguous()
    if steps == 0 or batch == 0:
        return (
            out,
            h0.clone(memory_format=torch.contiguous_format),
            (c.to(h0.dtype) if lstm else None),
        )
    s = _settings(batch, hidden, _GATES[kind], x.device, resident)
    grid = s.pop("grid")
    sync = torch.zeros(grid[0], dtype=torch.int32, device=x.device)
    pt, pb = (proj.stride(1), proj.stride(0)) if batch_first else (proj.stride(0), proj.stride(1))
    ot, ob = (out.stride(1), out.stride(0)) if batch_first else (out.stride(0), out.stride(1))
    bn = b_hh[2 * hidden :] if (b_hh is not None and not lstm) else h0c
    wrap_triton(jitted(_rnn_seq_fn))[grid](
        proj,
        w_hh.contiguous(),
        bn,
        h0c,
        c,
        out,
        sync,
        steps,
        batch,
        hidden,
        pt,
        pb,
        ot,
        ob,
        LSTM=lstm,
        HAS_BN=b_hh is not None and not lstm,
        PRECISION="ieee" if x.dtype == torch.float32 or interpreting() else "tf32",
        DOT_F32=interpreting(),
        RN=rn_flag(x.dtype),
        num_warps=4,
        **s,
    )
    last = out[:, -1] if batch_first else out[-1]
    # h_T as a tensor of its own: a view of `out` would alias another output of the op
    return (
        out,
        last.clone(memory_format=torch.contiguous_format),
        (c.to(h0.dtype) if lstm else None),
    )


def _check(
    kind: str,
    x: torch.Tensor,
    h0: torch.Tensor,
    w_ih: torch.Tensor,
    w_hh: torch.Tensor,
    batch_first: bool,
) -> None:
    gates, hidden = _GATES[kind], w_hh.shape[-1]
    if x.dim() != 3 or h0.dim() != 2 or w_hh.shape != (gates * hidden, hidden):
        raise KernelError(
            f"opswap::{kind}_seq takes x [B, T, I] or [T, B, I], h0 [B, H] and W_hh "
            f"[{gates}H, H]; got x {list(x.shape)}, h0 {list(h0.shape)}, W_hh {list(w_hh.shape)}."
        )
    batch = x.shape[0] if batch_first else x.shape[1]
    if h0.shape[0] != batch or h0.shape[1] != hidden:
        raise KernelError(
            f"opswap::{kind}_seq: the initial state is {list(h0.shape)}, expected [batch, "
            f"{hidden}] with the batch of x {list(x.shape)}."
        )
    if w_ih.shape != (gates * hidden, x.shape[-1]):
        raise KernelError(
            f"opswap::{kind}_seq: W_ih is {list(w_ih.shape)}, expected "
            f"[{gates * hidden}, {x.shape[-1]}] for inputs of {x.shape[-1]} features."
        )


def _state(
    s: torch.Tensor | None, x: torch.Tensor, w_hh: torch.Tensor, batch_first: bool
) -> torch.Tensor:
    """An initial state, zeros [B, H] where none is given."""
    if s is not None:
        return s
    batch = x.shape[0] if batch_first else x.shape[1]
    return x.new_zeros((batch, w_hh.shape[-1]))


def _kernel_takes(x: torch.Tensor) -> bool:
    return runs_triton(x) and x.dtype in (torch.float32, torch.bfloat16, torch.float16)


#: W_ih, W_hh, b_ih, b_hh
_Weights = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def _run(
    kind: str,
    x: torch.Tensor,
    h0: torch.Tensor | None,
    c0: torch.Tensor | None,
    w: _Weights,
    batch_first: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Either op: zero states where none is given, the shape checks, then the kernel where
    it takes x, else the reference; the output sequence contiguous."""
    w_hh = w[1]
    h0 = _state(h0, x, w_hh, batch_first)
    c0 = _state(c0, x, w_hh, batch_first) if kind == "lstm" else None
    _check(kind, x, h0, w[0], w_hh, batch_first)
    if _kernel_takes(x):
        out, h, c = triton_forward(kind, x, h0, c0, *w, batch_first)
    else:
        out, h, c = reference(kind, x, h0, c0, *w, batch_first)
    return out.contiguous(), h, c


# ----------------------------------------------------------------------------- the ops


@triton_op("opswap::lstm_seq", mutates_args=())
def lstm_seq(
    x: torch.Tensor,
    h0: torch.Tensor | None,
    c0: torch.Tensor | None,
    w_ih: torch.Tensor,
    w_hh: torch.Tensor,
    b_ih: torch.Tensor | None,
    b_hh: torch.Tensor | None,
    batch_first: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One LSTM layer over x ([B, T, I] when batch_first, else [T, B, I]) from (h0, c0)
    [B, H] (zeros where None): (the output sequence in x's layout, h_T, c_T)."""
    out, h, c = _run("lstm", x, h0, c0, (w_ih, w_hh, b_ih, b_hh), batch_first)
    assert c is not None
    return out, h, c


@triton_op("opswap::gru_seq", mutates_args=())
def gru_seq(
    x: torch.Tensor,
    h0: torch.Tensor | None,
    w_ih: torch.Tensor,
    w_hh: torch.Tensor,
    b_ih: torch.Tensor | None,
    b_hh: torch.Tensor | None,
    batch_first: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One GRU layer over x ([B, T, I] when batch_first, else [T, B, I]) from h0 [B, H]
    (zeros where None): (the output sequence in x's layout, h_T)."""
    out, h, _ = _run("gru", x, h0, None, (w_ih, w_hh, b_ih, b_hh), batch_first)
    return out, h
