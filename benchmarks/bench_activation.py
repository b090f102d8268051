"""opswap::bias_act against eager PyTorch and torch.compile, on a GPU (the lead runs it on
the H200), for each kind of site activation.pointwise replaces:

    PYTHONPATH=src python3 benchmarks/bench_activation.py --out DIR [--update-crossover]
    PYTHONPATH=src python3 benchmarks/bench_activation.py --smoke     (CPU, interpreter)

Forms (each its crossover kernel name): GPT-2's gelu_new and FastGELU written out, QuickGELU
(`x * sigmoid(1.702 x)`), hard-swish (`x * relu6(x + 3) / 6`) and hard-sigmoid
(`relu6(x + 3) / 6`) written out, and bias + GELU (`F.gelu(x + b)`, the "bias_act" row
that stands for an activation of x + b). Eager is the formula as users write it,
torch.compile that function compiled, ours the op the rule puts in its place. Shapes
[rows, width], rows 4096 and 32768, widths 768, 3072, 5632 and 16384 (skipped where the
GPU's free memory is short), bfloat16; forward alone and forward + backward (dx, and db
for the bias row). Timed with triton.testing.do_bench (median, L2 flushed between
repetitions); effective GB/s counts the bytes the op must move: forward x in and y out
(2 n b for n elements of b bytes), backward dy and x in and dx out (3 n b more), next to
a device copy's GB/s measured in the same run. Writes DIR/activation_h200.json with the
device, versions and date; `--update-crossover` writes the measured entries into
src/opswap/kernels/crossover.json. `--smoke` runs every path at tiny shapes on the CPU
under TRITON_INTERPRET=1 (set before Triton is imported), to check the script itself.
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # the interpreter is chosen when Triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import math  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_norm_kernels import copy_gbps, env, time_row  # noqa: E402

from opswap.kernels import activation as A  # noqa: E402

ROWS = (4096, 32768)
WIDTHS = (768, 3072, 5632, 16384)


def gelu_new(x):  # transformers' NewGELUActivation (GPT-2)
    return (
        0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    )


def fast_gelu(x):  # transformers' FastGELUActivation
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def quick_gelu(x):  # transformers' QuickGELUActivation
    return x * torch.sigmoid(1.702 * x)


def hardswish(x):
    return x * F.relu6(x + 3) / 6


def hardsigmoid(x):
    return F.relu6(x + 3) / 6


def bias_gelu(x, b):
    return F.gelu(x + b)


#: crossover kernel name -> (eager as users write it, ours, whether it takes a bias)
FORMS = {
    "bias_act:gelu_new": (gelu_new, lambda x: A.bias_act(x, None, "gelu_tanh", 0.0), False),
    "bias_act:fast_gelu": (fast_gelu, lambda x: A.bias_act(x, None, "gelu_tanh", 0.0), False),
    "bias_act:quick_gelu": (quick_gelu, lambda x: A.bias_act(x, None, "quick_gelu", 0.0), False),
    "bias_act:hardswish": (hardswish, lambda x: A.bias_act(x, None, "hardswish", 0.0), False),
    "bias_act:hardsigmoid": (
        hardsigmoid,
        lambda x: A.bias_act(x, None, "hardsigmoid", 0.0),
        False,
    ),
    "bias_act": (bias_gelu, lambda x, b: A.bias_act(x, b, "gelu", 0.0), True),
}


def _fits(rows: int, width: int, device: str) -> bool:
    """Whether a forward + backward of the widest eager formula fits: about 12 tensors of
    x's size (its saved intermediates, y, dy, dx), with room to spare."""
    if device != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info()
    return 12 * rows * width * 2 < 0.8 * free


def row(kernel, rows, width, dtype, device, smoke, compiled) -> list[dict]:
    eager, ours, biased = FORMS[kernel]
    elt = torch.empty((), dtype=dtype).element_size()
    out = []
    for p, backward in (("forward", False), ("forward+backward", True)):
        g = torch.Generator(device=device).manual_seed(rows + width)
        x = (torch.randn(rows, width, generator=g, device=device) * 2).to(dtype)
        args = [x.requires_grad_(backward)]
        if biased:
            b = torch.randn(width, generator=g, device=device).to(dtype)
            args.append(b.requires_grad_(backward))
        with torch.no_grad():
            ref = eager(*args).float()
            err = float((ours(*args).float() - ref).norm() / ref.norm())
        nbytes = (2 + (3 if backward else 0)) * rows * width * elt
        r = {"kernel": kernel, "dtype": str(dtype).removeprefix("torch."), "rows": rows}
        r.update({"hidden": width, "pass": p, "rel_l2_ours_vs_eager": err, "bytes": nbytes})
        fns = {"ours": ours, "eager": eager, "compile": compiled[kernel]}
        out.append(time_row(r, fns, args, backward, nbytes, device, smoke))
    return out


def run(smoke: bool = False) -> dict:
    device = "cpu" if smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here: run with --smoke for the CPU check")
    dtype = torch.bfloat16
    rows_list, widths = ((3,), (48, 77)) if smoke else (ROWS, WIDTHS)
    res: dict = {**env(device), "notes": [], "rows": []}
    res["copy_gbps"] = copy_gbps(device, smoke)
    compiled = {k: (f[0] if smoke else torch.compile(f[0])) for k, f in FORMS.items()}
    if smoke:
        res["notes"].append("smoke: eager stands in for torch.compile (no GPU)")
    for kernel in FORMS:
        for rows in rows_list:
            for width in widths:
                if not _fits(rows, width, device):
                    res["notes"].append(f"{kernel} at {rows} x {width} skipped: GPU memory")
                    continue
                try:
                    res["rows"] += row(kernel, rows, width, dtype, device, smoke, compiled)
                except Exception:
                    res["notes"].append(
                        f"{kernel} at {rows} x {width} failed: {traceback.format_exc()[-800:]}"
                    )
                if device == "cuda":
                    torch.cuda.empty_cache()
    return res


def main() -> None:
    from _results import kernel_main

    kernel_main(run, "activation")


if __name__ == "__main__":
    main()
