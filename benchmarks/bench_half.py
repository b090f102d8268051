"""bfloat16 whole models on one device, one interleaved run: float32 as given, torch.compile
of it, torch.autocast(bfloat16) around it, opswap's precision.bf16 result and that compiled.

    PYTHONPATH=src python benchmarks/bench_half.py [--device cuda] [--specs SPEC ...]
                                                   [--out DIR] [--no-compile]

`run(device)` is importable (benchmarks/gpu_suite.py may call it). opswap's variant is
`opswap.optimize(..., rules=["precision.bf16"], exactness="approx", target=<device's>)`,
saved and reloaded from its model.pt2 (the file a user gets), so that its own verification
(approx tolerance, at the capture's shapes) covers what is timed. Every variant's output is
compared with float32's on the timed inputs (rel_l2, cosine) in the same run. Writes
DIR/half_<device>.json with the device, versions and date. On a CPU without native bfloat16
(AVX2) the rule plans no site and the opswap rows are the float32 model: say so, do not read
a speed-up into them.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SPECS = ["zoo:resnet", "zoo:bert", "hf:bert"]


def _first(out) -> torch.Tensor:
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    return leaves[0].float()


def _autocast(module, device: str):
    kind = torch.device(device).type

    def fn(*xs):
        with torch.autocast(kind, dtype=torch.bfloat16):
            return module(*xs)

    return fn


def _target_for(device: str) -> str:
    return "h200" if torch.device(device).type == "cuda" else "cpu"


def run(
    device: str = "cpu",
    specs: list[str] | None = None,
    compile: bool = True,
    min_time_s: float = 2.0,
) -> dict:
    """Time the five variants of each spec on `device`; returns the JSON-ready record."""
    sys.path.insert(0, str(ROOT / "src"))
    import opswap
    from opswap.bench.timing import benchmark, describe_device
    from opswap.config import OptimizeConfig
    from opswap.models import load
    from opswap.pipeline import optimize

    rows = []
    for spec in specs or SPECS:
        name, _, rest = spec.partition("?")  # SPEC?key=value&key=value: --set overrides
        m = load(name, overrides=dict(kv.split("=", 1) for kv in rest.split("&") if kv))
        model = m.module.to(device).eval()
        xs = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in m.example_inputs)
        row: dict = {"model": spec, "inputs": [list(t.shape) for t in xs if hasattr(t, "shape")]}
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.time()
            r = optimize(
                model,
                xs,
                OptimizeConfig(
                    rules=["precision.bf16"],
                    exactness="approx",
                    target=_target_for(device),
                    device=device,
                    compare="none",
                    samples=2,
                    layers=False,
                    measure_rules=False,
                ),
                name=spec,
            )
            r.save(tmp)
            row["optimize_s"] = round(time.time() - t0, 1)
            row["bf16_sites"] = sum(d.rule == "precision.bf16" for d in r.plan.decisions)
            row["skipped"] = len(r.plan.skipped)
            row["saved"] = r.best
            row["deploy"] = r.to_json().get("deploy", {}).get("holds")
            v = r.to_json()["verification"]
            row["verification"] = {k: v[k] for k in ("passed", "cosine", "rel_l2")}
            fns = {
                "input": model,
                "autocast_bf16": _autocast(model, device),
                # the saved file where one was written; else the verified module in memory
                "opswap_bf16": (
                    opswap.load_optimized(tmp, compile=False).to(device)
                    if (Path(tmp) / "model.pt2").exists()
                    else r.candidate
                ),
            }
            if compile:
                for base, name in (("input", "compile"), ("opswap_bf16", "opswap_bf16+compile")):
                    c = torch.compile(fns[base])
                    t0 = time.time()
                    with torch.inference_mode():
                        c(*xs)
                    row.setdefault("compile_s", {})[name] = round(time.time() - t0, 1)
                    fns[name] = c
            with torch.inference_mode():
                ref = _first(model(*xs))
                errs = {}
                for k, f in fns.items():
                    out = _first(f(*xs))
                    errs[k] = {
                        "rel_l2": float((out - ref).norm() / ref.norm()),
                        "cosine": float(
                            torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), 0)
                        ),
                    }
                res = benchmark(
                    {k: (lambda f=f, a=xs: f(*a)) for k, f in fns.items()},
                    min_time_s=min_time_s,
                    max_time_s=10 * min_time_s,
                    rel_width=0.1,
                    device=device,
                )
            row["variants"] = []
            for k in fns:
                rr = res.ratio("input", k)
                row["variants"].append(
                    {
                        "name": k,
                        "ms": res[k].median * 1e3,
                        "iqr_ms": res[k].iqr * 1e3,
                        "speedup_vs_input": rr.of_medians,
                        "speedup_ci": [rr.ci_low, rr.ci_high],
                        **errs[k],
                    }
                )
        rows.append(row)
    return {
        "benchmark": "bench_half",
        "device": describe_device(torch.device(device)),
        "torch": torch.__version__,
        "opswap": opswap.__version__ if hasattr(opswap, "__version__") else None,
        "threads": torch.get_num_threads(),
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "models": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--specs", nargs="*", default=SPECS)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--min-time", type=float, default=2.0)
    args = ap.parse_args()
    data = run(args.device, args.specs, not args.no_compile, args.min_time)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"half_{torch.device(args.device).type}.json"
    path.write_text(json.dumps(data, indent=2, default=str))
    for row in data["models"]:
        print(f"{row['model']}: {row['bf16_sites']} bf16 site(s), saved {row['saved']}")
        for v in row["variants"]:
            print(
                f"  {v['name']:<22} {v['ms']:9.3f} ms  x{v['speedup_vs_input']:.2f}  "
                f"rel_l2 {v['rel_l2']:.2e}"
            )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
