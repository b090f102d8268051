"""Chapter 23: the mixed-precision debugger. Which layers must stay in float32 for a model
run in bfloat16 (precision.bf16) to keep its outputs within rel_l2 <= 1%?

The model has one planted sensitive layer: `loud` adds a large value common to all its
outputs, which the LayerNorm after it removes, so what is left is mostly bfloat16's
rounding of the large part. The debugger measures each Linear alone in bfloat16, then keeps
the fewest it can in float32.

The plans are made for a GPU-like profile on which bfloat16 pays at every site: this CPU
(AVX2) has no native bfloat16, and there the rule predicts every site slower and plans
none. Runs in a few seconds on a CPU; writes its report to ./opswap-precision-example.
"""

import torch
from torch import nn

import opswap
from opswap.report.mixed_report import write_report
from opswap.targets.base import Target
from opswap.verify.mixed import debug_precision

WIDTH = 64


class Planted(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)
        self.loud = nn.Linear(WIDTH, WIDTH)
        self.c = nn.Linear(WIDTH, 10)
        self.norm = nn.LayerNorm(WIDTH)
        with torch.no_grad():
            self.loud.weight.normal_(0, 0.02)
            self.loud.weight.add_(torch.randn(1, WIDTH) * 30)  # one row shared by every output
            self.loud.bias.fill_(1e3)

    def forward(self, x):
        h = torch.relu(self.b(torch.relu(self.a(x))))
        h = self.norm(self.loud(h) - 1e3)
        return self.c(h).softmax(-1)


GPU_LIKE = Target(
    name="gpu-like",
    description="bfloat16 at 10x the float32 rate, no launch cost",
    kind="cuda",
    peak_flops={"float32": 1e11, "bfloat16": 1e12},
    mem_bandwidth=1e12,
    memory_bytes=2**34,
    dtypes=("float32", "bfloat16"),
)

torch.manual_seed(0)
model = Planted().eval()
x = torch.randn(8, WIDTH)

found = debug_precision(
    model, (x,), rules=["precision.bf16"], tolerance="rel_l2<=0.01", samples=3, target=GPU_LIKE
)
print(f"{'site':<6} {'op':<8} {'rel_l2 alone':>13} {'cosine alone':>13}  float32")
for s in found.layers:
    kept = "kept" if s.kept else "-"
    print(f"{s.site:<6} {s.op:<8} {s.alone.rel_l2:>13.3g} {s.alone.cosine:>13.6f}  {kept}")
print(
    f"bf16 everywhere: rel_l2 {found.everywhere.rel_l2:.3g}; with "
    f"{', '.join(s.site for s in found.kept) or 'nothing'} in float32: "
    f"rel_l2 {found.result.rel_l2:.3g} ({'passed' if found.passed else 'FAILED'}, "
    f"{found.trials} plans measured)"
)
assert [s.site for s in found.kept] == ["loud"] and found.passed

paths = write_report(found, "opswap-precision-example")
print(f"wrote {paths['report_md']} and {paths['report_html']}")

# The same from the API in one call (and `opswap debug-precision SPEC --rules precision.bf16
# --budget 'rel_l2<=0.01' --target h200 --out DIR` from the shell, for a model spec).
again = opswap.api.debug_precision(model, (x,), budget="rel_l2<=0.01", target=GPU_LIKE)
print(f"api.debug_precision keeps: {[s.site for s in again.kept]}")
