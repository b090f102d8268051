"""Big ops for small ones (chapter 5): fusion.parallel_conv and fusion.batch_matmul against
the model as written and against torch.compile of it and of the rewrite (the peer a user
reaches for), timed in one interleaved loop (opswap.bench.timing).

    PYTHONPATH=src python3 benchmarks/bench_big_ops.py                  # CPU, one thread
    PYTHONPATH=src python3 benchmarks/bench_big_ops.py --device cuda    # the gpu_suite part "bigops"

Cases, each at batch 1 and 8 (the rewritten model comes from opswap's own plan and apply,
with sites predicted slower kept, so that the table shows where the rewrite loses too):
- inception: three 1x1 convs (64 -> 32, 48, 16) on one [N, 64, 28, 28] map -> one 1x1 conv
  to 96 channels and a split (concatenated form);
- inception_3x3: the same with three 3x3 convs, padding 1;
- resnext: a [N, 128, 14, 14] map chunked into 8 slices, a 3x3 conv 16 -> 16 on each ->
  one grouped conv of 8 groups (grouped form);
- heads_const: 8 products x_i [N*16, 64] @ W_i [64, 64] with constant W_i (stacked once);
- heads_dyn: 8 products q_i [N, 16, 32] @ k_i^T [N, 32, 16], both computed at run time
  (stacked at every call).

Writes DIR/big_ops_<device>.json (cpu, h100 or h200) with the date, device and versions;
each row has ms, IQR, the speed-up over the original with its 95% interval and the error.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from _results import card, compare_variants, write_results  # noqa: E402


class Branches(nn.Module):
    def __init__(self, cin: int, outs: tuple[int, ...], k: int):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(cin, o, k, padding=k // 2) for o in outs)

    def forward(self, x):
        return [conv(x) for conv in self.convs]


class Split(nn.Module):
    def __init__(self, c: int, parts: int):
        super().__init__()
        self.parts = parts
        self.convs = nn.ModuleList(
            nn.Conv2d(c // parts, c // parts, 3, padding=1) for _ in range(parts)
        )

    def forward(self, x):
        xs = torch.chunk(x, self.parts, 1)
        return [conv(xs[i]) for i, conv in enumerate(self.convs)]


class ConstHeads(nn.Module):
    def __init__(self, k: int = 8, d: int = 64):
        super().__init__()
        self.w = nn.ParameterList(nn.Parameter(torch.randn(d, d) / d**0.5) for _ in range(k))

    def forward(self, x):  # x: [k, M, d]
        return [x[i] @ w for i, w in enumerate(self.w)]


class DynHeads(nn.Module):
    def __init__(self, k: int = 8):
        super().__init__()
        self.k = k

    def forward(self, q, kk):  # [N, 16, k * 32] each
        qs = [q[..., 32 * i : 32 * (i + 1)] for i in range(self.k)]
        ks = [kk[..., 32 * i : 32 * (i + 1)].transpose(1, 2) for i in range(self.k)]
        return [qs[i] @ ks[i] for i in range(self.k)]


def cases(batch: int) -> dict:
    return {
        "inception": (Branches(64, (32, 48, 16), 1), (torch.randn(batch, 64, 28, 28),)),
        "inception_3x3": (Branches(64, (32, 48, 16), 3), (torch.randn(batch, 64, 28, 28),)),
        "resnext": (Split(128, 8), (torch.randn(batch, 128, 14, 14),)),
        "heads_const": (ConstHeads(), (torch.randn(8, batch * 16, 64),)),
        "heads_dyn": (DynHeads(), (torch.randn(batch, 16, 256), torch.randn(batch, 16, 256))),
    }


RULES = {
    "inception": "fusion.parallel_conv",
    "inception_3x3": "fusion.parallel_conv",
    "resnext": "fusion.parallel_conv",
    "heads_const": "fusion.batch_matmul",
    "heads_dyn": "fusion.batch_matmul",
}


def run(device: str, min_time_s: float, compiled: bool = True) -> tuple[list[dict], list[str]]:
    from opswap.graph.capture import capture
    from opswap.planner import apply_plan, make_plan

    rows, notes = [], []
    for batch in (1, 8):
        for name, (model, inputs) in cases(batch).items():
            rule = RULES[name]
            model = model.eval()
            cap = capture(model, inputs)
            plan = make_plan(cap, rules=[rule], keep_slower=True)
            est = [d.estimate for d in plan.decisions]
            skipped = [s.reason for s in make_plan(cap, rules=[rule]).skipped]
            gm = apply_plan(cap, plan).gm
            model, gm = model.to(device), gm.to(device)
            dev_inputs = tuple(t.to(device) for t in inputs)
            fns = {"original": model, "rewritten": gm}
            if compiled:  # the peer a user reaches for instead: Inductor fuses on its own
                fns["compile"] = torch.compile(model)
                fns["rewritten+compile"] = torch.compile(gm)
            for r in compare_variants(
                fns, dev_inputs, "original", device=device, min_time_s=min_time_s
            ):
                rows.append(
                    {
                        "case": name,
                        "batch": batch,
                        "rule": rule,
                        "sites": len(plan.decisions),
                        "predicted_saving_us": [
                            None if e.time_saved_s is None else e.time_saved_s * 1e6 for e in est
                        ],
                        "planner_skips": skipped,
                        **r,
                    }
                )
                print(rows[-1], flush=True)
    return rows, notes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "benchmarks/results"))
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (cpu only)")
    ap.add_argument("--min-time", type=float, default=1.0, help="seconds per case at least")
    ap.add_argument("--no-compile", action="store_true", help="leave out the torch.compile peer")
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    rows, notes = run(args.device, args.min_time, not args.no_compile)
    tag = "cpu" if args.device == "cpu" else card()
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    write_results(
        args.out,
        f"big_ops_{tag}.json",
        name,
        rows,
        threads=torch.get_num_threads() if args.device == "cpu" else None,
        notes=notes,
    )


if __name__ == "__main__":
    main()
