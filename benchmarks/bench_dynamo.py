"""The opswap torch.compile backend against eager and plain torch.compile (Inductor).

    PYTHONPATH=src python benchmarks/bench_dynamo.py [--models resnet,mobilenet,bert] [--out DIR]

For each zoo model (in eval mode, inference mode): the eager module, torch.compile with
Inductor, and torch.compile(backend=opswap's backend), compiled once each (the compile
time is recorded), then timed in one interleaved loop; the speed-ups are against eager
and the opswap row's against Inductor too, with what fired per graph. Writes
DIR/dynamo_<device>.json with device, versions and date.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def _compiled(model, inputs, backend):
    torch._dynamo.reset()
    fn = torch.compile(copy.deepcopy(model), backend=backend)
    t0 = time.perf_counter()
    with torch.inference_mode():
        fn(*inputs)
    return fn, time.perf_counter() - t0


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _results import compare_variants, write_results

    from opswap.backends.dynamo import backend
    from opswap.bench.device import describe_device, resolve_device
    from opswap.models import load

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="resnet,mobilenet,bert")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--min-time", type=float, default=3.0)
    args = ap.parse_args()
    rows = []
    for name in args.models.split(","):
        lm = load(f"zoo:{name}")
        model, inputs = lm.module.eval(), lm.example_inputs
        inductor, inductor_s = _compiled(model, inputs, "inductor")
        be = backend()
        ours, ours_s = _compiled(model, inputs, be)
        fns = {"eager": model, "inductor": inductor, "opswap": ours}
        timed = compare_variants(fns, inputs, "eager", min_time_s=args.min_time)
        by = {r["name"]: r for r in timed}
        by["inductor"]["compile_s"], by["opswap"]["compile_s"] = inductor_s, ours_s
        by["opswap"]["speedup_vs_inductor"] = by["inductor"]["ms"] / by["opswap"]["ms"]
        by["opswap"]["graphs"] = [r.to_json() for r in be.reports]
        for r in timed:
            print(f"{name:10s} {r['name']:9s} {r['ms']:8.3f} ms  x{r['speedup_vs_eager']:.2f}")
        rows.append(
            {"model": f"zoo:{name}", "inputs": [list(x.shape) for x in inputs], "variants": timed}
        )
    write_results(
        Path(args.out),
        f"dynamo_{resolve_device('cpu').type}.json",
        describe_device(resolve_device("cpu")),
        rows,
        threads=torch.get_num_threads(),
    )


if __name__ == "__main__":
    main()
