"""Tensor-parallel serving (opswap.llm.tensor_parallel, chapter 29): N GPUs against one on
the same model and prompts: decode throughput at high concurrency, batch-1 latency, and
whether the greedy tokens agree.

    PYTHONPATH=src python benchmarks/bench_tp.py --tp 2 --out DIR   # N GPUs: DIR/tp_<card>.json
    PYTHONPATH=src python benchmarks/bench_tp.py --smoke            # CPU, gloo, 2 processes

The model: a Llama-style config with random weights (GPU: hidden 4096, 8 layers, GQA
32/8 heads, MLP 11008, vocab 32000, about 1.7B parameters, bf16; --smoke: hidden 128, 2
layers, 4/2 heads, fp32 on the CPU). Configurations, each its own engine built in turn
(the single-GPU one freed before the split one starts): one GPU with CUDA graphs (as
served) and eager, N GPUs eager and with CUDA graphs (every rank replays its bucket's
graph, the all-reduces inside it). On the CPU: one process and N processes, eager.

- throughput: `--requests` requests (default 64) of `--prompt` random tokens (128) queued
  at once, max_num_seqs as many, `--new` greedy tokens each (128); output tokens/s over
  the whole run, median of `--rounds`;
- batch-1 latency: one request of 32 prompt tokens, `--new` tokens; the median time of a
  decode step (the steps after its prefill), median of the rounds;
- tokens: each configuration's greedy tokens of the throughput prompts against the first
  configuration's: how many sequences are identical and the mean share of each that
  agrees before the first difference (bf16 sums in another order round differently, so
  long greedy runs may part; float32 on the CPU agrees exactly).

A configuration that fails (say CUDA-graph capture with NCCL) is recorded with its error
and the others still run.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _results import write_results  # noqa: E402

_DIMS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
         "intermediate_size", "vocab_size")  # fmt: skip


def _model(smoke: bool, dtype: torch.dtype) -> Any:
    import transformers

    if smoke:
        dims = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=256, vocab_size=511)  # fmt: skip
    else:
        dims = dict(hidden_size=4096, num_hidden_layers=8, num_attention_heads=32,
                    num_key_value_heads=8, intermediate_size=11008, vocab_size=32000)  # fmt: skip
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**dims, initializer_range=0.02)
    # on the CPU: the split engine's workers receive it through shared memory
    return transformers.LlamaForCausalLM(cfg).eval().to(dtype)


def _prompts(n: int, length: int, vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def _throughput(engine: Any, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    from opswap.llm import SamplingParams

    params = SamplingParams(max_tokens=new, temperature=0.0)
    t0 = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] = o.token_ids
    seconds = time.perf_counter() - t0
    tokens = [out[i] for i in ids]
    return sum(map(len, tokens)) / seconds, tokens


def _latency(engine: Any, prompt: list[int], new: int) -> float:
    """Median ms of a decode step of one request (the steps after its prefill)."""
    from opswap.llm import SamplingParams

    engine.add_request(prompt, SamplingParams(max_tokens=new, temperature=0.0))
    engine.step()  # the prefill
    times = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    same, shares = 0, []
    for x, y in zip(a, b, strict=True):
        same += x == y
        k = next((i for i, (s, t) in enumerate(zip(x, y, strict=False)) if s != t), len(x))
        shares.append(k / max(1, len(x)))
    return {
        "identical_sequences": same,
        "sequences": len(a),
        "agree_share": statistics.mean(shares),
    }


def run_config(
    model: Any, name: str, tp: int, graphs: bool, args: argparse.Namespace, smoke: bool
) -> dict[str, Any]:
    from opswap.llm import LLMEngine

    device = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.bfloat16
    vocab = model.config.vocab_size
    prompts = _prompts(args.requests, args.prompt, vocab)
    row: dict[str, Any] = {"config": name, "tensor_parallel": tp, "cuda_graphs": graphs}
    engine = None
    try:
        engine = LLMEngine(
            model, block_size=16, max_model_len=args.prompt + args.new + 32,
            max_num_seqs=args.requests, max_num_batched_tokens=max(512, args.prompt * 4),
            device=device, dtype=dtype, cuda_graphs=graphs, tensor_parallel=tp,
            tp_timeout_s=120,
        )  # fmt: skip
        # warm-up: every decode bucket's graph (the batch shrinks as requests end), autotune
        _throughput(engine, prompts, 4)
        _latency(engine, prompts[0][:32], 4)
        tps, lat = [], []
        tokens: list[list[int]] = []
        for _ in range(args.rounds):
            t, tokens = _throughput(engine, prompts, args.new)
            tps.append(t)
            lat.append(_latency(engine, prompts[0][:32], args.new))
        row.update(
            output_tokens_per_s=statistics.median(tps),
            batch1_ms_per_token=statistics.median(lat),
            rounds_tokens_per_s=tps,
            rounds_batch1_ms=lat,
            tokens=tokens,
        )
    except Exception as e:  # record it; the other configurations still run
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    finally:
        if engine is not None:
            engine.close()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print({k: v for k, v in row.items() if k != "tokens"}, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, gloo")
    ap.add_argument("--tp", type=int, default=2, help="ranks of the split configurations")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--prompt", type=int, default=None)
    ap.add_argument("--new", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    smoke = args.smoke or not torch.cuda.is_available()
    if not smoke and torch.cuda.device_count() < args.tp:
        ap.error(f"--tp {args.tp} needs {args.tp} GPUs and torch sees {torch.cuda.device_count()}")
    args.requests = args.requests or (8 if smoke else 64)
    args.prompt = args.prompt or (16 if smoke else 128)
    args.new = args.new or (16 if smoke else 128)
    if smoke:
        torch.set_num_threads(1)
    model = _model(smoke, torch.float32 if smoke else torch.bfloat16)
    configs = (
        [("1 process", 1, False), (f"{args.tp} processes (gloo)", args.tp, False)]
        if smoke
        else [
            ("1 GPU, CUDA graphs", 1, True),
            ("1 GPU, eager", 1, False),
            (f"{args.tp} GPUs, eager", args.tp, False),
            (f"{args.tp} GPUs, CUDA graphs", args.tp, True),
        ]
    )
    with torch.inference_mode():
        rows = [run_config(model, n, tp, g, args, smoke) for n, tp, g in configs]
    ref = rows[0].get("tokens")
    for row in rows:
        tokens = row.pop("tokens", None)
        if ref is not None and tokens is not None:
            row["tokens_vs_first"] = _agreement(ref, tokens)
    by = {r["config"]: r for r in rows}
    summary: dict[str, Any] = {}
    pairs = (
        [("1 process", f"{args.tp} processes (gloo)")]
        if smoke
        else [
            ("1 GPU, CUDA graphs", f"{args.tp} GPUs, CUDA graphs"),
            ("1 GPU, eager", f"{args.tp} GPUs, eager"),
        ]
    )
    for one, split in pairs:
        a, b = by[one], by[split]
        if "error" in a or "error" in b:
            continue
        summary[f"{split} / {one}"] = {
            "throughput_ratio": b["output_tokens_per_s"] / a["output_tokens_per_s"],
            "batch1_latency_ratio": b["batch1_ms_per_token"] / a["batch1_ms_per_token"],
        }
    dev = "cpu" if smoke else f"{args.tp}x {torch.cuda.get_device_name()}"
    card = "cpu_smoke" if smoke else torch.cuda.get_device_name().split()[-1].lower()
    write_results(
        args.out, f"tp_{card}.json", dev, rows,
        smoke=smoke, model={k: getattr(model.config, k) for k in _DIMS},
        requests=args.requests, prompt_tokens=args.prompt, new_tokens=args.new,
        rounds=args.rounds, summary=summary,
        peer="the single-process engine (tensor_parallel 1, row '1 process'), same run",
    )  # fmt: skip


if __name__ == "__main__":
    main()
