"""The CPU's 3x3 layers at batch 1 (and 8): what `conv.algorithm`'s race picks, with the
prepacked oneDNN conv (opswap::conv_onednn) and NNPACK (opswap::conv_nnpack) among its
candidates, against ONNX Runtime and OpenVINO in float32 on the same layer (issue 40).

    PYTHONPATH=src python benchmarks/bench_conv_onednn.py [--repeats 3] [--quick] [--out DIR]

Layers: bench_winograd.py's (ResNet-50's 3x3 stages and VGG-16's, C = O, padding 1, no
bias), batch 1, and batch 8 where a call is at most 8 GFLOP.

The method is bench_winograd.py's and bench_conv.py's, for a machine others load: every
variant on one thread (PyTorch, ONNX Runtime's intra-op pool, OpenVINO's inference
threads), timed by this process's CPU time (all its threads), not wall-clock time, in
interleaved rounds of calls lasting at least 20 ms each, the least round kept
(bench_conv.process_times); the whole interleaved measurement is repeated `--repeats`
times and each figure is the median of the repeats, with the least and the most beside it.

Variants: PyTorch's conv in NCHW and in channels-last (input converted beforehand, as the
race's baseline is), conv_onednn on an NCHW input (its conversions to and from
channels-last counted, as the race times it) and on a channels-last input (none: a model
already in channels-last), NNPACK, ONNX Runtime, OpenVINO with INFERENCE_PRECISION_HINT
f32 (the bar), and OpenVINO at its default precision, which on a CPU with AVX512-BF16 is
bfloat16 (shown, not a float32 peer).

The pick: the race's rule applied to these figures: the fastest of conv_onednn (NCHW, the
graph's layout) and NNPACK (where its error passes the race's accuracy test: at most 2x
PyTorch's conv against float64), taken only if it beats both PyTorch layouts; else
PyTorch's faster layout. `pick_channels_last_model`: the same for a model whose input is
already channels-last (the race then feeds every candidate channels-last: the packed conv
on a channels-last input against PyTorch's channels-last conv). The rule itself times with the target's wall-clock timer; the
figures here are CPU time. Winograd, FFT and im2col are not timed: chapter 11's table has
them 1.7-10x behind PyTorch's conv on every one of these layers.

Writes DIR/conv_cpu_onednn.json.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).parent))

from _results import write_results  # noqa: E402
from bench_conv import process_times  # noqa: E402
from bench_winograd import LAYERS, _onnx_conv  # noqa: E402

from opswap.kernels import conv_algorithms as ca  # noqa: E402
from opswap.kernels import conv_nnpack, conv_onednn  # noqa: E402
from opswap.kernels._conv_error import error_against_float64  # noqa: E402
from opswap.rules.conv.algorithm import ERROR_RATIO  # noqa: E402

#: the largest direct-conv GFLOP a call timed (VGG's big layers at batch 8 are 30)
MAX_GFLOP = 8.0
TORCH = ("torch", "torch_channels_last")
PEERS = ("onnxruntime", "openvino_f32")


def _site(c: int, hw: int, n: int) -> ca.ConvSite:
    return ca.ConvSite(
        (n, c, hw, hw), (c, c, 3, 3), (1, 1), (1, 1), (1, 1), 1, torch.float32, "cpu"
    )


def _peers(c: int, x: torch.Tensor, w: torch.Tensor, tmp: Path) -> dict[str, Any]:
    """ONNX Runtime and OpenVINO (float32, and at its default precision) on a one-Conv
    model, one thread each, where importable."""
    fns: dict[str, Any] = {}
    path = _onnx_conv(c, tmp / f"conv{c}.onnx", w)
    xn = x.numpy()
    try:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.intra_op_num_threads = 1
        sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        fns["onnxruntime"] = lambda: sess.run(None, {"x": xn})
    except ImportError:
        pass
    try:
        import openvino as ov

        core = ov.Core()
        for name, extra in (
            ("openvino_f32", {"INFERENCE_PRECISION_HINT": "f32"}),
            ("openvino_default", {}),
        ):
            compiled = core.compile_model(str(path), "CPU", {"INFERENCE_NUM_THREADS": 1, **extra})
            req = compiled.create_infer_request()
            fns[name] = lambda req=req: req.infer({0: xn})
    except ImportError:
        pass
    return fns


def nnpack_accuracy(c: int, hw: int) -> dict[str, Any]:
    """NNPACK's error against float64 next to PyTorch's conv's, as the race tests it."""
    site = _site(c, hw, 1)
    why = conv_nnpack.ALGORITHM.refuses(site)
    if why is not None:
        return {"refused": why}
    mine, theirs = error_against_float64(conv_nnpack.ALGORITHM, site)
    return {"err": mine, "torch_err": theirs, "passes": mine <= ERROR_RATIO * theirs}


def layer(c: int, hw: int, n: int, tmp: Path, repeats: int, rounds: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, c, hw, hw, generator=gen)
    w = torch.randn(c, c, 3, 3, generator=gen) / math.sqrt(9 * c)
    cl = torch.channels_last
    xc, wc = x.contiguous(memory_format=cl), w.contiguous(memory_format=cl)
    fns: dict[str, Any] = {
        "torch": lambda: F.conv2d(x, w, None, 1, 1),
        "torch_channels_last": lambda: F.conv2d(xc, wc, None, 1, 1),
        "onednn_prepacked": lambda: conv_onednn.conv_onednn(x, w, None, [1, 1], [1, 1], [1, 1], 1),
        "onednn_prepacked_cl_input": lambda: conv_onednn.conv_onednn(
            xc, w, None, [1, 1], [1, 1], [1, 1], 1
        ),
    }
    if conv_nnpack.available() is None:
        fns["nnpack"] = lambda: conv_nnpack.conv_nnpack(x, w, None, [1, 1], [1, 1], [1, 1], 1)
    fns.update(_peers(c, x, w, tmp))
    runs = [process_times(fns, rounds=rounds) for _ in range(repeats)]
    ms = {k: round(statistics.median(r[k] for r in runs), 4) for k in fns}
    spread = {
        k: [round(min(r[k] for r in runs), 4), round(max(r[k] for r in runs), 4)] for k in fns
    }
    return {"ms": ms, "spread_ms": spread, "repeats": repeats}


def pick(ms: dict[str, float], nnpack_ok: bool) -> tuple[str, float]:
    """The race's choice on these figures: an algorithm only if faster than both layouts."""
    base = min(TORCH, key=lambda k: ms[k])
    ours = {"onednn_prepacked": ms["onednn_prepacked"]}
    if nnpack_ok and "nnpack" in ms:
        ours["nnpack"] = ms["nnpack"]
    best = min(ours, key=lambda k: ours[k])
    return (best, ours[best]) if ours[best] < ms[base] else (base, ms[base])


def run(quick: bool, repeats: int, out: Path | None) -> dict[str, Any]:
    torch.set_num_threads(1)
    load_start = os.getloadavg()
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    layers = LAYERS[:2] + LAYERS[-1:] if quick else LAYERS
    with tempfile.TemporaryDirectory() as tmp:
        for net, c, hw in layers:
            acc = nnpack_accuracy(c, hw)
            for n in (1, 8):
                gflop = 2 * _site(c, hw, n).direct_multiplications() / 1e9
                if gflop > MAX_GFLOP:
                    skipped.append(f"{net} {c}@{hw} batch {n} ({gflop:.1f} GFLOP a call)")
                    continue
                r = layer(c, hw, n, Path(tmp), repeats, 3 if quick else 5)
                ms = r["ms"]
                chosen, chosen_ms = pick(ms, bool(acc.get("passes")))
                peers = {k: ms[k] for k in PEERS if k in ms}
                best_peer = min(peers, key=lambda k: peers[k]) if peers else None
                row: dict[str, Any] = {
                    "net": net,
                    "layer": f"{c}@{hw}",
                    "batch": n,
                    "direct_gflop": round(gflop, 3),
                    **r,
                    "nnpack_accuracy": acc,
                    "pick": chosen,
                    "pick_ms": chosen_ms,
                    "pick_gflops": round(gflop / chosen_ms * 1e3, 1),
                    "best_fp32_peer": best_peer,
                }
                # in a channels-last model the race times every candidate on a channels-last
                # input: the packed conv pays no conversion, PyTorch's baseline is the same
                cl_pick = min(("torch_channels_last", "onednn_prepacked_cl_input"), key=ms.get)
                row["pick_channels_last_model"] = cl_pick
                row["pick_channels_last_model_ms"] = ms[cl_pick]
                if best_peer is not None:
                    row["best_peer_over_pick_channels_last_model"] = round(
                        peers[best_peer] / ms[cl_pick], 3
                    )
                    row["best_peer_over_pick"] = round(peers[best_peer] / chosen_ms, 3)
                    row["bar_met"] = chosen_ms <= peers[best_peer]
                    # met whatever the repeat: the pick's slowest repeat against the peer's fastest
                    row["bar_met_every_repeat"] = (
                        r["spread_ms"][chosen][1] <= r["spread_ms"][best_peer][0]
                    )
                row["prepacked_over_torch_cl"] = round(
                    ms["torch_channels_last"] / ms["onednn_prepacked"], 3
                )
                rows.append(row)
                print(
                    f"{net} {c}@{hw} b{n}: pick {chosen} {chosen_ms:.3f} ms, "
                    + ", ".join(
                        f"{k} {v:.3f}" for k, v in sorted(ms.items(), key=lambda kv: kv[1])
                    ),
                    flush=True,
                )
    extra: dict[str, Any] = {
        "skipped": skipped,
        "threads": torch.get_num_threads(),
        "timing": "process CPU time per call, 1 thread, interleaved rounds of >= 20 ms, least "
        f"round; median of {repeats} repeats, spread_ms = [least, most] of the repeats",
        "pick": "the race's rule on these figures (see the module docstring)",
    }
    extra["load_average_start_end"] = [load_start, os.getloadavg()]
    for mod in ("onnxruntime", "openvino"):
        try:
            extra[mod] = __import__(mod).__version__
        except ImportError:
            extra[mod] = None
    if out is not None:
        write_results(out, "conv_cpu_onednn.json", "cpu", rows, **extra)
    return {"rows": rows, **extra}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--quick", action="store_true", help="three layers, fewer rounds")
    p.add_argument("--repeats", type=int, default=3, help="repeats of the interleaved loop")
    args = p.parse_args()
    run(args.quick, args.repeats, args.out)


if __name__ == "__main__":
    main()
