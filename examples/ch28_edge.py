"""Chapter 28: edge targets. A tiny LLaMA-style decoder (zoo:gpt: RMSNorm written out, a
causal mask applied with masked_fill, rank-4 attention matmuls) is read against the XNNPACK
profile: which compute ops ExecuTorch's default export leaves outside the delegate, and
why. Planned for the `xnnpack` edge target, the legalisation rules rewrite those ops into
XNNPACK's op set; the edge race then lowers both programs, verifies them against the model
and times them, and saves the faster file. Last, the same model read against the Hexagon
NPU's (QNN HTP) op set, from the op-set description alone.

    python examples/ch28_edge.py [OUT_DIR]
"""

import sys
import tempfile

import torch

import opswap
from opswap.bench.edge import edge_race
from opswap.models.zoo_transformer import gpt
from opswap.targets.edge import delegation


def main(out_dir: str) -> None:
    model, inputs = gpt(batch=1, seq=16, hidden=48, heads=4, layers=1, intermediate=128)
    model = model.eval()

    before = delegation(torch.export.export(model, inputs).run_decompositions(), "xnnpack")
    print(f"the model as written: {before.compute_share:.0%} of compute ops on XNNPACK")
    for why in sorted({f"{r.op}: {r.reason}" for r in before.outside if r.compute}):
        print("  outside:", why)

    plan = opswap.plan(model, inputs, target="xnnpack")
    legal = [d.rule for d in plan.decisions if d.rule.startswith("legalize.")]
    print("legalisation:", ", ".join(f"{r} x{legal.count(r)}" for r in dict.fromkeys(legal)))

    race = edge_race(model, inputs, out_dir, rounds=20, memory=False)
    for e in race.entries:
        share = e.delegation.compute_share if e.delegation else float("nan")
        print(
            f"{e.name:18s} verified={e.verified} cosine={e.cosine:.6f} "
            f"compute ops on XNNPACK={share:.0%} median={e.ms:.3f} ms"
        )
    print(f"winner: {race.winner}, saved as {race.saved}")

    qnn = delegation(torch.export.export(model, inputs).run_decompositions(), "qnn-htp")
    print(
        f"QNN HTP op set (description only, no SDK here): {qnn.compute_share:.0%} of compute "
        f"ops; the first left out: {qnn.outside[0].op}: {qnn.outside[0].reason}"
    )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())
