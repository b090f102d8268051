"""Where precision.int8_linear pays: float32 nn.Linear against the Int8Linear it installs,
per shape, timed interleaved in one process, with the rule's prediction beside it.

    PYTHONPATH=src python benchmarks/bench_int8_linear.py [--device cpu|cuda] [--out DIR]

Each row: rows M (batch x tokens), in K, out N; the float32 Linear's and the int8 layer's
median times (eager, inference mode) and their ratio with its 95% bootstrap interval; the
int8 output's relative L2 error against float32; the speed-up the rule predicts (on the
`cpu` target, its own short timing of the site's shape; elsewhere the roofline from the
target's float32 and int8 rates, bandwidth and dispatch cost, also recorded here as
`roofline_predicted_speedup`), and whether the planner would take the site. Writes DIR/int8_linear_<device>.json
with device, versions and date.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime as dt
import json
import platform
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
SHAPES = [
    (1, 768, 768),
    (8, 768, 3072),
    (16, 768, 3072),
    (64, 768, 768),
    (128, 1024, 4096),
    (256, 768, 3072),
    (512, 4096, 4096),
    (1024, 768, 768),
    (2048, 768, 768),
    (32, 64, 256),
    (64, 4096, 11008),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--target",
        help="the target the rule predicts for (default: cpu, or h200 for a CUDA device)",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    import opswap.rules.precision.int8_linear as rule_mod
    from opswap.bench.timing import benchmark, describe_device, with_timer
    from opswap.graph.capture import capture
    from opswap.rules.base import sites_of
    from opswap.rules.precision._int8_module import Int8Linear
    from opswap.rules.precision.int8_linear import Int8DynamicLinear
    from opswap.targets import get_target

    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
    except ImportError:
        quantize_ = None
    dev = torch.device(args.device)
    target = with_timer(get_target(args.target or ("cpu" if dev.type == "cpu" else "h200")))
    rule = Int8DynamicLinear()
    rows = []
    torch.manual_seed(0)
    for m, k, n in SHAPES:
        lin = nn.Sequential(nn.Linear(k, n)).eval()
        x = torch.randn(m, k)
        if dev.type == "cuda" and m <= 16:
            m_note = "torch._int_mm on CUDA needs more than 16 rows: the reference path ran"
        else:
            m_note = None
        cap = capture(lin, (x,), method="fx")
        found = rule.match(cap.gm)
        sites = sites_of(found)
        est = rule.predict(cap.gm, sites[0].found, target) if sites else None
        # the roofline the rule uses for other targets, from this target's measured rates
        roof = (
            rule.predict(cap.gm, sites[0].found, dataclasses.replace(target, name="roofline"))
            if sites
            else None
        )
        refused = None if sites else "; ".join(m.reason for m in found if not hasattr(m, "key"))
        before = _fp32_time(target, cap.gm)
        q = Int8Linear(lin[0].weight, lin[0].bias).to(dev)
        lin, xd = lin.to(dev), x.to(dev)
        fns = {"float32": lambda f=lin, a=xd: f(a), "int8": lambda f=q, a=xd: f(a)}
        if quantize_ is not None:  # the library peer: torchao's int8 dynamic quantisation
            tq = copy.deepcopy(lin)
            quantize_(tq, Int8DynamicActivationInt8WeightConfig())
            fns["torchao_int8"] = lambda f=tq, a=xd: f(a)
        with torch.inference_mode():
            ref, got = lin(xd), q(xd)
            err = ((got - ref).norm() / ref.norm()).item()
            res = benchmark(fns, min_time_s=0.5, max_time_s=4.0, rel_width=0.1, device=dev)
        r = res.ratio("float32", "int8")
        if est is not None and est.note.startswith("timed"):  # the rule's own timing
            t32, t8 = rule_mod.time_on_this_cpu(
                m, k, n, True, torch.get_num_threads(), target.timer, rule_mod.cpu_kernel()
            )
            pred = t32 / t8
        else:
            pred = (
                before / (before - est.time_saved_s)
                if est is not None and before > est.time_saved_s
                else None
            )
        row = {
            "m": m,
            "k": k,
            "n": n,
            "float32_ms": res["float32"].median * 1e3,
            "int8_ms": res["int8"].median * 1e3,
            "speedup": r.of_medians,
            # achieved rates, next to the target's ceilings in the file's header
            "float32_gflops": 2 * m * k * n / res["float32"].median / 1e9,
            "int8_gops": 2 * m * k * n / res["int8"].median / 1e9,
            "speedup_ci": [r.ci_low, r.ci_high],
            "rel_l2": err,
            "torchao_int8_ms": (
                res["torchao_int8"].median * 1e3 if "torchao_int8" in fns else None
            ),
            "predicted_speedup": pred,
            "roofline_predicted_speedup": (
                before / (before - roof.time_saved_s)
                if roof is not None and before > roof.time_saved_s
                else None
            ),
            "prediction_note": est.note if est is not None else None,
            "planner_takes_it": est is not None and est.time_saved_s > 0,
            "rule_refuses": refused,
            "note": m_note,
        }
        rows.append(row)
        print(
            json.dumps({k_: (round(v, 4) if isinstance(v, float) else v) for k_, v in row.items()}),
            flush=True,
        )
    agree = sum(
        (r["speedup_ci"][0] > 1.0) == r["planner_takes_it"]
        for r in rows
        if not (r["speedup_ci"][0] <= 1.0 <= r["speedup_ci"][1])
    )
    decided = sum(not (r["speedup_ci"][0] <= 1.0 <= r["speedup_ci"][1]) for r in rows)
    out = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": describe_device(dev),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "target": target.name,
        "ceilings": {
            "float32_gflops": target.peak("float32") / 1e9,
            "int8_gops": target.peak("int8") / 1e9,
            "bandwidth_gb_s": target.mem_bandwidth / 1e9,
        },
        "peer": "float32 nn.Linear in eager (oneDNN/MKL sgemm) and, where installed, torchao's "
        "Int8DynamicActivationInt8WeightConfig in eager, timed interleaved in the same run",
        "rows": rows,
        "prediction_agrees_where_measured_beyond_noise": f"{agree}/{decided}",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"int8_linear_{dev.type}.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print("wrote", path)


def _fp32_time(target, gm) -> float:
    from opswap.cost import node_cost
    from opswap.graph.ops import op_kind
    from opswap.rules._cost import op_time

    node = next(nd for nd in gm.graph.nodes if op_kind(nd) == "linear")
    return op_time(node_cost(node), target, "float32")


if __name__ == "__main__":
    main()
