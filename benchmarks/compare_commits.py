"""The zoo races of two commits side by side: does a refactor change a plan or a figure?

    python benchmarks/compare_commits.py --tree before=/path/to/old --tree after=/path/to/new \
        --rounds 2 --work /tmp/cmp

Each tree is a checkout (a git worktree of the commit); its `opswap optimize zoo:MODEL
--target cpu` runs with that tree's src first on PYTHONPATH, the trees alternating per
model and per round so that a slow spell of the machine falls on both. The JSON gives,
per model, round and tree, every variant's speed-up over the input with its 95% interval,
the saved variant, and whether the applied (rule, site) pairs equal the first tree's in the
same round. Within noise means: the trees differ by no more than one tree differs from
itself between rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _results import write_results

MODELS = ("resnet", "mobilenet", "bert", "gpt")


def run_one(tree: Path, model: str, out: Path) -> float:
    """`opswap optimize zoo:model --target cpu` from `tree`'s sources; its wall seconds."""
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    t0 = time.perf_counter()
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(
            [sys.executable, "-m", "opswap.cli", "optimize", f"zoo:{model}", "--target", "cpu"]
            + ["--out", str(out)],
            cwd=tree,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            check=True,
            timeout=900,
        )
    return time.perf_counter() - t0


def summary(result: dict) -> dict:
    """The race of one result.json: speed-ups with intervals, the winner, the plan."""
    return {
        "variants": {
            v["name"]: {
                "speedup_vs_input": round(v["speedup_vs_input"], 3),
                "ci95": [round(c, 3) for c in v["speedup_ci"]],
                "verified": v["verified"],
            }
            for v in result["variants"]
        },
        "saved": result["best"],
        "plan": sorted([a["rule"], str(a.get("site"))] for a in result["applied"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", action="append", required=True, help="NAME=PATH, two or more")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--work", type=Path, required=True, help="where the runs write")
    ap.add_argument(
        "--collect", action="store_true", help="only read earlier runs from --work, run nothing"
    )
    ap.add_argument("--note", default="", help="what the JSON should say of the runs")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--name", default="compare_commits_cpu.json")
    args = ap.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree)
    rows = []
    for r in range(args.rounds):
        for model in args.models.split(","):
            first_plan = None
            for name, path in trees.items():
                out = args.work / f"round{r}" / name / model
                seconds = None
                if not args.collect:
                    out.parent.mkdir(parents=True, exist_ok=True)
                    seconds = round(run_one(Path(path), model, out), 1)
                s = summary(json.loads((out / "result.json").read_text()))
                first_plan = s["plan"] if first_plan is None else first_plan
                s["plan_equals_first_tree"] = s["plan"] == first_plan
                rows.append({"round": r, "model": model, "tree": name, "seconds": seconds, **s})
    commits = {
        name: subprocess.run(
            ["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        for name, path in trees.items()
    }
    write_results(
        args.out,
        args.name,
        "cpu",
        rows,
        commits=commits,
        cpu_count=os.cpu_count(),
        loadavg=None if args.collect else os.getloadavg(),
        note=args.note,
    )


if __name__ == "__main__":
    main()
