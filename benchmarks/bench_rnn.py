"""RNNs (chapter 19): a Python loop over an LSTMCell / GRUCell against one nn.LSTM / nn.GRU
(cuDNN on CUDA, oneDNN or ATen on the CPU), opswap's rewrite of the loop (rnn.cell_loop),
opswap's persistent Triton kernel (opswap::lstm_seq / gru_seq, CUDA), torch.compile of the
loop, the loop replayed from one CUDA graph (opswap.backends.cudagraph, the race's
`+cudagraph` variant), and flashrnn where it imports.

    PYTHONPATH=src python3 benchmarks/bench_rnn.py                     # CPU, one thread
    PYTHONPATH=src python3 benchmarks/bench_rnn.py --device cuda --update-crossover

Every variant of one shape is timed in one interleaved loop (opswap.bench.timing), and
each row gives its median ms, the speed-up over the cell loop and over the sequence
module, and its largest difference from the cell loop's output (every step's h). The CUDA
grid is the issue's: batch 1 to 64, hidden 256 / 512 / 1024, T 64 / 256, float32 and
bfloat16 (the LSTM); torch.compile of the loop (an unrolled graph of T steps, 20 s and
more to compile a shape) is timed at T 64, hidden 256, float32 only. With
--update-crossover, the kernel's time against the sequence module's writes the crossover
table that rnn.fused_seq plans from.

Writes DIR/rnn_<device>.json (cpu, h100 or h200) with the date, device and versions.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from _results import card, write_results  # noqa: E402

CELLS = {"lstm": (nn.LSTMCell, nn.LSTM), "gru": (nn.GRUCell, nn.GRU)}


class CellLoop(nn.Module):
    """The loop a user writes: T calls of one cell over x [B, T, F], every h stacked."""

    def __init__(self, kind: str, features: int, hidden: int, steps: int) -> None:
        super().__init__()
        self.kind, self.steps = kind, steps
        self.cell = CELLS[kind][0](features, hidden)

    def forward(self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        outs = []
        state: Any = (h, c) if self.kind == "lstm" else h
        for t in range(self.steps):
            state = self.cell(x[:, t], state)
            outs.append(state[0] if self.kind == "lstm" else state)
        return torch.stack(outs, 1)


class Sequence(nn.Module):
    """The cell's weights in one nn.LSTM / nn.GRU (batch-first)."""

    def __init__(self, loop: CellLoop) -> None:
        super().__init__()
        cell = loop.cell
        self.kind = loop.kind
        self.rnn = CELLS[loop.kind][1](cell.input_size, cell.hidden_size, batch_first=True)
        with torch.no_grad():
            for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                getattr(self.rnn, f"{name}_l0").copy_(getattr(cell, name))

    def forward(self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        hx = (h[None], c[None]) if self.kind == "lstm" else h[None]
        return self.rnn(x, hx)[0]


class Kernel(nn.Module):
    """opswap::lstm_seq / gru_seq on the cell's weights."""

    def __init__(self, loop: CellLoop) -> None:
        super().__init__()
        self.kind, self.cell = loop.kind, loop.cell

    def forward(self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        c_ = self.cell
        w = (c_.weight_ih, c_.weight_hh, c_.bias_ih, c_.bias_hh)
        if self.kind == "lstm":
            return torch.ops.opswap.lstm_seq(x, h, c, *w, True)[0]
        return torch.ops.opswap.gru_seq(x, h, *w, True)[0]


def flashrnn_status() -> str:
    try:
        import flashrnn  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        return "not installed"
    return "installed (no adapter for its API here yet)"


def opswap_rewrite(loop: CellLoop, inputs: tuple) -> tuple[nn.Module, int]:
    """The loop as opswap's rnn.cell_loop leaves it, and how many sites it rewrote."""
    from opswap.graph.capture import capture
    from opswap.planner import apply_plan, make_plan

    cap = capture(loop, inputs, method="fx")
    plan = make_plan(cap, rules=["rnn.cell_loop"])
    return apply_plan(cap, plan).gm, len(plan.decisions)


def time_shape(
    kind: str, batch: int, hidden: int, steps: int, dtype: torch.dtype, device: str, args
) -> list[dict]:
    from opswap.bench.timing import benchmark

    torch.manual_seed(0)
    features = hidden
    loop = CellLoop(kind, features, hidden, steps).to(device, dtype).eval()
    x = torch.randn(batch, steps, features, device=device, dtype=dtype)
    h = torch.randn(batch, hidden, device=device, dtype=dtype)
    c = torch.randn(batch, hidden, device=device, dtype=dtype)
    inputs = (x, h, c)
    fns: dict[str, Any] = {"cell_loop": loop, "nn_module": Sequence(loop).to(device, dtype).eval()}
    notes: dict[str, Any] = {}
    rewritten, sites = opswap_rewrite(loop, inputs)
    fns["opswap_cell_loop"] = rewritten
    notes["opswap_sites"] = sites
    if device == "cuda":
        from opswap.backends.cudagraph import CudaGraphed

        fns["opswap_kernel"] = Kernel(loop)
        graphed = CudaGraphed(loop)
        with torch.no_grad():
            graphed.capture(*inputs)
        fns["cell_loop_cudagraph"] = graphed
    compile_here = hidden <= args.compile_max_hidden and dtype == torch.float32
    if steps <= args.compile_max_steps and compile_here:
        fns["compile_loop"] = torch.compile(loop)
    with torch.inference_mode():
        ref = loop(*inputs).float()
        diffs = {k: float((f(*inputs).float() - ref).abs().max()) for k, f in fns.items()}
        res = benchmark(
            {k: (lambda f=f: f(*inputs)) for k, f in fns.items()},
            min_time_s=args.min_time,
            max_time_s=args.max_time,
            rel_width=0.1,
            device=device,
        )
    rows = []
    for k in fns:
        rows.append(
            {
                "kind": kind,
                "variant": k,
                "batch": batch,
                "hidden": hidden,
                "steps": steps,
                "dtype": str(dtype).removeprefix("torch."),
                "ms": res[k].median * 1e3,
                "iqr_ms": res[k].iqr * 1e3,
                "speedup_vs_cell_loop": res.ratio("cell_loop", k).of_medians,
                "speedup_vs_nn_module": res.ratio("nn_module", k).of_medians,
                "max_abs_diff_vs_cell_loop": diffs[k],
                **notes,
            }
        )
        print(rows[-1], flush=True)
    return rows


def crossover_rows(rows: list[dict]) -> list[dict]:
    """The kernel's time against the sequence module's, in crossover.update's form."""
    by = {
        (r["kind"], r["batch"], r["hidden"], r["steps"], r["dtype"], r["variant"]): r for r in rows
    }
    out = []
    for (kind, b, hd, t, dt, v), r in by.items():
        if v != "opswap_kernel":
            continue
        eager = by[(kind, b, hd, t, dt, "nn_module")]
        out.append(
            {
                "kernel": f"{kind}_seq",
                "dtype": dt,
                "rows": b,
                "hidden": hd,
                "pass": "forward",
                "ours_ms": r["ms"],
                "eager_ms": eager["ms"],
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "benchmarks/results"))
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (cpu only)")
    ap.add_argument("--min-time", type=float, default=0.3, help="seconds per shape at least")
    ap.add_argument("--max-time", type=float, default=1.5, help="seconds per shape at most")
    ap.add_argument("--compile-max-steps", type=int, default=64)
    ap.add_argument(
        "--compile-max-hidden",
        type=int,
        default=256,
        help="compile the loop (float32) only up to this hidden size: 20 s or more a shape",
    )
    ap.add_argument("--update-crossover", action="store_true")
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
        grid = [
            (kind, b, hd, 64, torch.float32)
            for kind in ("lstm", "gru")
            for hd in (256, 512)
            for b in (1, 8, 64)
        ]
    else:
        # float32 for both cells, bfloat16 for the LSTM: 54 shapes, about 6 minutes
        grid = [
            (kind, b, hd, t, dt)
            for dt in (torch.float32, torch.bfloat16)
            for kind in (("lstm", "gru") if dt == torch.float32 else ("lstm",))
            for hd in (256, 512, 1024)
            for t in (64, 256)
            for b in (1, 8, 64)
        ]
    rows = []
    for shape in grid:
        rows += time_shape(*shape, args.device, args)
    tag = "cpu" if args.device == "cpu" else card()
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    path = write_results(
        args.out,
        f"rnn_{tag}.json",
        name,
        rows,
        threads=torch.get_num_threads() if args.device == "cpu" else None,
        flashrnn=flashrnn_status(),
        cudnn=torch.backends.cudnn.version() if args.device == "cuda" else None,
        # cuDNN's float32 RNNs run TF32 products unless this is off (PyTorch's default: on)
        cudnn_allow_tf32=torch.backends.cudnn.allow_tf32,
        mkldnn=torch.backends.mkldnn.is_available(),
    )
    if args.update_crossover and args.device == "cuda":
        from opswap.kernels import crossover

        res = {
            "device_class": crossover.device_class(torch.device("cuda")),
            "rows": crossover_rows(rows),
        }
        date = path.read_text().split('"date": "')[1][:10]
        new = crossover.update(res, f"measured {path.name} {date}")
        print(f"crossover.json: {len(new)} entries measured")


if __name__ == "__main__":
    main()
