"""Chapter 25: the joint search. Plan a small model greedily, then let the joint search
measure whole plans (sites left out, variants forced) and keep the fastest within the
budget; print every plan it measured, the Pareto front and the choice, and write the
report with its latency-against-error plot.

    python examples/ch25_search.py [zoo:resnet] [evaluations]
"""

import sys
import tempfile
from pathlib import Path

from opswap.config import OptimizeConfig
from opswap.models import load
from opswap.pipeline import optimize


def main(spec: str, evaluations: int) -> None:
    loaded = load(spec, {"width": "8", "image_size": "16", "batch": "2"})
    # the search plans again for each candidate: the database keeps the site timings
    # (conv.algorithm's race) that planning makes, so each is timed once
    db = Path(tempfile.mkdtemp()) / "tuning.sqlite"
    config = OptimizeConfig(
        exactness="exact",  # fusions and layout: the quickest space to search
        search="joint",
        search_budget=evaluations,
        samples=1,
        dynamic="none",
        bench=False,  # the race is chapter 3's; the search times its plans itself
        layers=False,
        tuning_db=str(db),
    )
    result = optimize(loaded.module, loaded.example_inputs, config, name=spec)
    found = result.plan.search
    if found is None:
        print(f"{spec}: no rule applies, nothing to search")
        return
    print(f"{spec}: {found['evaluations']} plans measured in {found['seconds']:.1f} s")
    for p in found["points"]:
        mark = "front" if p["on_front"] else ""
        mark += " chosen" if p["chosen"] else ""
        ok = "in budget" if p["within_budget"] else "beyond budget"
        print(
            f"  {p['how']:<7} {p['latency_ms']:8.3f} ms  error {p['error']:.1e}  {ok:<13} "
            f"{mark:<12} {p['choices'][:60]}"
        )
    g, c = found["greedy"], found["chosen"]
    print(
        f"greedy {g['latency_ms']:.3f} ms -> chosen {c['latency_ms']:.3f} ms"
        + (" (greedy's plan kept)" if found["kept_greedy"] else "")
    )
    out = Path(tempfile.mkdtemp())
    result.save(out)
    print(f"report with the Pareto plot: {out / 'report.md'}")


if __name__ == "__main__":
    main(
        sys.argv[1] if len(sys.argv) > 1 else "zoo:resnet",
        int(sys.argv[2]) if len(sys.argv) > 2 else 5,
    )
