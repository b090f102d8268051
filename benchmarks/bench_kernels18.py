"""opswap's Triton softmax / log_softmax / masked softmax, row reductions (sum, var, sum of
squares), RoPE on q and k, and the CUDA C++ bias + GELU, against eager PyTorch,
torch.compile and Liger-Kernel where it has the op, on a GPU (the lead runs it on the
H200; about 4 minutes).

    PYTHONPATH=src python3 benchmarks/bench_kernels18.py --out DIR [--update-crossover]
    PYTHONPATH=src python3 benchmarks/bench_kernels18.py --smoke   (CPU, interpreter)

Cases (bfloat16): softmax [32768, 4096] and [4096, 32768] (long rows: the online path),
log_softmax [32768, 4096], masked softmax of scores [8, 16, 2048, 2048] with scale and an
additive [8, 1, 2048, 2048] mask (HF's eager attention), sum and var of [32768, 4096],
sum of squares of [32768, 4096], RoPE on q, k [8, 32, 2048, 128] with cos/sin [8, 1,
2048, 128], bias + GELU [8192, 4096]. Forward alone and forward + backward (var:
forward only). Timed with triton.testing.do_bench (median, L2 flushed between runs);
effective GB/s counts the bytes the op must move (`traffic`), next to a device copy's
GB/s measured in the same run. Writes DIR/kernels18_h200.json with the device, versions
and date; `--update-crossover` rewrites src/opswap/kernels/crossover.json from it.
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # the interpreter is chosen when Triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_norm_kernels import _first, copy_gbps, env, time_row  # noqa: E402

from opswap.kernels import bias_gelu_cuda as BG  # noqa: E402
from opswap.kernels import reduction as RD  # noqa: E402
from opswap.kernels import rope as RP  # noqa: E402
from opswap.kernels import softmax as SM  # noqa: E402


def _hf_rope(q, k, cos, sin):
    return q * cos + RP.rotate(q, False) * sin, k * cos + RP.rotate(k, False) * sin


#: name -> (crossover kernel, ours, eager, has backward)
CASES = {
    "softmax": ("softmax", lambda x: SM.softmax(x), lambda x: torch.softmax(x, -1), True),
    "log_softmax": (
        "log_softmax",
        lambda x: SM.log_softmax(x),
        lambda x: torch.log_softmax(x, -1),
        True,
    ),
    "masked_softmax": (
        "masked_softmax",
        lambda x, m: SM.masked_softmax(x, m, 0.088),
        lambda x, m: torch.softmax(x * 0.088 + m, -1),
        True,
    ),
    "sum": ("row_sum", lambda x: RD.row_reduce(x, "sum", True, False), lambda x: x.sum(-1), True),
    "var": ("row_var", lambda x: RD.row_reduce(x, "var", True, False), lambda x: x.var(-1), False),
    "sumsq": (
        "row_sumsq",
        lambda x: RD.row_reduce(x, "sumsq", True, False),
        lambda x: x.pow(2).sum(-1),
        True,
    ),
    "rope": ("rope", lambda q, k, c, s: RP.rope(q, k, c, s, None, False), _hf_rope, True),
    "bias_gelu_cuda": (
        "bias_gelu_cuda",
        lambda x, b: BG.bias_gelu_cuda(x, b),
        lambda x, b: F.gelu(x + b),
        True,
    ),
}


def shapes(smoke: bool) -> list[tuple[str, tuple]]:
    if smoke:
        return [
            ("softmax", (3, 50)),
            ("softmax", (2, 9000)),
            ("log_softmax", (3, 50)),
            ("masked_softmax", (1, 2, 8, 8)),
            ("sum", (3, 50)),
            ("var", (3, 50)),
            ("sumsq", (3, 50)),
            ("rope", (1, 2, 5, 16)),
            ("bias_gelu_cuda", (3, 50)),
        ]
    return [
        ("softmax", (32768, 4096)),
        ("softmax", (4096, 32768)),
        ("log_softmax", (32768, 4096)),
        ("masked_softmax", (8, 16, 2048, 2048)),
        ("sum", (32768, 4096)),
        ("var", (32768, 4096)),
        ("sumsq", (32768, 4096)),
        ("rope", (8, 32, 2048, 128)),
        ("bias_gelu_cuda", (8192, 4096)),
    ]


def inputs(name, shape, dtype, device, grad):
    g = torch.Generator(device=device).manual_seed(sum(shape))

    def t(*s, leaf=True):
        v = torch.randn(*s, generator=g, device=device).to(dtype)
        return v.requires_grad_(grad and leaf)

    if name == "masked_softmax":
        b, h, s, n = shape
        return (t(*shape), t(b, 1, s, n, leaf=False))
    if name == "rope":
        b, h, s, d = shape
        f = torch.arange(s, device=device)[:, None] / (
            10000 ** (torch.arange(0, d, 2, device=device) / d)
        )
        e = torch.cat((f, f), -1)[None, None].expand(b, 1, s, d).to(dtype).contiguous()
        return (t(*shape), t(*shape), e.cos(), e.sin())
    if name == "bias_gelu_cuda":
        return (t(*shape), t(shape[-1]))
    return (t(*shape),)


def traffic(name, shape, elt, backward) -> tuple[int, int, int]:
    """(bytes, hidden, rows): what the op must read and write, the crossover's keys."""
    n = 1
    for s in shape:
        n *= s
    hidden, rows = shape[-1], n // shape[-1]
    if name in ("softmax", "log_softmax"):
        b = 2 * n * elt + (3 * n * elt if backward else 0)  # y, dy in, dx out
    elif name == "masked_softmax":
        b = 2 * n * elt + n // shape[1] * elt + (3 * n * elt if backward else 0)
    elif name in ("sum", "var", "sumsq"):
        b = n * elt + rows * elt + ((n * elt if name == "sum" else 2 * n * elt) if backward else 0)
    elif name == "rope":
        b = 2 * (2 * n * elt) + 2 * (n // shape[1]) * elt  # q, k in and out; cos, sin
        b += 2 * (2 * n * elt) if backward else 0
        rows = 2 * rows
    else:  # bias_gelu
        b = 2 * n * elt + (3 * n * elt if backward else 0)
    return b, hidden, rows


def liger(name):
    try:
        if name == "rope":
            from liger_kernel.ops.rope import LigerRopeFunction

            return lambda q, k, c, s: LigerRopeFunction.apply(q, k, c, s), ""
        if name == "softmax":
            from liger_kernel.ops.softmax import LigerSoftmaxFunction

            return lambda x: LigerSoftmaxFunction.apply(x), ""
    except Exception as e:
        return None, f"Liger-Kernel not used for {name}: {type(e).__name__}: {e}"
    return None, ""


def run(
    smoke: bool = False, kernels: tuple[str, ...] = tuple(CASES), widths: tuple[int, ...] = ()
) -> dict:
    """Every case at its shapes, or, with `widths`, the row cases (softmax, log_softmax,
    sum, var, sumsq) at 4096 rows of each width."""
    device = "cpu" if smoke else "cuda"
    unknown = set(kernels) - set(CASES)
    if unknown:
        raise SystemExit(f"unknown cases {sorted(unknown)}; pick from {', '.join(CASES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here: run with --smoke for the CPU check")
    dtype = torch.bfloat16
    elt = 2
    res: dict = {**env(device), "notes": [], "rows": []}
    res["copy_gbps"] = copy_gbps(device, smoke)
    if smoke:
        res["notes"].append("smoke: eager stands in for torch.compile (no GPU)")
    if not smoke and BG.unavailable():
        res["notes"].append(f"bias_gelu_cuda: {BG.unavailable()}")
    todo = shapes(smoke)
    if widths:
        rowwise = ("softmax", "log_softmax", "sum", "var", "sumsq")
        todo = [
            (k, (3 if smoke else 4096, min(w, 96) if smoke else w)) for k in rowwise for w in widths
        ]
    for name, shape in todo:
        if name not in kernels:
            continue
        kernel, ours, eager, has_bwd = CASES[name]
        peer, why = liger(name) if not smoke else (None, "")
        if why and why not in res["notes"]:
            res["notes"].append(why)
        compiled = eager if smoke else torch.compile(eager)
        for p, backward in (("forward", False), ("forward+backward", True)):
            if backward and not has_bwd:
                continue
            try:
                args = inputs(name, shape, dtype, device, backward)
                nbytes, hidden, rows = traffic(name, shape, elt, backward)
                r = {"kernel": kernel, "case": name, "shape": list(shape), "dtype": "bfloat16"}
                r.update({"rows": rows, "hidden": hidden, "pass": p, "bytes": nbytes})
                with torch.no_grad():
                    ref = _first(eager(*args)).float()
                    got = _first(ours(*args)).float()
                    r["rel_l2_ours_vs_eager"] = float((got - ref).norm() / ref.norm())
                fns = {"ours": ours, "eager": eager, "compile": compiled}
                if peer is not None:
                    fns["liger"] = peer
                res["rows"].append(time_row(r, fns, args, backward, nbytes, device, smoke))
            except Exception:
                res["notes"].append(f"{name} {shape} {p} failed: {traceback.format_exc()[-800:]}")
            if device == "cuda":
                torch.cuda.empty_cache()
    return res


def main() -> None:
    from _results import kernel_main

    kernel_main(run, "kernels18")


if __name__ == "__main__":
    main()
