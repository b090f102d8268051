"""Chapter 6: low precision. An MLP-heavy encoder block in float32; `opswap.optimize` with
exactness "approx" quantises its big Linears to int8 (weights per channel once, inputs per
row on every call, int32-accumulated integer GEMM), refuses the small ones with the
reason, verifies the result against the approx tolerance at other batch and sequence
sizes, and times it against the float32 model; then the same with a budget too strict
for int8, where verification rolls the int8 sites back.

    python examples/ch06_low_precision.py
"""

import tempfile

import torch
from torch import nn

import opswap


class Block(nn.Module):
    """Pre-norm transformer MLP block plus a small classifier head."""

    def __init__(self, d: int = 768, hidden: int = 3072, classes: int = 4):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, hidden), nn.Linear(hidden, d)
        self.head = nn.Linear(d, classes)  # 4 outputs: too small to pay in int8

    def forward(self, x):  # x: [batch, tokens, d]
        x = x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
        return self.head(x.mean(1))


def main() -> None:
    torch.manual_seed(0)
    model = Block().eval()
    x = torch.randn(4, 32, 768)  # 128 rows per Linear call

    r = opswap.optimize(model, (x,), exactness="approx", compare="none", samples=3)
    int8 = [d for d in r.plan.decisions if d.rule == "precision.int8_linear"]
    print(f"int8 sites: {len(int8)}: " + ", ".join(d.site.key for d in int8))
    for m in r.plan.misses:
        if m.rule == "precision.int8_linear":
            print(f"  not {m.where}: {m.reason}")
    v = r.verification
    print(
        f"verification {'PASSED' if v.passed else 'FAILED'} against the approx tolerance: "
        f"cosine {v.cosine:.6f}, rel_l2 {v.rel_l2:.2e}, SQNR {v.sqnr_db:.1f} dB "
        f"({', '.join(v.shapes)})"
    )
    b = r.benchmark
    print(
        f"float32 {b.ref_ms:.2f} ms -> int8 {b.opt_ms:.2f} ms: "
        f"{b.speedup_of_medians:.2f}x [{b.speedup_ci[0]:.2f}-{b.speedup_ci[1]:.2f}] "
        f"on {b.device}; saved: {r.best}"
    )

    with tempfile.TemporaryDirectory() as out:
        r.save(out)
        loaded = opswap.load_optimized(out)
        with torch.inference_mode():
            x1 = torch.randn(3, 32, 768)  # another batch size (the batch dim stays dynamic)
            err = (loaded(x1) - model(x1)).norm() / model(x1).norm()
        print(f"model.pt2 reloaded, at batch 3: relative L2 error {err:.2e}")

    strict = opswap.optimize(
        model, (x,), exactness="approx", samples=2, budget="sqnr_db>=60", bench=False
    )
    left = sum(d.rule == "precision.int8_linear" for d in strict.plan.decisions)
    print(
        f"with --budget sqnr_db>=60 (int8 gives ~40 dB): {len(strict.rolled_back)} "
        f"rolled back, {left} int8 sites left, verification "
        f"{'PASSED' if strict.verification.passed else 'FAILED'}"
    )


if __name__ == "__main__":
    main()
