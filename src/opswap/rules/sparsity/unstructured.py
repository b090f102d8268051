"""sparsity.unstructured: a Linear -> its weight pruned by magnitude to SPARSITY (90%) and
stored sparse, CSR on the CPU (single entries) and BSR on a GPU (32 x 32 or 16 x 16 blocks,
pruned by block norm), multiplied by torch.sparse.

Why: at 90% zeros and more a sparse product reads a tenth of the weight, and where the
layer is bound by reading its weight (few rows, a large matrix) that can beat the dense
GEMM; below that the indexing overhead of CSR and the irregular access lose to a dense
kernel that runs at the machine's peak. Which wins moves with the shape, the sparsity,
the thread count and the library, so each site is timed on the target at its own shape
(dense against sparse, same process) and kept only where the sparse layer is faster.

Lossy: 90% of each weight is dropped. Without fine-tuning (opswap.train.finetune_sparse
keeps the zeros while it trains) few models survive it; the accuracy on the model's task
is reported when it has one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.precision._lowbit import install
from opswap.rules.registry import register
from opswap.rules.sparsity import _site
from opswap.rules.sparsity._modules import SparseLinear
from opswap.targets.base import Target, Timer

#: the share of each weight the rule drops (the issue's "90% and up")
SPARSITY = 0.9
#: the block sides BSR may use on a GPU, largest first (Triton's bsr_dense_mm takes >= 16)
BLOCKS = (32, 16)


def layout(device: torch.device, n: int, k: int) -> int | str:
    """The block side for a [n, k] weight on `device` (1: CSR), or why none fits."""
    if device.type != "cuda":
        return 1
    for b in BLOCKS:
        if n % b == 0 and k % b == 0:
            return b
    return f"its weight is {n} x {k}, not a multiple of {BLOCKS[-1]} x {BLOCKS[-1]} blocks (BSR)"


def time_site(
    m: int,
    k: int,
    n: int,
    dtype: torch.dtype,
    device: str,
    bias: bool,
    block: int,
    timer: Timer,
) -> tuple[float, float]:
    """(dense, sparse) seconds of a Linear at this shape, sparsity and layout."""

    def make() -> tuple[Callable[[], Any], Callable[[], Any]]:
        x, w, b = _site.random_linear(m, k, n, dtype, device, bias)
        sparse = SparseLinear(w, b, SPARSITY, block)
        return _site.dense_call(x, w, b), lambda: sparse(x)

    return _site.timed(("sparse", m, k, n, dtype, device, bias, block), timer, make)


@register
class Unstructured(Rule):
    """Linear -> SparseLinear (magnitude-pruned to 90%, CSR on the CPU, BSR on a GPU),
    where it measures faster than the dense layer at the site's shape on the target."""

    name = "sparsity.unstructured"
    family = "sparsity"
    chapter = 7
    exactness = "lossy"
    targets = ("cpu", "cuda")
    after = ("fusion.*", "sparsity.semi_structured")
    relieves = ("memory:matmul",)
    anchors = ("linear",)
    description = (
        "Linear -> weight magnitude-pruned to 90%, CSR (CPU) or BSR (GPU) sparse matmul; "
        "kept only where measured faster than dense at the site's shape (lossy)."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        site = _site.read_site(gm, node)
        if not isinstance(site, _site.Site):
            return site
        weight = site.w.weight
        on_gpu = weight.device.type == "cuda"
        allowed = (torch.float32, torch.bfloat16, torch.float16) if on_gpu else (torch.float32,)
        if weight.dtype not in allowed:
            name = str(weight.dtype).removeprefix("torch.")
            return Refused(
                f"{node.name}'s weight is {name}; the sparse product on the {weight.device.type} "
                f"takes {', '.join(str(d).removeprefix('torch.') for d in allowed)}"
            )
        block = layout(weight.device, site.n, site.k)
        if isinstance(block, str):
            return Refused(f"{node.name}: {block}")
        how = "CSR" if block == 1 else f"BSR {block}x{block}"
        return Found(
            (node,),
            f"{node.name} ({site.k} -> {site.n}) {100 * SPARSITY:g}% sparse, {how}",
            dict(w=site.w, rows=site.rows, block=block),
            record=dict(linear=node.name, layout=how, sparsity=SPARSITY),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        node, w = found.nodes[0], found["w"]
        install(gm, node, SparseLinear(w.weight, w.bias, SPARSITY, found["block"]), "sparse")

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        w, m, block = found["w"], found["rows"], found["block"]
        n, k = w.weight.shape
        where = f"{m} x {k} -> {n}"
        timer = getattr(target, "timer", None)
        kind = getattr(target, "kind", "")
        device = "cuda" if block > 1 else "cpu"
        if timer is None or kind != ("cuda" if block > 1 else "cpu"):
            return Estimate(
                0.0,
                0.0,
                -1e-9,
                f"{where}: needs a measurement on the target (kept only where faster than "
                "dense), and this plan has no timer for it",
            )
        dense, sparse = time_site(m, k, n, w.weight.dtype, device, w.bias is not None, block, timer)
        ratio = dense / sparse if sparse > 0 else 0.0
        note = (
            f"timed at {where}, {100 * SPARSITY:g}% zeros: dense {dense * 1e6:.1f} us, "
            f"sparse {sparse * 1e6:.1f} us ({ratio:.2f}x)"
        )
        if ratio <= 1.0:
            return Estimate(0.0, 0.0, -abs(sparse - dense) - 1e-9, note)
        return Estimate(
            0.0, float(SPARSITY * k * n * w.weight.element_size()), dense - sparse, note
        )
