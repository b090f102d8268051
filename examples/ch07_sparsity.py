"""Chapter 7: sparsity.

1. Structured pruning: half the channels of a ResNet-style CNN and half the heads and MLP
   width of a BERT-style encoder removed by opswap.train.prune (the groups it found, the
   parameters and MACs before and after, the model physically smaller).
2. Pruning on the digits task: the CNN trained on scikit-learn's digits, pruned at 0.5 and
   fine-tuned one epoch, with top-1 before and after (opswap.train.finetune_sparse).
3. The sparsity rules: a 2:4 weight (sparsity.semi_structured) is refused on the CPU with
   its reason; a 90% CSR Linear (sparsity.unstructured) computes the masked dense layer.

    python examples/ch07_sparsity.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from opswap.graph.capture import capture
from opswap.models.zoo_cnn import resnet
from opswap.models.zoo_digits import digits_cnn
from opswap.models.zoo_transformer import bert
from opswap.planner import apply_plan, make_plan
from opswap.rules.sparsity._modules import sparse_reference
from opswap.train.finetune_pooling import digits_batches
from opswap.train.finetune_sparse import fine_tune_masked
from opswap.train.prune import prune


def structured() -> None:
    for name, (model, x) in {"resnet": resnet()[:2], "bert": bert(seq=16)[:2]}.items():
        p = prune(model.eval(), x, 0.5)
        print(f"{name}: parameters {p.params_before} -> {p.params_after}, "
              f"MACs {p.macs_before} -> {p.macs_after}")  # fmt: skip
        for g in p.groups:
            state = f"kept whole: {g.blocked}" if g.blocked else f"{g.size} -> {g.kept}"
            print(f"  {g.name:40s} {state}")
    print("  attention of layer 0:", p.model.layers[0].attention.heads, "heads")


def digits() -> None:
    model, example, task = digits_cnn()
    p = prune(model, example, 0.5, keep=["head"])
    pruned = task.evaluate(p.model)
    fine_tune_masked(p.model, digits_batches(shape=(1, 8, 8)), epochs=1.0)
    print(f"digits CNN: top-1 {task.evaluate(model):.3f}; pruned to "
          f"{p.params_after / p.params_before:.0%} of its parameters {pruned:.3f}; "
          f"fine-tuned 1 epoch {task.evaluate(p.model):.3f}")  # fmt: skip


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(128, 512), nn.Linear(512, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(x)))


def rules() -> None:
    torch.manual_seed(0)
    model, x = MLP().eval(), torch.randn(8, 128)
    cap = capture(model, (x,))
    plan = make_plan(cap, rules=["sparsity.semi_structured"], exactness="lossy", target="h100")
    print("2:4 on the CPU:", plan.misses[0].reason)
    plan = make_plan(cap, rules=["sparsity.unstructured"], exactness="lossy", keep_slower=True)
    gm = apply_plan(cap, plan).gm
    print("90% CSR:", [str(m) for m in gm.modules() if type(m).__name__ == "SparseLinear"][0])
    with torch.no_grad():
        h = F.relu(sparse_reference(x, model.up.weight, model.up.bias, 0.9, 1))
        want = sparse_reference(h, model.down.weight, model.down.bias, 0.9, 1)
        print(f"max |CSR - masked dense| {float((gm(x) - want).abs().max()):.1e}")
    print("kept only where faster: opswap optimize times each site (benchmarks/bench_sparsity.py)")


if __name__ == "__main__":
    torch.set_num_threads(1)
    structured()
    digits()
    rules()
