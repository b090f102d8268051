"""sparsity.semi_structured: a bfloat16/float16 Linear -> its weight pruned to 2:4 (two of
every four inputs of each output row, by magnitude) and held compressed, multiplied on
the sparse tensor cores by cuSPARSELt or CUTLASS (`torch.sparse.to_sparse_semi_structured`).

Why: a 2:4 weight moves half the values (plus 2-bit indices) and the sparse tensor cores
skip the zeros, so a compute-bound GEMM can run up to 2x faster. In practice far less, and
often slower: at small batch the layer is bound by memory and launch, not by the tensor
cores, and on H100 the dense bf16 GEMM is fast enough that cuSPARSELt wins only on large
GEMMs (torchao's best end-to-end figure is 1.16x, SAM on A100). So the rule measures each
site at its real shape on the target and keeps it only at MIN_SPEEDUP (1.05x) over the
dense layer or better; without a measurement on the target it takes nothing.

Lossy: half of every weight is dropped. The accuracy change is measured on the model's
task when it has one; opswap.train.finetune_sparse fine-tunes with the 2:4 mask kept.
The backend follows `torch.sparse.SparseSemiStructuredTensor._FORCE_CUTLASS` (CUTLASS when
set or when cuSPARSELt is missing). FP8 + 2:4 against FP8 dense is measured with torchao's
sparse FP8 format in benchmarks/bench_sparsity.py.
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
from opswap.rules.sparsity._modules import (
    SemiSparseLinear,
    semi_structured_backend,
    semi_structured_shape_reason,
)
from opswap.targets.base import Target, Timer

#: a site is kept only where the sparse layer measures at least this much faster (the
#: issue's bar: 2:4's users' first complaint is that it is slower at small batch)
MIN_SPEEDUP = 1.05
HALF = (torch.bfloat16, torch.float16)


def device_reason(device: torch.device) -> str | None:
    """Why 2:4 sparse tensor cores cannot run on `device`, or None."""
    if device.type != "cuda":
        return (
            f"is on the {device.type}: to_sparse_semi_structured runs only on CUDA GPUs of "
            "compute capability 8.0 or later (cuSPARSELt or CUTLASS kernels)"
        )
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 0):
        return f"is on a GPU of compute capability {cap[0]}.{cap[1]}; 2:4 needs 8.0 or later"
    return None


def time_site(
    m: int, k: int, n: int, dtype: torch.dtype, bias: bool, backend: str, timer: Timer
) -> tuple[float, float]:
    """(dense, 2:4) seconds of a Linear at this shape on this machine's GPU."""

    def make() -> tuple[Callable[[], Any], Callable[[], Any]]:
        x, w, b = _site.random_linear(m, k, n, dtype, "cuda", bias)
        sparse = SemiSparseLinear(w, b, backend)
        return _site.dense_call(x, w, b), lambda: sparse(x)

    return _site.timed(("2:4", m, k, n, dtype, bias, backend), timer, make)


@register
class SemiStructured(Rule):
    """bfloat16/float16 Linear -> SemiSparseLinear (2:4 by magnitude, compressed), where it
    measures at least 1.05x the dense layer at the site's shape on the target."""

    name = "sparsity.semi_structured"
    family = "sparsity"
    chapter = 7
    exactness = "lossy"
    targets = ("cuda",)
    after = ("fusion.*",)
    relieves = ("compute:matmul",)
    anchors = ("linear",)
    description = (
        "bfloat16/float16 Linear -> 2:4 weight (magnitude), cuSPARSELt/CUTLASS sparse tensor "
        "cores; kept only where measured >= 1.05x dense at the site's shape (lossy)."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        site = _site.read_site(gm, node)
        if not isinstance(site, _site.Site):
            return site
        weight = site.w.weight
        why = device_reason(weight.device)
        if why:
            return Refused(f"{node.name}'s weight {why}")
        if weight.dtype not in HALF:
            name = str(weight.dtype).removeprefix("torch.")
            return Refused(
                f"{node.name}'s weight is {name}; 2:4 is offered for bfloat16 and float16 "
                "layers (cast the model to bfloat16 first)"
            )
        backend = semi_structured_backend()
        why = semi_structured_shape_reason(site.n, site.k, weight.dtype, backend)
        if why:
            return Refused(f"{node.name}: {why}")
        return Found(
            (node,),
            f"{node.name} ({site.k} -> {site.n}) with a 2:4 weight ({backend})",
            dict(w=site.w, rows=site.rows, backend=backend),
            record=dict(linear=node.name, backend=backend),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        node, w = found.nodes[0], found["w"]
        install(gm, node, SemiSparseLinear(w.weight, w.bias, found["backend"]), "sparse24")

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        w, m = found["w"], found["rows"]
        n, k = w.weight.shape
        where = f"{m} x {k} -> {n}"
        if getattr(target, "kind", "") != "cuda":
            return Estimate(0.0, 0.0, -1e-9, f"{where}: 2:4 runs on CUDA GPUs only")
        timer = getattr(target, "timer", None)
        if timer is None:
            return Estimate(
                0.0,
                0.0,
                -1e-9,
                f"{where}: needs a measurement on the target (kept only at >= {MIN_SPEEDUP}x "
                "dense), and this plan has no timer for it",
            )
        dense, sparse = time_site(
            m, k, n, w.weight.dtype, w.bias is not None, found["backend"], timer
        )
        ratio = dense / sparse if sparse > 0 else 0.0
        measured = (
            f"timed at {where}: dense {dense * 1e6:.1f} us, 2:4 {sparse * 1e6:.1f} us "
            f"({ratio:.2f}x)"
        )
        if ratio < MIN_SPEEDUP:
            return Estimate(
                0.0, 0.0, -abs(sparse - dense) - 1e-9, f"{measured}, below {MIN_SPEEDUP}x"
            )
        return Estimate(0.0, float(k * n), dense - sparse, measured)
