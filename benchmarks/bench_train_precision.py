"""One training step raced in each precision of opswap.train.prepare (float32, bf16, fp16,
fp8): eager, torch.compile, opswap and opswap under torch.compile (opswap.train.race), each
variant in the precision, its loss after three steps checked against eager's in the same
precision, and every precision's steps set beside float32 eager's.

    PYTHONPATH=src python3 benchmarks/bench_train_precision.py --cpu   (a small LM, float32,
                                                                     bf16, fp16; writes
                                                                     train_precision_cpu.json)
    PYTHONPATH=src python3 benchmarks/bench_train_precision.py         (GPU: a Llama-style
                                                                     350M in float32 weights,
                                                                     seq 1024, batch 4; fp8
                                                                     where CC >= 8.9; writes
                                                                     train_precision_<card>.json)

The GPU model is transformers' LlamaForCausalLM (hidden 1024, 16 layers, 16 heads, MLP
4096, vocabulary 32000; random weights, nothing downloaded), every Linear's sizes multiples
of 16, so fp8 converts them all. What is reported per precision: ms per step, the speedup
against float32 eager measured in the same process, peak memory, and the loss after the
check steps relative to float32 eager's.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_train_step import _Logits, lm_loss  # noqa: E402

LLAMA_350M = dict(
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=16,
    vocab_size=32000,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    use_cache=False,
)


class _SmallLM(nn.Module):
    """The CPU model: embedding, two pre-norm MLP blocks, head (vocabulary 500, width 128)."""

    def __init__(self, vocab: int = 500, d: int = 128):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
            for _ in range(2)
        )
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for b in self.blocks:
            x = x + b(x)
        return self.head(self.norm(x))


def _race(
    model: nn.Module,
    batch: tuple[torch.Tensor, ...],
    device: str,
    precisions: list[str],
    variants: tuple[str, ...],
    min_time_s: float,
) -> list[dict[str, Any]]:
    from opswap.train.race import race_training

    rows: list[dict[str, Any]] = []
    base_ms = base_loss = None
    for precision in precisions:
        race = race_training(
            model,
            batch,
            lm_loss,
            device=device,
            variants=variants,
            min_time_s=min_time_s,
            precision=precision,
        )
        print(precision)
        print(race.table())
        for r in race.rows:
            if precision == "float32" and r.name == "eager":
                base_ms, base_loss = r.median_s, r.loss
            rows.append(
                {
                    "precision": precision,
                    **r.to_json(),
                    "speedup_vs_float32_eager": (
                        base_ms / r.median_s if base_ms and r.median_s else None
                    ),
                    "loss_vs_float32_eager": (
                        abs(r.loss - base_loss) / abs(base_loss)
                        if r.loss is not None and base_loss
                        else None
                    ),
                    "prepare_notes": (race.prepare or {}).get("notes", [])
                    if r.name == "opswap"
                    else [],
                }
            )
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    from _results import write_kernel_run, write_results

    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "benchmarks/results"))
    )
    ap.add_argument("--cpu", action="store_true", help="the small CPU LM")
    ap.add_argument("--min-time", type=float, default=1.0, help="seconds of timing per race")
    ap.add_argument("--seq", type=int, default=1024, help="GPU: sequence length")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.cpu:
        torch.set_num_threads(1)  # see bench_train_step.py: fairer CPU figures
        model = _SmallLM().train()
        ids = torch.randint(0, 500, (8, 64))
        rows = _race(
            model,
            (ids, torch.roll(ids, -1, 1)),
            "cpu",
            ["float32", "bf16", "fp16"],
            ("eager", "opswap"),
            args.min_time,
        )
        write_results(args.out, "train_precision_cpu.json", "cpu", rows, threads=1)
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_train_precision.py without --cpu needs a GPU.")
    from bench_lce import env
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**LLAMA_350M, attn_implementation="sdpa")
    model = _Logits(LlamaForCausalLM(config).cuda().train())  # float32 weights
    ids = torch.randint(0, config.vocab_size, (4, args.seq), device="cuda")
    precisions = ["float32", "bf16"]
    if torch.cuda.get_device_capability() >= (8, 9):
        precisions.append("fp8")
    rows = _race(
        model,
        (ids, torch.roll(ids, -1, 1)),
        "cuda",
        precisions,
        ("eager", "compile", "opswap", "opswap+compile"),
        args.min_time,
    )
    res = {**env("cuda"), "config": LLAMA_350M, "seq": args.seq, "batch": 4, "rows": rows}
    try:
        import torchao

        res["torchao"] = torchao.__version__
    except ImportError:
        res["torchao"] = None
    write_kernel_run(res, args.out, "train_precision", False, False)


if __name__ == "__main__":
    main()
