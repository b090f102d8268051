"""Winograd F(2x2,3x3) and F(4x4,3x3) (opswap::conv_winograd) per 3x3 layer, against
PyTorch's conv and the peers a user would otherwise run, in one interleaved loop a layer.

    PYTHONPATH=src python benchmarks/bench_winograd.py [--device cpu|cuda] [--out DIR]
                                                       [--quick] [--threads N]

Layers: ResNet-50's 3x3 stages (64@56, 128@28, 256@14, 512@7) and VGG-16's (64@224,
128@112, 256@56, 512@28, 512@14), C = O, padding 1, batch 1 and 8.

- CPU (float32): PyTorch's conv (NCHW and channels-last: oneDNN), NNPACK where the build
  has it, F(2,3), F(4,3), ONNX Runtime and OpenVINO on a one-Conv ONNX model. Batch 8 of
  the 224/112/56/28 VGG layers (30 GFLOP a call each) is left out on the CPU to keep the
  run near three minutes; the JSON says so.
- CUDA (bfloat16 and float16): PyTorch's conv (cuDNN, NCHW and channels-last), F(2,3) and
  F(4,3) through the Triton products.
- Every layer: the multiplications saved (direct / Winograd's products), and the error of
  each algorithm and of PyTorch's conv against a float64 conv (relative L2, from
  kernels/_conv_error.error_against_float64) with the digits it keeps (-log10 of it) in
  float32 and in bfloat16/float16. On the CPU the op computes half inputs in float32, so
  the half rows there also give the GPU's arithmetic, emulated: V and U rounded to the
  dtype, products and transforms in float32, which is what the Triton kernel does.

On the CPU every variant runs on `--threads` threads (PyTorch, ONNX Runtime's intra-op
pool, OpenVINO's inference threads; default 1): on a shared 2-core VM a second thread
stalls for a scheduler slice whenever another process holds a core, and one thread each
compares the algorithms per core. Each figure is the median over interleaved rounds, with
the fastest round beside it (`min_ms`), which interference only ever lengthens.

Writes DIR/winograd_<device>.json (date, device, versions, rows).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).parent))

from _results import write_results  # noqa: E402

from opswap.bench.timing import benchmark  # noqa: E402
from opswap.kernels import _winograd as T  # noqa: E402
from opswap.kernels import conv_algorithms as ca  # noqa: E402
from opswap.kernels import conv_winograd as W  # noqa: E402
from opswap.kernels._conv_error import error_against_float64  # noqa: E402

LAYERS = [
    ("resnet50", 64, 56),
    ("resnet50", 128, 28),
    ("resnet50", 256, 14),
    ("resnet50", 512, 7),
    ("vgg16", 64, 224),
    ("vgg16", 128, 112),
    ("vgg16", 256, 56),
    ("vgg16", 512, 28),
    ("vgg16", 512, 14),
]
#: the largest direct-conv GFLOP a call timed on the CPU (VGG's big layers at batch 8 are 30)
CPU_MAX_GFLOP = 8.0


def _site(c: int, hw: int, n: int, dtype: torch.dtype, device: str) -> ca.ConvSite:
    return ca.ConvSite((n, c, hw, hw), (c, c, 3, 3), (1, 1), (1, 1), (1, 1), 1, dtype, device)


def _onnx_conv(c: int, path: Path, weight: torch.Tensor) -> Path:
    """A one-Conv ONNX model (3x3, padding 1, no bias) with the weight as an initializer."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(weight.numpy(), "w")
    node = helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1], kernel_shape=[3, 3])
    graph = helper.make_graph(
        [node],
        "conv3x3",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", c, "h", "w"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", c, "h", "w"])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(path))
    return path


def _peers(
    c: int, x: torch.Tensor, weight: torch.Tensor, tmp: Path, threads: int
) -> dict[str, Any]:
    """ONNX Runtime's and OpenVINO's CPU runs of the one-Conv model, where importable."""
    fns: dict[str, Any] = {}
    path = _onnx_conv(c, tmp / f"conv{c}.onnx", weight)
    xn = x.numpy()
    try:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        # no spinning after a run: in an interleaved loop ORT's idle threads would steal
        # the cores from the next variant
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.intra_op_num_threads = threads
        sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        fns["onnxruntime"] = lambda: sess.run(None, {"x": xn})
    except ImportError:
        pass
    try:
        import openvino as ov

        compiled = ov.Core().compile_model(str(path), "CPU", {"INFERENCE_NUM_THREADS": threads})
        req = compiled.create_infer_request()
        fns["openvino"] = lambda: req.infer({0: xn})
    except ImportError:
        pass
    return fns


def _emulated_half(
    x: torch.Tensor, w: torch.Tensor, m: int, dtype: torch.dtype, operands: torch.dtype
) -> torch.Tensor:
    """The Triton path's arithmetic on the CPU: V and U rounded to `operands` (what the
    tensor cores take: today the input's dtype), products and transforms in float32, the
    output rounded to `dtype`."""
    n, _, h, wd = x.shape
    v = T.input_transform(x, [1, 1], m, 1).to(operands).float()
    u = T.filter_transform(w, m, 1).to(operands).float()
    y = T.output_transform(torch.bmm(v, u), (n, w.shape[0], h, wd), m, 1, torch.contiguous_format)
    return y.to(dtype)


def _digits(err: float) -> float:
    return round(-math.log10(err), 2) if err > 0 else float("inf")


def errors(c: int, hw: int, device: str, dtypes: list[torch.dtype]) -> list[dict[str, Any]]:
    """Per dtype: each algorithm's and PyTorch's relative L2 error against float64, and the
    digits each keeps (batch 1)."""
    rows = []
    for dtype in dtypes:
        site = _site(c, hw, 1, dtype, device)
        row: dict[str, Any] = {"dtype": str(dtype).replace("torch.", "")}
        for m in W.TILES:
            err, torch_err = error_against_float64(ca.get(W._name(m)), site)
            row[f"f{m}_err"], row["torch_err"] = err, torch_err
            row[f"f{m}_digits_lost"] = round(_digits(torch_err) - _digits(err), 2)
            row[f"f{m}_within_2x"] = err <= 2 * torch_err
            if device == "cpu" and dtype != torch.float32:
                gen = torch.Generator().manual_seed(1)
                x = torch.randn(1, c, hw, hw, generator=gen).to(dtype)
                w = (torch.randn(c, c, 3, 3, generator=gen) / math.sqrt(9 * c)).to(dtype)
                truth = F.conv2d(x.double(), w.double(), None, 1, 1)
                y = _emulated_half(x.float(), w.float(), m, dtype, dtype)
                emu = float((y.double() - truth).norm() / truth.norm())
                row[f"f{m}_gpu_arith_err"] = emu
                row[f"f{m}_gpu_arith_digits_lost"] = round(_digits(torch_err) - _digits(emu), 2)
                if dtype == torch.bfloat16:  # what float16 operands (3 more bits) would give
                    y = _emulated_half(x.float(), w.float(), m, dtype, torch.float16)
                    emu = float((y.double() - truth).norm() / truth.norm())
                    row[f"f{m}_gpu_arith_fp16_operands_err"] = emu
        row["torch_digits"] = _digits(row["torch_err"])
        rows.append(row)
    return rows


def time_layer(
    c: int,
    hw: int,
    n: int,
    device: str,
    dtype: torch.dtype,
    tmp: Path,
    max_time_s: float,
    threads: int = 1,
) -> dict[str, Any]:
    """ms per call of every variant on one layer, interleaved."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, c, hw, hw, generator=gen).to(device, dtype)
    w = (torch.randn(c, c, 3, 3, generator=gen) / math.sqrt(9 * c)).to(device, dtype)
    xc = x.contiguous(memory_format=torch.channels_last)
    wc = w.contiguous(memory_format=torch.channels_last)
    fns: dict[str, Any] = {
        "torch": lambda: F.conv2d(x, w, None, 1, 1),
        "torch_channels_last": lambda: F.conv2d(xc, wc, None, 1, 1),
        "f2x2_3x3": lambda: W.conv_winograd(x, w, None, [1, 1], 1, 2),
        "f4x4_3x3": lambda: W.conv_winograd(x, w, None, [1, 1], 1, 4),
    }
    if device == "cpu":
        if torch._nnpack_available():
            fns["nnpack"] = lambda: torch._nnpack_spatial_convolution(x, w, None, [1, 1])
        fns.update(_peers(c, x, w, tmp, threads))
    with torch.inference_mode():
        res = benchmark(
            fns, warmup=2, repeats=5, min_time_s=0.3, max_time_s=max_time_s, device=device
        )
    ms = {k: round(res[k].median * 1e3, 4) for k in fns}
    best_ms = {k: round(res[k].min * 1e3, 4) for k in fns}
    peers = [k for k in ("onnxruntime", "openvino") if k in ms]
    site = _site(c, hw, n, dtype, device)
    gflop = 2 * site.direct_multiplications() / 1e9
    row: dict[str, Any] = {"ms": ms, "min_ms": best_ms, "direct_gflop": round(gflop, 3)}
    for m in W.TILES:
        k = f"f{m}x{m}_3x3"
        row[f"{k}_vs_torch"] = round(ms["torch"] / ms[k], 3)
        torch_best = min(ms["torch"], ms["torch_channels_last"])
        row[f"{k}_vs_best_torch"] = round(torch_best / ms[k], 3)
        if peers:
            row[f"{k}_vs_best_peer"] = round(min(ms[p] for p in peers) / ms[k], 3)
        if "nnpack" in ms:
            row[f"{k}_vs_nnpack"] = round(ms["nnpack"] / ms[k], 3)
    return row


def run(
    device: str, quick: bool = False, out: Path | None = None, threads: int = 1
) -> dict[str, Any]:
    import tempfile

    if device == "cpu":
        torch.set_num_threads(threads)
    dtypes = [torch.float32] if device == "cpu" else [torch.bfloat16, torch.float16]
    err_dtypes = [torch.float32, torch.bfloat16, torch.float16]
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    layers = LAYERS[:2] + LAYERS[-1:] if quick else LAYERS
    with tempfile.TemporaryDirectory() as tmp:
        for net, c, hw in layers:
            base = {"net": net, "layer": f"{c}@{hw}", "channels": c, "size": hw}
            site = _site(c, hw, 1, torch.float32, device)
            saved = {
                f"f{m}x{m}_3x3_multiplications_saved": round(
                    site.direct_multiplications() / ca.get(W._name(m)).multiplications(site), 3
                )
                for m in W.TILES
            }
            errs = errors(c, hw, device, err_dtypes)
            print(net, c, hw, saved, errs, flush=True)
            for n in (1, 8):
                gflop = 2 * _site(c, hw, n, torch.float32, device).direct_multiplications() / 1e9
                if device == "cpu" and gflop > CPU_MAX_GFLOP:
                    skipped.append(f"{net} {c}@{hw} batch {n} ({gflop:.1f} GFLOP a call)")
                    continue
                for dtype in dtypes:
                    r = time_layer(
                        c, hw, n, device, dtype, Path(tmp), 3.0 if quick else 6.0, threads
                    )
                    row = {**base, "batch": n, "dtype": str(dtype), **saved, **r}
                    if n == 1:
                        row["errors"] = errs
                    rows.append(row)
                    print(row, flush=True)
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    extra: dict[str, Any] = {
        "skipped": skipped,
        "threads": torch.get_num_threads(),
        "counts": "products only: (m+2)^2 per tile per (C, O) pair; transforms not counted",
        "error": "relative L2 against a float64 conv of the same rounded inputs, batch 1",
    }
    for mod in ("onnxruntime", "openvino", "triton"):
        try:
            extra[mod] = __import__(mod).__version__
        except ImportError:
            extra[mod] = None
    if out is not None:
        suffix = "cpu" if device == "cpu" else "cuda"
        write_results(out, f"winograd_{suffix}.json", name, rows, **extra)
    return {"rows": rows, **extra}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--quick", action="store_true", help="three layers, shorter timing")
    p.add_argument("--threads", type=int, default=1, help="CPU threads of every variant")
    args = p.parse_args()
    run(args.device, args.quick, args.out, args.threads)


if __name__ == "__main__":
    main()
