"""Chapter 24: where the time goes, predicted and measured. Profile a model per
ATen op, then optimize it and compare each rule's predicted saving (roofline) with
the saving measured by leaving each rule out (all variants timed in one run).

    python examples/ch24_profiling.py [zoo:bert]
"""

import sys

import torch

from opswap.api import capture
from opswap.bench import format_ops, profile_ops
from opswap.models import load
from opswap.pipeline import measure_rules
from opswap.planner import apply_plan, make_plan


def main(spec: str) -> None:
    loaded = load(spec)
    with torch.inference_mode():
        ops = profile_ops(lambda: loaded.module(*loaded.example_inputs), repeats=5)
    print(f"{spec}: per-op self time (torch profiler, 5 calls)")
    print(format_ops(ops, limit=10))

    captured = capture(loaded.module, loaded.example_inputs)
    plan = make_plan(captured, target="cpu")
    applied = apply_plan(captured, plan)
    print(f"\n{len(applied.applied)} replacements; per rule, predicted vs measured saving:")
    att = measure_rules(captured, plan, applied, min_time_s=0.2)
    print(f"  ({att.method})")
    for t in att.rules:
        print(
            f"  {t.rule:<26} {t.sites:>3} sites  predicted {t.predicted_saved_s * 1e6:8.1f} us"
            f"  measured {t.measured_saved_s * 1e6:8.1f} us  "
            f"[{t.ci_low:.2f}-{t.ci_high:.2f}]  {t.verdict}"
        )
    print(
        f"  sum of the rules {att.sum_saved_ms * 1e3:.1f} us; all rules together "
        f"{att.total_saved_ms * 1e3:.1f} us"
    )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "zoo:bert")
