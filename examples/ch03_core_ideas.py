"""Chapter 3: rules, sites, misses and plans. List the rules, plan on a model,
save the plan, edit it (drop one decision), and re-apply the edited plan.

    python examples/ch03_core_ideas.py
"""

import tempfile
from pathlib import Path

import torch

import opswap
from opswap.planner import Plan


def main() -> None:
    for r in opswap.rules.all_rules():
        print(f"{r.name:<28} ch.{r.chapter:<3} {r.exactness:<7} {','.join(r.targets)}")
    loaded = opswap.load("zoo:bert")
    plan = opswap.plan(loaded.module, loaded.example_inputs, rules="fusion.*,layout.*")
    print(f"\n{len(plan.decisions)} decisions, {len(plan.misses)} misses")
    for m in plan.misses[:5]:
        print(f"  miss {m.rule} at {m.where}: {m.reason}")
    path = Path(tempfile.mkdtemp(prefix="opswap-ch03-")) / "plan.json"
    plan.save(path)
    edited = Plan.load(path)
    dropped = edited.decisions.pop(0)  # a user can review and edit plan.json by hand
    print(f"dropped {dropped.rule} at {dropped.site.key}")
    candidate = opswap.apply(loaded.module, loaded.example_inputs, edited)
    with torch.no_grad():
        ref, out = loaded.module(*loaded.example_inputs), candidate(*loaded.example_inputs)
    print("max abs difference:", (ref - out).abs().max().item())


if __name__ == "__main__":
    main()
