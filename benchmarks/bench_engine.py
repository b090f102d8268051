"""The serving engine (opswap.llm.LLMEngine) on a batch of requests: tokens/s, the share
of each step spent in the scheduler and block manager, and the prefix cache's cost at a
0% hit rate (the issue's bound: under 1%), next to transformers' `generate` on the same
prompts one at a time (its padding-free route) as the peer.

    PYTHONPATH=src python3 benchmarks/bench_engine.py --out DIR   # GPU: DIR/engine_<dev>.json
    PYTHONPATH=src python benchmarks/bench_engine.py --smoke     # CPU, a tiny model, seconds

The model: a Llama-style config with random weights (on the GPU hidden 1024, 8 layers,
bf16; --smoke hidden 128, 2 layers, fp32 on the CPU). Workloads, each all requests queued
at once and run to the end, greedy, a fixed number of new tokens:
- distinct: prompts with no common prefix (0% hit rate), prefix caching on and off,
  timed interleaved round by round; the caching's cost is the scheduler's extra time
  over the run without it (the whole-run ratio is kept too; on a busy machine its noise
  is larger than the cost);
- shared: the same prompts behind a common prefix of 4 blocks (hit rate, tokens saved).
Reported per run: wall time, tokens/s (generated tokens), steps, the time inside the
scheduler (schedule and its end-of-step bookkeeping) as a share of the run, the pool's
hit rate and the share of allocated slots holding tokens at the busiest step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _results import write_results  # noqa: E402


def _model(smoke: bool, device: str, dtype: torch.dtype) -> Any:
    import transformers

    if smoke:
        dims = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=256, vocab_size=512)  # fmt: skip
    else:
        dims = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                    num_key_value_heads=4, intermediate_size=2816, vocab_size=32000)  # fmt: skip
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**dims, initializer_range=0.1)
    return transformers.LlamaForCausalLM(cfg).eval().to(device, dtype)


def _run(model: Any, prompts: list[list[int]], new: int, caching: bool, opts: dict) -> dict:
    from opswap.llm import LLMEngine, SamplingParams

    engine = LLMEngine(model, prefix_caching=caching, **opts)
    sched = engine.scheduler
    spent = [0.0]

    def timed(fn: Any) -> Any:
        def wrapper(*a: Any) -> Any:
            t = time.perf_counter()
            out = fn(*a)
            spent[0] += time.perf_counter() - t
            return out

        return wrapper

    sched.schedule = timed(sched.schedule)  # type: ignore[method-assign]
    sched.finish_step = timed(sched.finish_step)  # type: ignore[method-assign]
    params = SamplingParams(temperature=0, max_tokens=new)
    for p in prompts:
        engine.add_request(p, params)
    util = []
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        util.append((engine.stats().blocks.in_use, engine.stats().blocks.utilisation))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    s = engine.stats()
    busiest = max(util)[1] if util else 1.0
    return {
        "wall_s": wall,
        "tokens_per_s": len(prompts) * new / wall,
        "steps": s.steps,
        "tokens_computed": s.tokens_computed,
        "scheduler_s": spent[0],
        "scheduler_share": spent[0] / wall,
        "hit_rate": s.blocks.hit_rate,
        "utilisation_at_busiest": busiest,
        "blocks_in_use_after": s.blocks.in_use,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, in seconds")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    smoke = args.smoke or not torch.cuda.is_available()
    device = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.bfloat16
    if smoke:
        torch.set_num_threads(1)
    model = _model(smoke, device, dtype)
    vocab = model.config.vocab_size
    n_req, new, bs = (8, 16, 16) if smoke else (32, 64, 16)
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(16, 96 if smoke else 480, (n_req,), generator=g).tolist()
    distinct = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    prefix = torch.randint(0, vocab, (4 * bs,), generator=g).tolist()
    shared = [prefix + p for p in distinct]
    opts = dict(block_size=bs, max_model_len=1024, max_num_seqs=n_req,
                max_num_batched_tokens=512 if smoke else 2048, device=device, dtype=dtype)  # fmt: skip
    opts["num_blocks"] = n_req * (-(-(max(lengths) + 4 * bs + new) // bs)) + 8

    _run(model, distinct[:2], 4, True, opts)  # warm-up
    runs: dict[str, list[dict]] = {"distinct_caching": [], "distinct_no_caching": []}
    for _ in range(args.rounds):
        runs["distinct_caching"].append(_run(model, distinct, new, True, opts))
        runs["distinct_no_caching"].append(_run(model, distinct, new, False, opts))
    runs["shared_caching"] = [_run(model, shared, new, True, opts)]
    hf = []
    for p in distinct[:4]:
        ids = torch.tensor([p], device=device)
        t = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                       do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
        hf.append(time.perf_counter() - t)
    rows = []
    for name, rs in runs.items():
        med = statistics.median(r["wall_s"] for r in rs)
        rows.append({"variant": name, "rounds": len(rs), "median_wall_s": med,
                     "tokens_per_s": n_req * new / med, **{k: v for k, v in rs[-1].items()
                     if k not in ("wall_s", "tokens_per_s")}})  # fmt: skip
    rows.append({"variant": "hf_generate_one_at_a_time", "requests": len(hf),
                 "tokens_per_s": len(hf) * new / sum(hf)})  # fmt: skip
    # the caching's cost is its extra bookkeeping: whole-run walls differ by more than that
    # on a shared machine, so both are kept, the bookkeeping's as the figure
    on = statistics.median(r["wall_s"] for r in runs["distinct_caching"])
    off = statistics.median(r["wall_s"] for r in runs["distinct_no_caching"])
    extra_s = statistics.median(r["scheduler_s"] for r in runs["distinct_caching"]) - (
        statistics.median(r["scheduler_s"] for r in runs["distinct_no_caching"])
    )
    cost = extra_s / off
    for r in rows:
        print(r)
    print(
        f"prefix caching at a 0% hit rate: bookkeeping {cost:+.2%} of the run; whole runs "
        f"{on / off - 1:+.1%} (medians of {args.rounds})"
    )
    name = (
        "engine_cpu_smoke.json"
        if smoke
        else f"engine_{torch.cuda.get_device_name().split()[-1].lower()}.json"
    )
    dev = "cpu" if smoke else torch.cuda.get_device_name()
    write_results(args.out, name, dev, rows, requests=n_req, new_tokens=new, block_size=bs,
                  prompt_lengths=lengths, prefix_caching_cost_at_0pct=cost,
                  wall_ratio_caching_on_off=on / off)  # fmt: skip


if __name__ == "__main__":
    main()
