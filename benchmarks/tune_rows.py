"""Launch choices and candidate rewrites of the row kernels that trail a peer on the H200,
timed side by side in one run, to decide what the package's kernels should become.

    PYTHONPATH=src python3 benchmarks/tune_rows.py --out DIR      (gpu_suite.py --only tune)
    PYTHONPATH=src python3 benchmarks/tune_rows.py --smoke         (CPU, interpreter: checks)

Each case times the package's kernel as it launches today, the same kernel at other
block sizes and warp counts, a candidate kernel written differently (below), and the
peers (torch.compile of the eager formula, Liger-Kernel where it has the op), all as
CUDA-graph replays (GPU time, triton.testing.do_bench_cudagraph, median), bf16, forward.
Effective TB/s counts the bytes the op must read and write. The candidates:

- swiglu `flat`: one program per BLOCK consecutive elements of the whole [M, H] output
  (g and u contiguous), no row/column split, so no tail block per row is half empty;
- rope `flat`: Inductor's layout: one program per BLOCK consecutive output elements, each
  loading its element, its rotation partner (the same 256-byte row: an L1 hit) and its
  cos/sin (L2), instead of a [positions, D/2] tile per head;
- group_norm `2d`: the group as a [channels, positions] tile, so that the weight and bias
  are one load per channel, not a gather with an integer division per element;
- var `chan`: the package's var (each tile's mean and squared deviations merged into the
  row's once per tile, Chan et al.) at other tile sizes.

Writes DIR/tune_rows_h200.json (device, versions, date, every figure).
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # the interpreter is chosen when Triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _results import card  # noqa: E402
from bench_norm_kernels import copy_gbps, env, graph_ms  # noqa: E402

from opswap.kernels import group_norm as GN  # noqa: E402
from opswap.kernels import reduction as RD  # noqa: E402
from opswap.kernels import rope as RP  # noqa: E402
from opswap.kernels import softmax as SM  # noqa: E402
from opswap.kernels import swiglu as SW  # noqa: E402
from opswap.kernels._rows import jitted  # noqa: E402

# ----------------------------------------------------------------------------- candidates


@triton.jit
def _glu_flat(g_ptr, u_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    g = tl.load(g_ptr + i, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + i, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + i, (g * tl.sigmoid(g) * u).to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rope_flat(
    q_ptr, k_ptr, c_ptr, s_ptr, qo_ptr, ko_ptr, NQ, NK, HQ, HK, S, scb, scs,
    D: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    nqb = tl.cdiv(NQ, BLOCK)
    if pid < nqb:
        src, dst, H, n, e0 = q_ptr, qo_ptr, HQ, NQ, pid * BLOCK
    else:
        src, dst, H, n, e0 = k_ptr, ko_ptr, HK, NK, (pid - nqb) * BLOCK
    e = e0 + tl.arange(0, BLOCK)
    ok = e < n
    i = e % D
    r = e // D
    s = r % S
    b = r // (H * S)
    first = i < D // 2
    p = tl.where(first, e + D // 2, e - D // 2)
    x = tl.load(src + e, mask=ok, other=0.0).to(tl.float32)
    xp = tl.load(src + p, mask=ok, other=0.0).to(tl.float32)
    t = b * scb + s * scs + i
    c = tl.load(c_ptr + t, mask=ok, other=0.0).to(tl.float32)
    sn = tl.load(s_ptr + t, mask=ok, other=0.0).to(tl.float32)
    y = x * c + tl.where(first, -xp, xp) * sn
    tl.store(dst + e, y.to(dst.dtype.element_ty), mask=ok)


@triton.jit
def _rope_heads(
    q_ptr, k_ptr, c_ptr, s_ptr, qo_ptr, ko_ptr, HQ, HK, S, scb, scs,
    D: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    # program (b, block of positions): cos and sin of those positions read once, then
    # every head of q and of k turned with them (the tile kernel reads them once a head)
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
    j = tl.arange(0, D // 2)[None, :]
    ok = (s < S)[:, None]
    t = (b * scb + s * scs)[:, None]
    c1 = tl.load(c_ptr + t + j, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(c_ptr + t + j + D // 2, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(s_ptr + t + j, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(s_ptr + t + j + D // 2, mask=ok, other=0.0).to(tl.float32)
    for h in range(HQ + HK):
        if h < HQ:
            row = ((b * HQ + h) * S + s)[:, None] * D
            src, dst = q_ptr + row, qo_ptr + row
        else:
            row = ((b * HK + h - HQ) * S + s)[:, None] * D
            src, dst = k_ptr + row, ko_ptr + row
        x1 = tl.load(src + j, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + j + D // 2, mask=ok, other=0.0).to(tl.float32)
        tl.store(dst + j, (x1 * c1 - x2 * s1).to(dst.dtype.element_ty), mask=ok)
        tl.store(dst + j + D // 2, (x2 * c2 + x1 * s2).to(dst.dtype.element_ty), mask=ok)


@triton.jit
def _gn_2d(
    x_ptr, w_ptr, b_ptr, y_ptr, L, S, CPG, G, eps, BC: tl.constexpr, BS: tl.constexpr
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    base = pid * L
    ch = (pid % G) * CPG + tl.arange(0, BC)
    c = tl.arange(0, BC)
    sp = tl.arange(0, BS)
    ok = (c < CPG)[:, None] & (sp < S)[None, :]
    off = base + c[:, None] * S + sp[None, :]
    v = tl.load(x_ptr + off, mask=ok, other=0.0).to(tl.float32)
    mean = tl.sum(tl.sum(v, 1), 0) / L
    d = tl.where(ok, v - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(tl.sum(d * d, 1), 0) / L + eps)
    w = tl.load(w_ptr + ch, mask=c < CPG, other=0.0).to(tl.float32) * rstd
    bb = tl.load(b_ptr + ch, mask=c < CPG, other=0.0).to(tl.float32)
    tl.store(y_ptr + off, (d * w[:, None] + bb[:, None]).to(y_ptr.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------- timing


def _peer(fn, smoke):
    return fn if smoke else torch.compile(fn)


def _liger(name):
    try:
        if name == "swiglu":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction

            return LigerSiLUMulFunction.apply
        if name == "softmax":
            from liger_kernel.ops.softmax import LigerSoftmaxFunction

            return LigerSoftmaxFunction.apply
        if name == "rope":
            from liger_kernel.ops.rope import LigerRopeFunction

            return LigerRopeFunction.apply
        if name == "group_norm":
            from liger_kernel.ops.group_norm import LigerGroupNormFunction

            return lambda x, w, b: LigerGroupNormFunction.apply(x, w, b, x.shape[1], 32, 1e-6)
    except Exception:
        return None
    return None


def case(name, nbytes, fns, ref, smoke, out):
    """Times each of `fns` (name -> zero-argument callable) after checking it against
    `ref` (a tensor, or a tuple of them); appends one row per variant to `out`."""
    refs = ref if isinstance(ref, tuple) else (ref,)
    for label, fn in fns.items():
        r = {"case": name, "variant": label, "bytes": nbytes}
        try:
            got = fn()
            gots = got if isinstance(got, tuple) else (got,)
            r["rel_err"] = max(
                float((g.float() - e.float()).norm() / e.float().norm())
                for g, e in zip(gots, refs, strict=True)
            )
            ms = graph_ms(fn, (), "cpu" if smoke else "cuda", smoke)
            r["graph_ms"] = ms
            r["tb_s"] = nbytes / (ms * 1e-3) / 1e12 if ms else None
        except Exception as e:
            r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            if smoke:
                traceback.print_exc()
        print(json.dumps(r), flush=True)
        out.append(r)


def swiglu(dev, smoke, out):
    m, h = (3, 48) if smoke else (32768, 5632)
    g = torch.randn(m, h, device=dev).bfloat16()
    u = torch.randn(m, h, device=dev).bfloat16()
    ref = (F.silu(g.float()) * u.float()).bfloat16()
    fns = {"today": lambda: SW.glu(g, u, "silu")}
    for block, warps in ((1024, 8), (2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16)):

        def f(block=block, warps=warps):
            y = torch.empty_like(g)
            jitted(SW._glu_fwd_fn)[(m, triton.cdiv(h, block))](
                g, u, y, h, h, h, ACT=0, BLOCK=block, RN=False, FLAT=False, num_warps=warps
            )
            return y

        fns[f"rowtile {block} w{warps}"] = f
    for block, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 8)):

        def f(block=block, warps=warps):
            y = torch.empty_like(g)
            _glu_flat[(triton.cdiv(m * h, block),)](g, u, y, m * h, BLOCK=block, num_warps=warps)
            return y

        fns[f"flat {block} w{warps}"] = f

        def pk(block=block, warps=warps):  # the package's flat path
            old = (SW.FLAT, SW.FLAT_BLOCK, SW.FLAT_WARPS)
            SW.FLAT, SW.FLAT_BLOCK, SW.FLAT_WARPS = True, block, warps
            try:
                return SW.glu(g, u, "silu")
            finally:
                SW.FLAT, SW.FLAT_BLOCK, SW.FLAT_WARPS = old

        fns[f"package flat {block} w{warps}"] = pk
    fns["compile"] = (lambda c: lambda: c(g, u))(_peer(lambda a, b: F.silu(a) * b, smoke))
    lg = _liger("swiglu")
    if lg and not smoke:
        fns["liger"] = lambda: lg(g, u)
    case("swiglu 32768x5632", 3 * m * h * 2, fns, ref, smoke, out)


def softmax(dev, smoke, out):
    for m, n in ((3, 200),) if smoke else ((4096, 32768), (8192, 16384)):
        _softmax_case(m, n, dev, smoke, out)


def _softmax_case(m, n, dev, smoke, out):
    x = torch.randn(m, n, device=dev).bfloat16()
    ref = torch.softmax(x.float(), -1).bfloat16()
    fns = {"today": lambda: SM.softmax(x)}
    choices = [(1 << (n - 1).bit_length(), False, w) for w in (8, 16, 32)]
    choices += [(t, True, w) for t in (2048, 4096, 8192, 16384) for w in (4, 8, 16)]
    for block, online, warps in choices:
        if smoke:
            block = min(block, 256)

        def f(block=block, online=online, warps=warps):
            y = torch.empty_like(x)
            jitted(SM._softmax_fwd_fn)[(m,)](
                x, x, y, n, n, 0, 0, 0, 0, 1, 1, 1.0,
                LOG=False, MASK=0, ONLINE=online, BLOCK=block, RN=False, num_warps=warps,
            )  # fmt: skip
            return y

        fns[f"{'online' if online else 'single'} {block} w{warps}"] = f
    compiled = _peer(lambda a: torch.softmax(a, -1), smoke)
    fns["compile"] = lambda: compiled(x)
    lg = _liger("softmax")
    if lg and not smoke:
        fns["liger"] = lambda: lg(x)
    case(f"softmax {m}x{n}", 2 * m * n * 2, fns, ref, smoke, out)


def softmax_backward(dev, smoke, out):
    for m, n in ((3, 200),) if smoke else ((4096, 32768), (8192, 16384)):
        _softmax_backward_case(m, n, dev, smoke, out)


def _softmax_backward_case(m, n, dev, smoke, out):
    """dx = y * (dy - sum(y * dy)): the row held in one block (dy and y: twice the
    forward's registers) against the tile walk (two reads of each) today's limit sends
    rows wider than SINGLE_MAX_BACKWARD to."""
    y = torch.softmax(torch.randn(m, n, device=dev), -1).bfloat16()
    dy = torch.randn(m, n, device=dev).bfloat16()
    yf, dyf = y.float(), dy.float()
    ref = (yf * (dyf - (yf * dyf).sum(-1, keepdim=True))).bfloat16()
    fns = {"today": lambda: SM.triton_backward(dy, y, False, 1.0, torch.bfloat16)}
    choices = [(1 << (n - 1).bit_length(), False, w) for w in (16, 32)]
    choices += [(t, True, w) for t in (4096, 8192) for w in (8, 16)]
    for block, online, warps in choices:
        if smoke:
            block = min(block, 256)

        def f(block=block, online=online, warps=warps):
            dx = torch.empty_like(y)
            jitted(SM._softmax_bwd_fn)[(m,)](
                dy, y, dx, n, 1.0,
                LOG=False, ONLINE=online, BLOCK=block, RN=False, num_warps=warps,
            )  # fmt: skip
            return dx

        fns[f"{'tiles' if online else 'single'} {block} w{warps}"] = f
    compiled = _peer(lambda a, b: a * (b - (a * b).sum(-1, keepdim=True)), smoke)
    fns["compile"] = lambda: compiled(y, dy)
    if not smoke:
        try:
            from liger_kernel.ops.softmax import _softmax_backward
            from liger_kernel.ops.utils import calculate_settings

            block, warps = calculate_settings(n)
            fns["liger"] = lambda: _softmax_backward(dy, y, block, warps, False)
        except Exception as e:  # the peer missing must not lose our figures
            out.append({"case": f"softmax backward {m}x{n}", "variant": "liger", "error": str(e)})
    case(f"softmax backward {m}x{n}", 3 * m * n * 2, fns, ref, smoke, out)


def rope(dev, smoke, out):
    b, h, s, d = (1, 2, 5, 16) if smoke else (8, 32, 2048, 128)
    q = torch.randn(b, h, s, d, device=dev).bfloat16()
    k = torch.randn(b, h, s, d, device=dev).bfloat16()
    f_ = torch.arange(s, device=dev)[:, None] / (10000 ** (torch.arange(0, d, 2, device=dev) / d))
    e = torch.cat((f_, f_), -1)[None, None].expand(b, 1, s, d).bfloat16().contiguous()
    cos, sin = e.cos(), e.sin()
    ref = RP.reference(q, k, cos, sin)
    fns = {"today": lambda: RP.rope(q, k, cos, sin, None, False)}
    ct = RP._table_strides(cos, None, b, s)
    for bs in (8, 16, 32, 64):
        for warps in (2, 4, 8):

            def f(bs=bs, warps=warps):
                qo, ko = torch.empty_like(q), torch.empty_like(k)
                jitted(RP._rope_fn)[(b * 2 * h, triton.cdiv(s, bs))](
                    q, k, ct[0], sin[:, 0], q, qo, ko, h, h, s, d,
                    *q.stride()[:3], *k.stride()[:3], ct[1], ct[2], 0, 0,
                    INTERLEAVED=False, BACKWARD=False, HAS_POS=False, BLOCK_S=bs,
                    BLOCK_H=d // 2, RN=False, num_warps=warps,
                )  # fmt: skip
                return qo, ko

            fns[f"tile s{bs} w{warps}"] = f
    for bs in (4, 8, 16, 32):
        for warps in (2, 4, 8):

            def f(bs=bs, warps=warps):
                qo, ko = torch.empty_like(q), torch.empty_like(k)
                _rope_heads[(b, triton.cdiv(s, bs))](
                    q, k, ct[0], sin[:, 0], qo, ko, h, h, s, ct[1], ct[2],
                    D=d, BLOCK_S=bs, num_warps=warps,
                )  # fmt: skip
                return qo, ko

            fns[f"heads s{bs} w{warps}"] = f
    for block, warps in ((512, 4), (1024, 4), (1024, 8), (2048, 8), (4096, 8)):

        def f(block=block, warps=warps):
            qo, ko = torch.empty_like(q), torch.empty_like(k)
            n = q.numel()
            _rope_flat[(2 * triton.cdiv(n, block),)](
                q, k, ct[0], sin[:, 0], qo, ko, n, n, h, h, s, ct[1], ct[2],
                D=d, BLOCK=block, num_warps=warps,
            )  # fmt: skip
            return qo, ko

        fns[f"flat {block} w{warps}"] = f

    def hf(q, k, c, s_):
        return q * c + RP.rotate(q, False) * s_, k * c + RP.rotate(k, False) * s_

    fns["compile"] = (lambda c: lambda: c(q, k, cos, sin))(_peer(hf, smoke))
    lg = _liger("rope")
    if lg and not smoke:
        fns["liger"] = lambda: lg(q, k, cos, sin)
    nbytes = 4 * q.numel() * 2 + 2 * cos.numel() * 2
    case("rope 8x32x2048x128", nbytes, fns, ref, smoke, out)


def group_norm(dev, smoke, out):
    n, c, hw, g = (2, 8, 12, 2) if smoke else (1024, 128, 1024, 32)
    x = torch.randn(n, c, hw, device=dev).bfloat16()
    w = torch.randn(c, device=dev).bfloat16() * 0.1 + 1
    bb = torch.randn(c, device=dev).bfloat16() * 0.1
    ref = F.group_norm(x.float(), g, w.float(), bb.float(), 1e-6).bfloat16()
    cpg, length = c // g, c // g * hw
    fns = {"today": lambda: GN.group_norm(x, g, w, bb, 1e-6)}
    block = 1 << (length - 1).bit_length()
    for warps in (4, 8, 16, 32):

        def f(warps=warps):
            y = torch.empty_like(x)
            jitted(GN._gn_fwd_fn)[(n * g,)](
                x, w, bb, y, length, hw, cpg, g, 1e-6,
                HAS_W=True, HAS_B=True, BLOCK=block, ONE_PASS=True, RN=False, num_warps=warps,
            )  # fmt: skip
            return y

        fns[f"one-pass w{warps}"] = f
    bc, bs = 1 << (cpg - 1).bit_length(), 1 << (hw - 1).bit_length()
    for warps in (4, 8, 16):

        def f(warps=warps):
            y = torch.empty_like(x)
            _gn_2d[(n * g,)](x, w, bb, y, length, hw, cpg, g, 1e-6, BC=bc, BS=bs, num_warps=warps)
            return y

        fns[f"2d w{warps}"] = f
    fns["compile"] = (lambda cc: lambda: cc(x, w, bb))(
        _peer(lambda a, ww, b2: F.group_norm(a, g, ww, b2, 1e-6), smoke)
    )
    lg = _liger("group_norm")
    if lg and not smoke:
        fns["liger"] = lambda: lg(x, w, bb)
    case("group_norm 32768 groups of 4096", 2 * x.numel() * 2, fns, ref, smoke, out)


def var(dev, smoke, out):
    m, n = (3, 300) if smoke else (32768, 4096)
    x = torch.randn(m, n, device=dev).bfloat16() * 3 + 1
    ref = x.float().var(-1).bfloat16()
    fns = {"today": lambda: RD.row_reduce(x, "var", True, False)}
    for block, warps in ((1024, 4), (2048, 8), (4096, 8), (4096, 16)):
        if smoke:
            block = 128

        def f(block=block, warps=warps):
            y = torch.empty(m, device=x.device, dtype=x.dtype)
            jitted(RD._reduce_fn)[(m,)](
                x, x, y, n, n, n, 1.0, OP=3, BLOCK=block, RN=False, num_warps=warps
            )
            return y

        fns[f"chan {block} w{warps}"] = f
    fns["compile"] = (lambda c: lambda: c(x))(_peer(lambda a: a.var(-1), smoke))
    case("var 32768x4096", m * n * 2 + m * 2, fns, ref, smoke, out)


CASES = {
    "swiglu": swiglu,
    "softmax": softmax,
    "softmax_backward": softmax_backward,
    "rope": rope,
    "group_norm": group_norm,
    "var": var,
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "benchmarks/results"))
    )
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args()
    dev = "cpu" if args.smoke else "cuda"
    res: dict = {**env(dev), "copy_gbps": copy_gbps(dev, args.smoke), "rows": []}
    for name in args.cases.split(","):
        try:
            CASES[name](dev, args.smoke, res["rows"])
        except Exception:
            res["rows"].append({"case": name, "error": traceback.format_exc()[-1500:]})
            print(res["rows"][-1]["error"], flush=True)
        if dev == "cuda":
            torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"tune_rows_{'smoke' if args.smoke else card()}.json"
    path.write_text(json.dumps(res, indent=1) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
