"""One training step (forward, loss, backward, AdamW step), raced: eager, torch.compile,
opswap (opswap.train.prepare) and opswap under torch.compile (opswap.train.race), with the
peak memory of a step and every variant's loss after three steps checked against eager's.

    PYTHONPATH=src python3 benchmarks/bench_train_step.py --cpu    (zoo:gpt tiny, the digits
                                                                    MLP and CNN; writes
                                                                    train_step_cpu.json)
    PYTHONPATH=src python3 benchmarks/bench_train_step.py          (GPU: a Llama-style 1B,
                                                                    bf16, seq 2048, batch 1;
                                                                    writes train_step_<card>.json)

The GPU part builds transformers' LlamaForCausalLM at Llama 3.2 1B's shape (hidden 2048, 16
layers, 32 heads and 8 KV heads, MLP 8192, vocabulary 128256, tied embeddings; random
weights, nothing downloaded) and trains it on random tokens with the cross-entropy of its
logits (labels shifted by the script, the last position ignored). Beside the four variants
it races Liger-Kernel's patched model (`apply_liger_kernel_to_llama`, its fused linear +
cross-entropy inside the model's forward, called with `labels=`: the same tokens counted),
where liger_kernel is importable. The issue's target (43): opswap at least 1.1x
torch.compile and at least Liger's speed, with peak memory at most Liger's.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    rope_theta=500000.0,
    use_cache=False,
)


def lm_loss(out: Any, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of an LM's logits (a tensor or an output with .logits)."""
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))


class _Logits(nn.Module):
    """A transformers causal LM returning its logits only (no cache, no dict)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, use_cache=False).logits


class _LigerLoss(nn.Module):
    """Liger's patched model, its loss computed inside its forward from `labels`."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # HF shifts labels by one inside: hand it the unshifted ones (labels[t] is the
        # target of position t here, so position t+1 of HF's labels)
        hf = torch.cat([torch.full_like(labels[:, :1], -100), labels[:, :-1]], dim=1)
        return self.model(input_ids=ids, labels=hf, use_cache=False).loss


def run_cpu(compile_: bool, min_time_s: float) -> list[dict[str, Any]]:
    from opswap import api
    from opswap.train.race import VARIANTS, optimize_training

    rows = []
    variants = VARIANTS if compile_ else ("eager", "opswap")
    for spec in ("zoo:gpt", "zoo:digits_mlp", "zoo:digits_cnn"):
        loaded = api.load(spec)
        race = optimize_training(
            loaded.module, loaded.example_inputs, variants=variants, min_time_s=min_time_s
        )
        print(spec)
        print(race.table())
        rep = race.prepare or {}
        rows.append(
            {
                "model": spec,
                "settings": loaded.settings,
                "memory_method": race.memory_method,
                "replaced": [r["rule"] for r in rep.get("replaced", [])],
                "refused": rep.get("refused", []),
                "gradients_passed": (rep.get("gradients") or {}).get("passed"),
                "variants": [r.to_json() for r in race.rows],
            }
        )
    return rows


def run_gpu(seq: int, min_time_s: float) -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from opswap.train.race import race_training

    torch.manual_seed(0)
    config = LlamaConfig(**LLAMA_1B, attn_implementation="sdpa")
    base = LlamaForCausalLM(config).to(torch.bfloat16).cuda().train()
    model = _Logits(base)
    ids = torch.randint(0, config.vocab_size, (1, seq), device="cuda")
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    extra: dict[str, nn.Module] = {}
    notes = []
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        liger = LlamaForCausalLM(config).to(torch.bfloat16).cuda().train()
        liger.load_state_dict(base.state_dict())
        apply_liger_kernel_to_llama(model=liger)
        extra["liger"] = _LigerLoss(liger)
    except Exception as e:  # not installed, or a version that does not patch this model
        notes.append(f"liger: {type(e).__name__}: {str(e)[:200]}")
    race = race_training(
        model,
        (ids, labels),
        lm_loss,
        device="cuda",
        min_time_s=min_time_s,
        loss_rtol=2e-2,  # bf16 steps: the losses agree to bf16's rounding, not bitwise
        extra=extra,
    )
    print(race.table())
    by = {r.name: r for r in race.rows}
    summary: dict[str, Any] = {}
    o = by.get("opswap")
    for peer in ("eager", "compile", "liger"):
        p = by.get(peer)
        if o and p and o.median_s and p.median_s:
            summary[f"speedup_vs_{peer}"] = p.median_s / o.median_s
            if o.peak_bytes and p.peak_bytes:
                summary[f"peak_ratio_vs_{peer}"] = o.peak_bytes / p.peak_bytes
    return {
        "config": LLAMA_1B,
        "seq": seq,
        "batch": 1,
        "dtype": "bfloat16",
        "memory_method": race.memory_method,
        "prepare": race.prepare,
        "rows": [r.to_json() for r in race.rows],
        "summary": summary,
        "notes": notes + race.notes,
    }


def main() -> None:
    from _results import write_kernel_run, write_results

    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "benchmarks/results"))
    )
    ap.add_argument("--cpu", action="store_true", help="the CPU models (train_step_cpu.json)")
    ap.add_argument("--no-compile", action="store_true", help="CPU: skip the compile variants")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU: intra-op threads (1: Inductor's OpenMP pool and ATen's otherwise contend, "
        "and on a 2-core machine eager ran 5x slower once a compiled step had run)",
    )
    ap.add_argument("--seq", type=int, default=2048, help="GPU: sequence length")
    ap.add_argument("--min-time", type=float, default=2.0, help="seconds of timing per race")
    args = ap.parse_args()
    if args.cpu:
        torch.set_num_threads(args.threads)
        rows = run_cpu(not args.no_compile, args.min_time)
        write_results(args.out, "train_step_cpu.json", "cpu", rows, threads=torch.get_num_threads())
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_train_step.py without --cpu needs a GPU.")
    from bench_lce import env

    res = {**env("cuda"), **run_gpu(args.seq, args.min_time)}
    write_kernel_run(res, args.out, "train_step", False, False)


if __name__ == "__main__":
    main()
