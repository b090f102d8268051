"""Convolution algorithms per layer (chapter 11, issue 40): every registered algorithm
(im2col + GEMM, FFT, Winograd once merged: the loop is over `conv_algorithms.algorithms()`)
against PyTorch's conv in NCHW and channels-last, torch.compile of the conv, and on the CPU
ONNX Runtime and OpenVINO (fp32) of a one-conv model where they are installed.

    PYTHONPATH=src python3 benchmarks/bench_conv.py [--out DIR] [--quick]

Layers: ResNet-50/VGG 3x3 layers at batch 1 and 8; the large-kernel sweep k = 7, 15, 31,
63 in 2-D (stride 1, 'same' padding) and a long-convolution sweep in 1-D (k up to 1023 on
the GPU), batch 1 and 8. The sizes follow the device: on a GPU C = 64 at 56 x 56 (2-D)
and C = 256, L = 4096 (1-D); on the CPU, whose direct convolution at k = 63 would take
seconds a call, C = 16 (2-D) and C = 32 (1-D, k up to 511) at the same spatial sizes; im2col
is not timed where its column matrix would pass 2 GB.

Each row: median ms per call of every candidate (interleaved, bench.timing.benchmark;
CUDA events on the GPU), the fastest, each algorithm's speed-up over the faster of
PyTorch's two layouts, and at batch 1 each algorithm's relative L2 error against a float64
direct convolution next to PyTorch's conv's in the same dtype. Per sweep the FFT
crossover: the smallest kernel from which the FFT beats PyTorch's conv at every larger
kernel measured (None where it never does). Writes DIR/conv_<device>.json (cpu, h100 or
h200) with the device, versions and date.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _results import card, write_results  # noqa: E402

from opswap.bench.device import describe_device  # noqa: E402
from opswap.bench.timing import benchmark  # noqa: E402
from opswap.kernels._conv_error import error_against_float64  # noqa: E402
from opswap.kernels.conv_algorithms import ConvSite, algorithms, site_of  # noqa: E402
from opswap.kernels.conv_im2col import column_bytes  # noqa: E402

# (name, C_in, C_out, H = W) of ResNet-50's and VGG-16's 3x3 stride-1 layers
LAYERS_3X3 = [
    ("resnet50.layer1 3x3", 64, 64, 56),
    ("resnet50.layer2 3x3", 128, 128, 28),
    ("resnet50.layer3 3x3", 256, 256, 14),
    ("resnet50.layer4 3x3", 512, 512, 7),
    ("vgg16.conv3 3x3", 256, 256, 56),
]
KERNELS_2D = (7, 15, 31, 63)


def _conv(dims: int) -> Callable[..., torch.Tensor]:
    return F.conv1d if dims == 1 else F.conv2d


class OneConv(nn.Module):
    def __init__(self, w: torch.Tensor, b: torch.Tensor, padding: tuple[int, ...]) -> None:
        super().__init__()
        self.w, self.b, self.padding = nn.Parameter(w), nn.Parameter(b), padding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _conv(self.w.dim() - 2)(x, self.w, self.b, 1, self.padding)


def runtimes(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, padding: tuple[int, ...]) -> dict:
    """ONNX Runtime and OpenVINO of the one-conv model (CPU), where they load."""
    from opswap.backends.openvino import openvino_artifact
    from opswap.backends.ort import ort_artifact

    out: dict[str, Callable[[], object]] = {}
    model = OneConv(w.cpu(), b.cpu(), padding).eval()
    for name, make in (("onnxruntime", ort_artifact), ("openvino", openvino_artifact)):
        art = make(model, (x,), None, tempfile.mkdtemp())
        if art.module is not None:
            out[name] = lambda m=art.module: m(x)
        else:
            print(f"  {name}: {art.error}", flush=True)
    return out


def layer(
    label: str,
    site: ConvSite,
    device: str,
    *,
    compile_: bool,
    peers: bool,
    errors: bool,
    budget_s: float,
    max_columns: float = 2e9,
    cpu_time: bool = False,
) -> dict:
    """One row: every candidate timed side by side at `site`."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(site.input_shape, generator=gen).to(device)
    w = (torch.randn(site.weight_shape, generator=gen) * 0.05).to(device)
    b = torch.randn(site.weight_shape[0], generator=gen).to(device)
    conv = _conv(site.dims)
    settings = (site.stride, site.padding, site.dilation, site.groups)
    fns: dict[str, Callable[[], object]] = {"pytorch": lambda: conv(x, w, b, *settings)}
    if site.dims == 2:
        cl = torch.channels_last
        xc, wc = x.contiguous(memory_format=cl), w.contiguous(memory_format=cl)
        fns["pytorch_channels_last"] = lambda: conv(xc, wc, b, *settings)
    refused: dict[str, str] = {}
    for a in algorithms():
        why = a.refuses(site)
        if why is None and a.name == "im2col" and column_bytes(site) > max_columns:
            why = f"column matrix of {column_bytes(site) / 1e9:.1f} GB not timed"
        if why is None:
            fns[a.name] = lambda a=a: a(x, w, b, site)
        else:
            refused[a.name] = why
    if compile_:
        compiled = torch.compile(lambda x: conv(x, w, b, *settings), dynamic=False)
        fns["torch_compile"] = lambda: compiled(x)
    if peers and device == "cpu":
        try:
            fns.update(runtimes(x, w, b, site.padding))
        except Exception as e:  # a missing runtime is a note, not a failure
            print(f"  runtimes: {type(e).__name__}: {e}", flush=True)
    if cpu_time:
        ms = fastest_ms = process_times(fns)
    else:
        with torch.inference_mode():
            res = benchmark(
                fns, warmup=1, repeats=3, min_time_s=min(0.2, budget_s), max_time_s=budget_s,
                device=device,
            )  # fmt: skip
        ms = {n: res[n].median * 1e3 for n in fns}
        fastest_ms = {n: res[n].min * 1e3 for n in fns}
    torch_best = min(ms[n] for n in ("pytorch", "pytorch_channels_last") if n in ms)
    algos = [a.name for a in algorithms() if a.name in ms]
    row = {
        "layer": label,
        "input": list(site.input_shape),
        "weight": list(site.weight_shape),
        "padding": list(site.padding),
        "ms": ms,
        "min_ms": fastest_ms,
        "fastest": min(ms, key=lambda n: ms[n]),
        "speedup_vs_pytorch": {n: torch_best / ms[n] for n in algos},
        "refused": refused,
        "gmac": site.direct_multiplications() / 1e9,
    }
    if errors:
        row["rel_l2_vs_float64"] = {}
        for a in algorithms():
            if a.name in ms:
                mine, theirs = error_against_float64(a, site)
                row["rel_l2_vs_float64"][a.name] = mine
                row["rel_l2_vs_float64"]["pytorch"] = theirs
    line = ", ".join(f"{n} {v:.3g}" for n, v in sorted(ms.items(), key=lambda kv: kv[1]))
    print(f"{label} {list(site.input_shape)} k={list(site.kernel)}: {line} ms", flush=True)
    return row


def process_times(fns: dict[str, Callable[[], object]], rounds: int = 5) -> dict[str, float]:
    """Milliseconds of CPU time per call (this process, all its threads), the least over
    interleaved rounds of calls lasting at least 20 ms of CPU time each: on a machine that
    other work keeps busy, wall-clock time measures the queue for the cores, CPU time the
    work the call did."""
    best = {n: float("inf") for n in fns}
    with torch.inference_mode():
        for fn in fns.values():
            fn()
        for r in range(rounds):
            names = list(fns)[r % len(fns) :] + list(fns)[: r % len(fns)]
            for n in names:
                calls, t0 = 0, time.process_time()
                while True:
                    fns[n]()
                    calls += 1
                    spent = time.process_time() - t0
                    if spent >= 0.02:
                        break
                best[n] = min(best[n], spent / calls * 1e3)
    return best


def crossover(rows: list[dict]) -> int | None:
    """The smallest kernel from which the FFT beats PyTorch's conv at every larger one."""
    best = None
    for r in sorted(rows, key=lambda r: -r["weight"][-1]):
        if r.get("speedup_vs_pytorch", {}).get("fft", 0.0) > 1.0:
            best = r["weight"][-1]
        else:
            break
    return best


def run(device: str, quick: bool, cpu_time: bool = False) -> dict:
    gpu = device == "cuda"
    budget = 0.3 if quick else 1.5
    rows: list[dict] = []
    sweeps: dict[str, list[dict]] = {}

    def add(label: str, site: ConvSite, sweep: str | None = None, **kw: bool) -> None:
        try:
            r = layer(label, site, device, budget_s=budget, cpu_time=cpu_time, **kw)
        except Exception as e:
            traceback.print_exc()
            r = {"layer": label, "input": list(site.input_shape), "error": f"{e}"[:300]}
        rows.append(r)
        if sweep:
            sweeps.setdefault(sweep, []).append(r)

    def site(n: int, c: int, o: int, spatial: tuple[int, ...], k: int) -> ConvSite:
        x = torch.empty(n, c, *spatial)
        w = torch.empty(o, c, *([k] * len(spatial)))
        pad = (k // 2,) * len(spatial)
        return site_of(x, w, (1,) * len(spatial), pad, (1,) * len(spatial), 1)

    layers = LAYERS_3X3 if gpu else LAYERS_3X3[:4] + [("vgg16.conv3 3x3 (C/2)", 128, 128, 56)]
    for n in (1, 8):
        for label, c, o, hw in layers[:2] if quick else layers:
            add(label, site(n, c, o, (hw, hw), 3), compile_=not quick and (gpu or n == 1),
                peers=True, errors=n == 1)  # fmt: skip
    c2 = 64 if gpu else 16
    for n in (1, 8):
        for k in KERNELS_2D[:2] if quick else KERNELS_2D:
            add(f"2-D k={k}", site(n, c2, c2, (56, 56), k), f"2d_batch{n}",
                compile_=gpu, peers=False, errors=n == 1)  # fmt: skip
    c1, length = (256, 4096) if gpu else (32, 4096)
    ks1 = (7, 31, 127, 255, 511, 1023) if gpu else (7, 31, 127, 511)
    for n in (1, 8):
        for k in ks1[:2] if quick else ks1:
            add(f"1-D k={k}", site(n, c1, c1, (length,), k), f"1d_batch{n}",
                compile_=False, peers=False, errors=n == 1)  # fmt: skip
    cross = {name: crossover(rs) for name, rs in sweeps.items()}
    print("FFT crossover kernel size per sweep:", cross, flush=True)
    return {
        "rows": rows,
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "fft_crossover_kernel": cross,
        "sizes": {"2d_channels": c2, "1d_channels": c1, "1d_length": length},
        "threads": torch.get_num_threads(),
        "device_detail": describe_device(torch.device(device)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "benchmarks/results"))
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="a few layers, short timing")
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="CPU: time CPU seconds per call at one thread (a machine shared with other work)",
    )
    args = ap.parse_args()
    if args.cpu_time:
        torch.set_num_threads(1)
    res = run(args.device, args.quick, args.cpu_time)
    res["timing"] = "process CPU time, 1 torch thread" if args.cpu_time else "wall clock"
    tag = card() if args.device == "cuda" else "cpu"
    name = f"conv_{tag}{'_cputime' if args.cpu_time else ''}{'_quick' if args.quick else ''}.json"
    write_results(args.out, name, res.pop("device_detail"), res.pop("rows"), **res)


if __name__ == "__main__":
    main()
