"""opswap's int8 result against what a user would otherwise run, whole models, one run.

    PYTHONPATH=src python benchmarks/bench_int8_models.py [--specs SPEC ...] [--out DIR]
                                                          [--no-compile]

For each spec, `opswap.optimize(..., exactness="approx")` runs and saves its result; then
one interleaved loop (inference mode) times:

- `input`: the float32 model as given (the yardstick);
- `compile`: torch.compile of it (Inductor, float32);
- `torchao_int8`: torchao's Int8DynamicActivationInt8WeightConfig applied with quantize_
  to a copy (the library a user would reach for), and `torchao_int8+compile`;
- `opswap`: opswap.load_optimized(DIR), the saved model.pt2, and `opswap+compile`.

Each row records time, speed-up over the input with its 95% bootstrap interval, and the
output's relative L2 error and cosine against the float32 input's on the timed inputs.
Writes DIR/int8_models_<device>.json with device, versions and date.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SPECS = ["hf:bert?size=full", "hf:distilbert?size=full", "zoo:bert"]


def _split(spec: str) -> tuple[str, dict[str, str]]:
    name, _, rest = spec.partition("?")
    return name, dict(kv.split("=", 1) for kv in rest.split("&") if kv)


def _first(out):
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    return leaves[0].float()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--specs",
        nargs="*",
        default=SPECS,
        help="model specs, with --set overrides as SPEC?key=value&key=value",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    import opswap
    from opswap.bench.timing import benchmark, describe_device
    from opswap.config import OptimizeConfig
    from opswap.models import load
    from opswap.pipeline import optimize

    try:
        import torchao
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

        tao = torchao.__version__
    except ImportError:
        tao = None
    rows = []
    for spec in args.specs:
        name, sets = _split(spec)
        m = load(name, overrides=sets)
        xs = m.example_inputs
        row: dict = {
            "model": name,
            "set": sets,
            "inputs": [list(t.shape) for t in xs if isinstance(t, torch.Tensor)],
        }
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.time()
            r = optimize(
                m.module,
                xs,
                OptimizeConfig(compare="none", exactness="approx", samples=2, layers=False),
                name=name,
            )
            r.save(tmp)
            row["optimize_s"] = round(time.time() - t0, 1)
            row["int8_sites"] = sum(d.rule == "precision.int8_linear" for d in r.plan.decisions)
            row["rules"] = sorted({d.rule for d in r.plan.decisions})
            row["saved"] = r.best
            row["verification"] = {
                k: r.to_json()["verification"][k] for k in ("passed", "cosine", "rel_l2", "sqnr_db")
            }
            fns = {"input": m.module, "opswap": opswap.load_optimized(tmp, compile=False)}
            if tao:
                q = copy.deepcopy(m.module)
                quantize_(q, Int8DynamicActivationInt8WeightConfig())
                fns["torchao_int8"] = q
            if not args.no_compile:
                for base in list(fns):
                    c = torch.compile(fns[base])
                    t0 = time.time()
                    with torch.inference_mode():
                        c(*xs)
                    row.setdefault("compile_s", {})[base] = round(time.time() - t0, 1)
                    fns["compile" if base == "input" else f"{base}+compile"] = c
            with torch.inference_mode():
                ref = _first(m.module(*xs))
                errs = {}
                for k, f in fns.items():
                    out = _first(f(*xs))
                    errs[k] = {
                        "rel_l2": float((out - ref).norm() / ref.norm()),
                        "cosine": float(
                            torch.nn.functional.cosine_similarity(
                                out.flatten(), ref.flatten(), dim=0
                            )
                        ),
                    }
                res = benchmark(
                    {k: (lambda f=f, a=xs: f(*a)) for k, f in fns.items()},
                    min_time_s=2.0,
                    max_time_s=20.0,
                    rel_width=0.1,
                )
            variants = []
            for k in fns:
                rr = res.ratio("input", k)
                variants.append(
                    {
                        "name": k,
                        "ms": res[k].median * 1e3,
                        "speedup_vs_input": rr.of_medians,
                        "speedup_ci": [rr.ci_low, rr.ci_high],
                        **errs[k],
                    }
                )
            row["variants"] = variants
            peers = [v for v in variants if not v["name"].startswith(("opswap", "input"))]
            best_peer = min(peers, key=lambda v: v["ms"]) if peers else None
            best_ours = min(
                (v for v in variants if v["name"].startswith("opswap")), key=lambda v: v["ms"]
            )
            row["strongest_peer"] = best_peer["name"] if best_peer else None
            row["ours_over_strongest_peer"] = (
                best_peer["ms"] / best_ours["ms"] if best_peer else None
            )
        rows.append(row)
        print(
            json.dumps(
                {
                    "model": name,
                    "int8_sites": row["int8_sites"],
                    "variants": {
                        v["name"]: round(v["speedup_vs_input"], 2) for v in row["variants"]
                    },
                    "vs_peer": row["ours_over_strongest_peer"],
                }
            ),
            flush=True,
        )
    from _results import write_results

    write_results(args.out, "int8_models_cpu.json", describe_device("cpu"), rows, torchao=tao)


if __name__ == "__main__":
    main()
