"""Chapter 8: attention. A tiny BERT from its config (transformers' eager attention: q @ kᵀ,
* scale, + the padding mask, softmax, dropout in eval mode, @ v), planned with
attention.sdpa on this CPU: one site per layer, each replaced by
aten.scaled_dot_product_attention with the scale and the additive mask passed explicitly.
The rewritten model is checked against the original at the example's shapes and at other
batch sizes and sequence lengths.

    python examples/ch08_attention.py
"""

import torch

from opswap.api import capture
from opswap.models import load
from opswap.planner import apply_plan, make_plan


def main() -> None:
    lm = load("hf:bert", {"num_hidden_layers": "2"})  # hidden 64, 4 heads, padded mask
    captured = capture(lm.module, lm.example_inputs)
    plan = make_plan(captured, target="cpu", rules=["attention.sdpa"])
    print(f"== {len(plan.decisions)} attention sites on {captured.method} capture")
    for d in plan.decisions:
        print(f"  site  {d.site.description}")
        print(f"        predicted {d.estimate.time_saved_s * 1e6:.1f} us saved: {d.estimate.note}")
    for m in plan.misses:
        print(f"  miss  {m.where}: {m.reason}")
    applied = apply_plan(captured, plan)
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    calls = [n for n in applied.gm.graph.nodes if n.target is sdpa]
    print(f"== applied: {len(calls)} scaled_dot_product_attention calls")
    with torch.no_grad():
        ref, out = lm.module(*lm.example_inputs)[0], applied.gm(*lm.example_inputs)[0]
    print(f"  max |difference| at the example: {(ref - out).abs().max().item():.2e}")
    worst = 0.0
    for label, xs in captured.variants():  # batch 1, a larger batch, another length
        with torch.no_grad():
            ref, out = lm.module(*xs)[0], applied.gm(*xs)[0]
        diff = (ref - out).abs().max().item()
        worst = max(worst, diff)
        print(f"  {label:<10} {tuple(xs[0].shape)}: max |difference| {diff:.2e}")
    assert len(calls) == 2 and worst < 1e-4


if __name__ == "__main__":
    main()
