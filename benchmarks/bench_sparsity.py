"""Sparse matmul (chapter 7) against dense, on the CPU and the GPU.

    PYTHONPATH=src python3 benchmarks/bench_sparsity.py                 # CPU (1 thread)
    PYTHONPATH=src python3 benchmarks/bench_sparsity.py --device cuda   # GPU: 2:4 and BSR

CPU: a Linear's weight magnitude-pruned to 90, 95 and 99% and stored CSR
(opswap's SparseLinear: one addmm of the sparse weight with the transposed input) against
the dense float32 Linear, at decode-like (1 and 8 rows) and prefill-like shapes; beside
them torch's own sparse products: x @ W^T with the same pruned W^T stored CSR
(torch_csr_*: dense times sparse, the other order from ours), and W @ x^T with W stored BSR
in 32 x 32 blocks pruned to the same share (torch_bsr32_*: other zeros, so its cosine
differs).

GPU (bfloat16):
- the ViT-H MLP GEMMs (1280 -> 5120 and 5120 -> 1280) at 257 tokens x batch 1, 8, 32 and
  64: dense (cuBLAS), 2:4 through cuSPARSELt and through CUTLASS (opswap's
  SemiSparseLinear), torchao's `sparsify_(SemiSparseWeightConfig())` as the peer, and
  FP8 dense (torchao, row-wise) against FP8 + 2:4 (torchao's sparse FP8 packing), with
  TFLOP/s counted as the dense GEMM's 2*M*K*N (the work the layer stands for);
- the ViT-H MLP stack end to end (32 blocks of LayerNorm, up, GELU, down, residual) at
  the same batches: dense, every Linear 2:4 (cuSPARSELt), what `sparsity.semi_structured`
  keeps on the H100/H200 target with its timer (sites at >= 1.05x only), and torchao;
  the output's cosine and relative L2 against dense beside each time (the accuracy
  change of 2:4 without fine-tuning on random weights: a lower bound on what it costs);
- unstructured BSR (32 x 32 blocks, Triton's bsr_dense_mm) at 90/95/99% on the same GEMMs.

Writes DIR/sparsity_<card>.json (cpu, h100 or h200) with the date, device and versions.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from _results import card, compare_variants, write_results  # noqa: E402

from opswap.rules.sparsity._modules import SemiSparseLinear, SparseLinear  # noqa: E402

CPU_SHAPES = [(1, 4096, 4096), (8, 2048, 2048), (64, 1024, 4096), (257, 1280, 5120)]
SPARSITIES = (0.9, 0.95, 0.99)
VIT_H = (1280, 5120)
BATCHES = (1, 8, 32, 64)
TOKENS = 257


def _tflops(rows: list[dict], m: int, k: int, n: int) -> None:
    for r in rows:
        r["tflops_dense_equivalent"] = 2 * m * k * n / (r["ms"] * 1e-3) / 1e12


def cpu_rows(quick: bool) -> list[dict]:
    out = []
    for m, k, n in CPU_SHAPES[:2] if quick else CPU_SHAPES:
        g = torch.Generator().manual_seed(0)
        w, b = torch.randn(n, k, generator=g) / k**0.5, torch.randn(n, generator=g)
        x = torch.randn(m, k, generator=g)
        fns: dict[str, Any] = {"dense": lambda x, w=w, b=b: F.linear(x, w, b)}
        for s in SPARSITIES:
            ours = SparseLinear(w, b, s)
            fns[f"csr_{int(100 * s)}"] = ours
            # the peers, torch's own sparse products (F.linear with a sparse weight fails
            # under inference mode, torch 2.13): x @ W^T with W^T stored CSR (dense x
            # sparse, the other order from ours), and W @ x^T with W stored BSR in blocks
            # of 32 x 32 pruned to the same share (whole blocks dropped: other zeros)
            wt = (w * (ours.sparse_weight().to_dense() != 0)).t().contiguous().to_sparse_csr()
            bsr = SparseLinear(w, b, s, block=32).sparse_weight()
            fns[f"torch_csr_{int(100 * s)}"] = lambda x, wt=wt, b=b: torch.addmm(b, x, wt)
            fns[f"torch_bsr32_{int(100 * s)}"] = lambda x, ws=bsr, b=b: torch.addmm(
                b[:, None], ws, x.t()
            ).t()
        rows = compare_variants(fns, (x,), "dense", min_time_s=0.5, max_time_s=4.0)
        _tflops(rows, m, k, n)
        for r in rows:
            r.update(kind="unstructured_cpu", m=m, k=k, n=n, threads=torch.get_num_threads())
            print(r, flush=True)
        out += rows
    return out


def _torchao_24(linear: nn.Linear) -> nn.Module | str:
    """torchao's 2:4 layer of a copy of `linear`, or why not."""
    try:
        from torchao.sparsity import SemiSparseWeightConfig, sparsify_

        from opswap.rules.sparsity._masks import mask_2_4

        mod = nn.Sequential(copy.deepcopy(linear))
        with torch.no_grad():
            mod[0].weight.mul_(mask_2_4(mod[0].weight))
        sparsify_(mod, SemiSparseWeightConfig())
        return mod
    except Exception as exc:  # noqa: BLE001 - a peer that does not run says why
        return f"{type(exc).__name__}: {exc}"[:200]


def _torchao_fp8(linear: nn.Linear, sparse: bool) -> nn.Module | str:
    """torchao's FP8 row-wise layer (dense or 2:4-packed) of a copy of `linear`, or why not."""
    try:
        from torchao.quantization import (
            Float8DynamicActivationFloat8WeightConfig,
            PerRow,
            quantize_,
        )
        from torchao.quantization.quantize_.workflows.float8.float8_packing_format import (
            Float8PackingFormat,
        )

        from opswap.rules.sparsity._masks import mask_2_4

        mod = nn.Sequential(copy.deepcopy(linear))
        fmt = Float8PackingFormat.PLAIN
        if sparse:
            with torch.no_grad():
                mod[0].weight.mul_(mask_2_4(mod[0].weight))
            fmt = Float8PackingFormat.SPARSE_2D_DATA_2D_METADATA
        quantize_(
            mod, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), packing_format=fmt)
        )
        return mod
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"[:200]


def _runnable(fns: dict[str, Any], x: torch.Tensor, skipped: dict[str, str]) -> None:
    """Drop (into `skipped`, with the error) the variants that fail on `x`."""
    for name in [k for k in fns if k != "dense"]:
        try:
            with torch.inference_mode():
                fns[name](x)
        except Exception as exc:  # noqa: BLE001 - one variant failing is a result
            skipped[name] = f"{type(exc).__name__}: {exc}"[:200]
            del fns[name]


def gemm_rows(quick: bool) -> list[dict]:
    out = []
    hidden, inner = VIT_H
    for batch in BATCHES[1:3] if quick else BATCHES:
        m = TOKENS * batch
        for k, n in ((hidden, inner), (inner, hidden)):
            torch.manual_seed(0)
            lin = nn.Linear(k, n).to("cuda", torch.bfloat16)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            fns: dict[str, Any] = {"dense": lin}
            skipped: dict[str, str] = {}
            for backend in ("cusparselt", "cutlass"):
                try:
                    fns[f"2:4_{backend}"] = SemiSparseLinear(lin.weight, lin.bias, backend)
                except Exception as exc:  # noqa: BLE001
                    skipped[f"2:4_{backend}"] = f"{type(exc).__name__}: {exc}"[:200]
            for name, mod in (
                ("torchao_2:4", _torchao_24(lin)),
                ("fp8_dense", _torchao_fp8(lin, False)),
                ("fp8_2:4", _torchao_fp8(lin, True)),
            ):
                if isinstance(mod, str):
                    skipped[name] = mod
                else:
                    fns[name] = mod
            for s in SPARSITIES:
                fns[f"bsr32_{int(100 * s)}"] = SparseLinear(lin.weight, lin.bias, s, block=32)
            _runnable(fns, x, skipped)
            rows = compare_variants(
                fns, (x,), "dense", device="cuda", min_time_s=0.5, max_time_s=5.0
            )
            _tflops(rows, m, k, n)
            fp8 = next((r for r in rows if r["name"] == "fp8_dense"), None)
            for r in rows:
                r.update(kind="gemm", batch=batch, m=m, k=k, n=n)
                if fp8 is not None and r["name"] == "fp8_2:4":
                    r["speedup_vs_fp8_dense"] = fp8["ms"] / r["ms"]
                print(r, flush=True)
            out += rows + [
                {"kind": "gemm", "batch": batch, "m": m, "k": k, "n": n, "name": k2, "skipped": v}
                for k2, v in skipped.items()
            ]
    return out


class Block(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up, self.down = nn.Linear(hidden, inner), nn.Linear(inner, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def _every_linear_24(model: nn.Module) -> nn.Module:
    out = copy.deepcopy(model)
    for block in out:
        for name in ("up", "down"):
            lin = getattr(block, name)
            setattr(block, name, SemiSparseLinear(lin.weight, lin.bias, "cusparselt"))
    return out


def _opswap_plan(model: nn.Module, x: torch.Tensor) -> tuple[nn.Module, dict]:
    """What sparsity.semi_structured keeps on this GPU's target with its timer."""
    from opswap.bench.timing import with_timer
    from opswap.graph.capture import capture
    from opswap.planner import apply_plan, make_plan
    from opswap.targets import get_target

    target = with_timer(get_target(card() if card() in ("h100", "h200") else "h100"))
    cap = capture(model, (x,))
    plan = make_plan(cap, rules=["sparsity.semi_structured"], exactness="lossy", target=target)
    kept = len(plan.decisions)
    notes = sorted({s.reason for s in plan.skipped})[:4]
    return apply_plan(cap, plan).gm, {
        "sites_kept": kept,
        "sites_skipped": len(plan.skipped),
        "skip_reasons": notes,
    }


def stack_rows(quick: bool, layers: int) -> list[dict]:
    out = []
    hidden, inner = VIT_H
    torch.manual_seed(0)
    model = (
        nn.Sequential(*(Block(hidden, inner) for _ in range(layers)))
        .to("cuda", torch.bfloat16)
        .eval()
    )
    try:
        every: nn.Module | None = _every_linear_24(model)
    except Exception as exc:  # noqa: BLE001 - no cuSPARSELt: say so in every row
        every, every_err = None, f"{type(exc).__name__}: {exc}"[:200]
    ao = copy.deepcopy(model)
    try:
        from torchao.sparsity import SemiSparseWeightConfig, sparsify_

        from opswap.rules.sparsity._masks import mask_2_4

        with torch.no_grad():
            for mod in ao.modules():
                if isinstance(mod, nn.Linear):
                    mod.weight.mul_(mask_2_4(mod.weight))
        sparsify_(ao, SemiSparseWeightConfig())
        ao_err = None
    except Exception as exc:  # noqa: BLE001
        ao_err = f"{type(exc).__name__}: {exc}"[:200]
    for batch in BATCHES[1:3] if quick else BATCHES:
        x = torch.randn(batch, TOKENS, hidden, device="cuda", dtype=torch.bfloat16)
        fns: dict[str, Any] = {"dense": model}
        if every is not None:
            fns["2:4_every_linear"] = every
        if ao_err is None:
            fns["torchao_2:4"] = ao
        info: dict = {}
        try:
            fns["opswap_plan"], info = _opswap_plan(model, x)
        except Exception as exc:  # noqa: BLE001
            info = {"opswap_plan_error": f"{type(exc).__name__}: {exc}"[:300]}
        failed: dict[str, str] = {} if every is not None else {"2:4_every_linear": every_err}
        _runnable(fns, x, failed)
        rows = compare_variants(fns, (x,), "dense", device="cuda", min_time_s=1.0, max_time_s=10.0)
        for r in rows:
            r.update(kind="vit_h_mlp_stack", batch=batch, tokens=TOKENS, layers=layers)
            if r["name"] == "opswap_plan":
                r.update(info)
            if ao_err is not None:
                r["torchao_error"] = ao_err
            print(r, flush=True)
        out += rows + [
            {"kind": "vit_h_mlp_stack", "batch": batch, "name": k, "skipped": v}
            for k, v in failed.items()
        ]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--quick", action="store_true", help="fewer shapes (a smoke run)")
    p.add_argument("--layers", type=int, default=32, help="blocks of the ViT-H MLP stack")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads (default 1: on a shared 2-core machine a 2-thread parallel region "
        "stalls for a scheduler slice whenever another process holds a core; a 1-row CSR "
        "product measured 0.15 ms on 1 thread and 50 ms on 2)",
    )
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.device == "cpu":
        rows = cpu_rows(args.quick)
        device = f"cpu ({torch.get_num_threads()} threads)"
    else:
        rows = gemm_rows(args.quick) + stack_rows(args.quick, args.layers)
        device = torch.cuda.get_device_name(0)
    try:
        import torchao

        ao = torchao.__version__
    except Exception:  # noqa: BLE001
        ao = None
    write_results(
        args.out,
        f"sparsity_{card() if args.device == 'cuda' else 'cpu'}.json",
        device,
        rows,
        torchao=ao,
        peer="dense F.linear (eager, cuBLAS/oneDNN) and, on the GPU, torchao's sparsify_; on "
        "the CPU torch's own CSR and BSR products (rows torch_csr_*, torch_bsr32_*); all "
        "in the same run",
    )


if __name__ == "__main__":
    main()
