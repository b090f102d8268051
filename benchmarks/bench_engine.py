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
- shared: the same prompts behind a common prefix of 4 blocks (hit rate, tokens saved);
- time to first token of a 1000-token prompt (256 with --smoke) whose first 90% an
  earlier request sent, caching on against off (one request at a time, medians).
Reported per run: wall time, tokens/s (generated tokens), steps, the time inside the
scheduler (schedule and its end-of-step bookkeeping) as a share of the run, the pool's
hit rate and the share of allocated slots holding tokens at the busiest step.

`--part spec` (in DIR/engine_spec_<dev>.json): speculative decoding by prompt lookup, at
concurrency 1, 4, 16 and 64 (that many requests queued at once, max_num_seqs as many), on
repetitive and on random text. A model with random weights does not copy its context, so
the text's kind is the output's: "repetitive" is the same config at transformers' default
initialisation (std 0.02), whose greedy output falls into short loops, prompted with a
phrase of 8 tokens repeated 8 times; "random" is the livelier std 0.1 model prompted with
64 random tokens, whose output rarely repeats (the same FLOPs a token). Speculation off,
on without the batch switch (`max_batch` unbounded: the raw effect, whose crossover sets
the default), and on with the default config; rounds interleaved, medians, the speed-up
over off and the share of drafts accepted. On CUDA also CUDA graphs off and on (greedy,
speculation off) at the same concurrencies. `--part caching` is the run above; default:
both.

`--part weights` (in DIR/engine_weights_<dev>.json; `--weights int8,int4,fp8` picks the
low-bit schemes, default all of them): decode tokens/s at batch 1 and 32 with the
projections in the run's dtype and in each scheme (`LLMEngine(weights=...)`, llm/quant.py),
and int4 with the LM head quantised too. The model: TinyLlama-1.1B's shape (hidden 2048,
22 layers, GQA 32/4, MLP 5632, vocab 32000), random weights, bf16 on the GPU (--smoke:
the tiny CPU config, fp32). Each request has a 32-token prompt and asks for `new` tokens;
the clock runs from the step after every prefill to the end (decode-only steps, CUDA
graphs on, as served), rounds interleaved, medians. Next to each figure: the bytes of
Linear weights a token reads (`engine.weight_stats`), the KV bytes read at the run's
mean context, the GB/s that achieves, and on CUDA the card's copy bandwidth measured in the
same run (a 2 GiB copy), so that batch 1 reads as a share of the bandwidth roofline. FP8
rows are skipped, with the reason, where the device has no FP8 tensor cores. The peer, at
each batch: transformers' `generate` of the same prompts as one batch with the model in
the run's dtype (row `hf_generate_<dtype>`; its decode time is a run to `new` tokens less
a run to one), and each engine row's `speedup_over_hf_generate`.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _results import write_results  # noqa: E402


def _model(smoke: bool, device: str, dtype: torch.dtype, init: float = 0.1) -> Any:
    import transformers

    if smoke:
        dims = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=256, vocab_size=512)  # fmt: skip
    else:
        dims = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                    num_key_value_heads=4, intermediate_size=2816, vocab_size=32000)  # fmt: skip
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**dims, initializer_range=init)
    return transformers.LlamaForCausalLM(cfg).eval().to(device, dtype)


def _caching_engine(model: Any, caching: bool, opts: dict) -> tuple[Any, list[float]]:
    """An engine with prefix caching on or off whose scheduler calls add their time to
    the returned one-item list (schedule and its end-of-step bookkeeping)."""
    from opswap.llm import LLMEngine

    engine = LLMEngine(model, prefix_caching=caching, **opts)
    sched, spent = engine.scheduler, [0.0]

    def timed(fn: Any) -> Any:
        def wrapper(*a: Any) -> Any:
            t = time.perf_counter()
            out = fn(*a)
            spent[0] += time.perf_counter() - t
            return out

        return wrapper

    sched.schedule = timed(sched.schedule)  # type: ignore[method-assign]
    sched.finish_step = timed(sched.finish_step)  # type: ignore[method-assign]
    return engine, spent


def _run(engine: Any, spent: list[float], prompts: list[list[int]], new: int) -> dict:
    """The prompts queued at once on `engine` (reused across rounds, so that CUDA graphs
    and kernels are ready before the clock starts) and run to the end."""
    from opswap.llm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new)
    before, spent[0] = engine.stats(), 0.0
    hits, queried = engine.blocks.hit_blocks, engine.blocks.queried_blocks
    for i, p in enumerate(prompts):
        engine.add_request(p, params, str(i))
    util = []
    if torch.cuda.is_available():
        torch.cuda.synchronize()
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
        "steps": s.steps - before.steps,
        "tokens_computed": s.tokens_computed - before.tokens_computed,
        "scheduler_s": spent[0],
        "scheduler_share": spent[0] / wall,
        # this run's share of full prompt blocks found in the cache
        "hit_rate": (engine.blocks.hit_blocks - hits)
        / max(engine.blocks.queried_blocks - queried, 1),
        "utilisation_at_busiest": busiest,
        "blocks_in_use_after": s.blocks.in_use,
    }


def _ttft_shared(engines: dict[str, Any], vocab: int, length: int, share: float,
                 rounds: int, g: torch.Generator) -> dict[str, Any]:  # fmt: skip
    """Time to first token of a prompt whose first `share` of `length` tokens an earlier
    request already sent, with prefix caching on and off: each round, a fresh prefix goes
    through both engines once (one token asked), then the timed request (the prefix and
    new tokens) alone, one token asked; the settings take turns first. Medians."""
    from opswap.llm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1)
    times: dict[str, list[float]] = {name: [] for name in engines}
    hits: dict[str, list[float]] = {name: [] for name in engines}
    n_shared = int(length * share)
    for r in range(rounds):
        prefix = torch.randint(0, vocab, (n_shared,), generator=g).tolist()
        tails = [torch.randint(0, vocab, (length - n_shared,), generator=g).tolist()
                 for _ in range(2)]  # fmt: skip
        for name in list(engines)[:: 1 if r % 2 == 0 else -1]:
            engine = engines[name][0]
            engine.add_request(prefix + tails[0], params, "first")
            while engine.has_unfinished():
                engine.step()
            b = engine.blocks
            h0, q0 = b.hit_blocks, b.queried_blocks
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.add_request(prefix + tails[1], params, "timed")
            while engine.has_unfinished():
                engine.step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
            hits[name].append((b.hit_blocks - h0) / max(b.queried_blocks - q0, 1))
    on = statistics.median(times["distinct_caching"])
    off = statistics.median(times["distinct_no_caching"])
    return {
        "prompt_tokens": length,
        "shared_share": share,
        "rounds": rounds,
        "ttft_s_caching": on,
        "ttft_s_no_caching": off,
        "ttft_speedup": off / on,
        "hit_rate_caching": statistics.median(hits["distinct_caching"]),
    }


def _spec_prompts(kind: str, n: int, vocab: int, g: torch.Generator) -> list[list[int]]:
    """n prompts of 64 tokens: a phrase of 8 repeated 8 times, or random tokens."""
    if kind == "repetitive":
        return [torch.randint(0, vocab, (8,), generator=g).tolist() * 8 for _ in range(n)]
    return [torch.randint(0, vocab, (64,), generator=g).tolist() for _ in range(n)]


def _timed_run(engine: Any, prompts: list[list[int]], new: int) -> dict:
    """One run of the prompts to the end on an engine (reused across rounds: CUDA graphs
    are captured in its warm-up run, not in the timed ones)."""
    from opswap.llm import SamplingParams

    before = engine.stats()
    params = SamplingParams(temperature=0, max_tokens=new)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, str(i))  # ids free again once finished
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), time.process_time()
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    s = engine.stats()
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "steps": s.steps - before.steps,
        "draft_tokens": s.draft_tokens - before.draft_tokens,
        "accepted_tokens": s.accepted_tokens - before.accepted_tokens,
        "graph_steps": s.graph_steps - before.graph_steps,
        "tokens": [outs[str(i)] for i in range(len(prompts))],
    }


def spec_part(smoke: bool, device: str, dtype: torch.dtype, rounds: int) -> dict:
    """Speculation off / on (unbounded) / on (default) and, on CUDA, graphs off / on."""
    from opswap.llm import LLMEngine, SpeculativeConfig

    models = {
        "repetitive": _model(smoke, device, dtype, 0.02),
        "random": _model(smoke, device, dtype),
    }
    vocab = models["random"].config.vocab_size
    new, bs, k = (48, 16, 4) if smoke else (128, 16, 4)
    g = torch.Generator().manual_seed(2)
    rows = []
    variants: dict[str, dict] = {
        "spec_off": {},
        "spec_on_unbounded": {"speculative": SpeculativeConfig(num_tokens=k, max_batch=10**6)},
        "spec_on_default": {"speculative": SpeculativeConfig(num_tokens=k)},
    }
    if device == "cuda":
        variants = {"graphs_off": {"cuda_graphs": False}, "graphs_on": {"cuda_graphs": True},
                    **{n: {**v, "cuda_graphs": False} for n, v in variants.items()}}  # fmt: skip
    # every concurrency at `new` tokens, and one long generation at concurrency 1 (the
    # share of steps before a repetitive output settles into its loop shrinks with length)
    cases = [(kind, conc, new) for kind in models for conc in (1, 4, 16, 64)]
    cases.append(("repetitive", 1, 256 if smoke else 512))
    for kind, conc, n_new in cases:
        model = models[kind]
        prompts = _spec_prompts(kind, conc, vocab, g)
        opts = dict(block_size=bs, max_model_len=64 + n_new + k + 1, max_num_seqs=conc,
                    max_num_batched_tokens=max(512, conc * (k + 1)), device=device,
                    dtype=dtype, prefix_caching=False)  # fmt: skip
        opts["num_blocks"] = conc * _blocks(64 + n_new + k + 1, bs) + 8
        if device != "cuda":
            opts["cuda_graphs"] = False
        engines = {name: LLMEngine(model, **opts, **extra) for name, extra in variants.items()}
        for engine in engines.values():  # warm-up: kernels tuned, graphs captured
            _timed_run(engine, prompts, n_new)
        runs: dict[str, list[dict]] = {name: [] for name in variants}
        order = list(variants)
        for r in range(rounds):  # each variant takes each place in the order in turn
            for name in order[r % len(order) :] + order[: r % len(order)]:
                runs[name].append(_timed_run(engines[name], prompts, n_new))
        del engines
        base = "graphs_off" if device == "cuda" else "spec_off"
        ref_tokens = runs[base][0]["tokens"]
        # the time: wall on a GPU; on the CPU the process's CPU time (one torch thread),
        # which a shared machine's other load disturbs far less than the wall clock
        clock = "wall_s" if device == "cuda" else "cpu_s"
        for name, rs in runs.items():
            med = statistics.median(r[clock] for r in rs)
            # paired: each round's ratio to the same round's spec_off, then the median
            ratio = statistics.median(
                o[clock] / r[clock] for o, r in zip(runs["spec_off"], rs, strict=True)
            )
            last = rs[-1]
            row = {
                "text": kind, "concurrency": conc, "new_tokens": n_new, "variant": name,
                "rounds": rounds,
                "clock": clock, "median_s": med,
                "median_wall_s": statistics.median(r["wall_s"] for r in rs),
                "tokens_per_s": conc * n_new / med,
                "speedup_over_spec_off": ratio, "steps": last["steps"],
                "draft_tokens": last["draft_tokens"],
                "acceptance": last["accepted_tokens"] / last["draft_tokens"]
                if last["draft_tokens"] else None,
                "graph_steps": last["graph_steps"],
                "tokens_equal_to_baseline": last["tokens"] == ref_tokens,
            }  # fmt: skip
            rows.append(row)
            print({k2: v for k2, v in row.items() if k2 != "rounds"})
    crossover = max(
        (r["concurrency"] for r in rows
         if r["variant"] == "spec_on_unbounded" and r["text"] == "repetitive"
         and r["new_tokens"] == new and r["speedup_over_spec_off"] > 1.0),
        default=0,
    )  # fmt: skip
    return {"rows": rows, "new_tokens": new, "num_spec_tokens": k, "block_size": bs,
            "largest_concurrency_where_unbounded_spec_pays_on_repetitive": crossover}  # fmt: skip


def _big_model(smoke: bool, device: str, dtype: torch.dtype) -> Any:
    """TinyLlama-1.1B's shape with random weights (the tiny config with --smoke)."""
    import transformers

    if smoke:
        return _model(True, device, dtype)
    dims = dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32,
                num_key_value_heads=4, intermediate_size=5632, vocab_size=32000)  # fmt: skip
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**dims, initializer_range=0.02)
    with torch.device(device):  # initialised where it runs: 1.1B weights
        model = transformers.LlamaForCausalLM(cfg).to(dtype)
    return model.eval()


def _copy_gb_s(device: str) -> float | None:
    """The device's copy bandwidth (read + write) in GB/s from a 2 GiB copy, on CUDA."""
    if device != "cuda":
        return None
    x = torch.empty(2 * 1024**3 // 4, device=device)
    y = torch.empty_like(x)
    times = []
    for _ in range(8):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del x, y
    return 2 * 2 * 1024**3 / statistics.median(times[2:]) / 1e9


def _decode_run(engine: Any, prompts: list[list[int]], new: int) -> dict:
    """Run the prompts to the end; the clock covers the steps after every prefill."""
    from opswap.llm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, str(i))
    made = 0
    while made < len(prompts):  # prefill steps, each request's first token
        made += sum(len(o.new_token_ids) for o in engine.step())
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    t0, tokens, steps = time.perf_counter(), 0, 0
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
        steps += 1
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return {"wall_s": time.perf_counter() - t0, "tokens": tokens, "steps": steps}


def weights_part(smoke: bool, device: str, dtype: torch.dtype, schemes: list[str],
                 rounds: int) -> dict:  # fmt: skip
    """Decode tokens/s at batch 1 and 32, projections in `dtype` and in each scheme."""
    from opswap.llm import LLMEngine, QuantError, WeightQuant

    model = _big_model(smoke, device, dtype)
    c = model.config
    kv_heads = c.num_key_value_heads
    head_dim = c.hidden_size // c.num_attention_heads
    prompt_len, new, bs = (32, 32, 16) if smoke else (32, 128, 16)
    variants: dict[str, Any] = {str(dtype).removeprefix("torch."): None}
    for s in schemes:
        variants[s] = s
    if "int4" in schemes:
        variants["int4_lm_head"] = WeightQuant("int4", lm_head=True)
    copy_gb_s = _copy_gb_s(device)
    peer = copy.deepcopy(model)  # the peer's own copy, whatever an engine does to the model
    g = torch.Generator().manual_seed(3)
    rows = []
    for batch in (1, 32):
        prompts = [torch.randint(0, c.vocab_size, (prompt_len,), generator=g).tolist()
                   for _ in range(batch)]  # fmt: skip
        hf = _hf_decode(peer, prompts, new, rounds)
        opts = dict(block_size=bs, max_model_len=prompt_len + new + 1, max_num_seqs=batch,
                    max_num_batched_tokens=max(512, batch * prompt_len), device=device,
                    dtype=dtype, prefix_caching=False)  # fmt: skip
        opts["num_blocks"] = batch * _blocks(prompt_len + new + 1, bs) + 4
        if device != "cuda":
            opts["cuda_graphs"] = False
        runs: dict[str, list[dict]] = {}
        engines: dict[str, Any] = {}
        for name, w in variants.items():
            try:
                engines[name] = LLMEngine(model, weights=w, **opts)
            except QuantError as e:
                rows.append({"batch": batch, "weights": name, "skipped": str(e)})
                print(rows[-1])
                continue
            _decode_run(engines[name], prompts, new)  # warm-up: autotuning, graphs
            runs[name] = []
        order = list(runs)
        for r in range(rounds):
            for name in order[r % len(order) :] + order[: r % len(order)]:
                runs[name].append(_decode_run(engines[name], prompts, new))
        base = order[0]
        base_tps = None
        for name in order:
            rs, st = runs[name], engines[name].weight_stats
            med = statistics.median(x["wall_s"] for x in rs)
            steps = rs[-1]["steps"]
            tps = rs[-1]["tokens"] / med
            base_tps = tps if name == base else base_tps
            # KV read per step: every sequence's keys and values at the mean context
            ctx = prompt_len + new / 2
            kv = 2 * c.num_hidden_layers * kv_heads * head_dim * dtype.itemsize * ctx * batch
            per_step = st.stored_bytes + kv
            gb_s = per_step * steps / med / 1e9
            row = {
                "batch": batch, "weights": name, "rounds": rounds, "median_decode_s": med,
                "decode_steps": steps, "tokens_per_s": tps,
                "speedup_over_" + base: tps / base_tps if base_tps else None,
                "speedup_over_hf_generate": tps / hf["tokens_per_s"],
                "linear_weight_bytes": st.stored_bytes,
                "linear_weight_bytes_in_dtype": st.float_bytes,
                "kv_bytes_per_step_at_mean_context": kv, "achieved_gb_s": gb_s,
                "copy_gb_s": copy_gb_s,
                "share_of_copy_bandwidth": gb_s / copy_gb_s if copy_gb_s else None,
            }  # fmt: skip
            rows.append(row)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
        rows.append({"batch": batch, "weights": f"hf_generate_{base}", **hf})
        print(rows[-1])
        del engines
        if device == "cuda":
            torch.cuda.empty_cache()
    return {"rows": rows, "prompt_len": prompt_len, "new_tokens": new, "block_size": bs,
            "model": {k: getattr(c, k) for k in ("hidden_size", "num_hidden_layers",
                      "num_attention_heads", "num_key_value_heads", "intermediate_size",
                      "vocab_size")}, "copy_gb_s": copy_gb_s}  # fmt: skip


def _hf_decode(model: Any, prompts: list[list[int]], new: int, rounds: int) -> dict:
    """The peer of the weights part: transformers' `generate` (greedy, KV cache) of the
    prompts as one batch (all of one length: no padding) with the model in its dtype; the
    decode time is a run to `new` tokens less a run to 1 (the prefill and first token),
    medians over `rounds`."""
    ids = torch.tensor(prompts, device=model.device)
    mask = torch.ones_like(ids)

    def run(n: int) -> float:
        if ids.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
        if ids.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    run(new)  # warm-up
    decode = []
    for _ in range(rounds):
        decode.append(run(new) - run(1))
    med = statistics.median(decode)
    return {"rounds": rounds, "median_decode_s": med, "decode_steps": new - 1,
            "tokens_per_s": len(prompts) * (new - 1) / med}  # fmt: skip


def _blocks(tokens: int, bs: int) -> int:
    return -(-tokens // bs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, in seconds")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--part", choices=("all", "caching", "spec", "weights"), default="all")
    ap.add_argument("--weights", default="int8,int4,fp8",
                    help="--part weights: the low-bit schemes beside the run's dtype")  # fmt: skip
    args = ap.parse_args()
    smoke = args.smoke or not torch.cuda.is_available()
    device = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.bfloat16
    if smoke:
        torch.set_num_threads(1)
    dev = "cpu" if smoke else torch.cuda.get_device_name()
    card = "cpu_smoke" if smoke else torch.cuda.get_device_name().split()[-1].lower()
    if args.part == "weights":
        schemes = [s for s in args.weights.split(",") if s]
        bad = [s for s in schemes if s not in ("int8", "int4", "fp8")]
        if bad:
            ap.error(f"--weights takes int8, int4 and fp8, not {', '.join(bad)}")
        res = weights_part(smoke, device, dtype, schemes, args.rounds if smoke else 5)
        rows = res.pop("rows")
        write_results(args.out, f"engine_weights_{card}.json", dev, rows, smoke=smoke, **res)
        return
    model = _model(smoke, device, dtype)
    if args.part in ("all", "spec"):
        res = spec_part(smoke, device, dtype, args.rounds if smoke else 3)
        rows = res.pop("rows")
        write_results(args.out, f"engine_spec_{card}.json", dev, rows, smoke=smoke, **res)
    if args.part == "spec":
        return
    vocab = model.config.vocab_size
    n_req, new, bs = (8, 16, 16) if smoke else (32, 64, 16)
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(16, 96 if smoke else 480, (n_req,), generator=g).tolist()
    distinct = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    prefix = torch.randint(0, vocab, (4 * bs,), generator=g).tolist()
    shared = [prefix + p for p in distinct]
    opts = dict(block_size=bs, max_model_len=1088, max_num_seqs=n_req,
                max_num_batched_tokens=512 if smoke else 2048, device=device, dtype=dtype)  # fmt: skip
    opts["num_blocks"] = n_req * (-(-(max(lengths) + 4 * bs + new) // bs)) + 8

    # one engine per setting, warmed on a full run of other prompts of the same lengths;
    # every round then brings fresh prompts (the caching engine finds none of them: a 0%
    # hit rate, its pool still holding the earlier rounds' blocks), the settings taking
    # turns first (ABBA), so that neither always follows the other
    def fresh() -> list[list[int]]:
        return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]

    engines = {
        "distinct_caching": _caching_engine(model, True, opts),
        "distinct_no_caching": _caching_engine(model, False, opts),
    }
    warm = fresh()
    for engine, spent in engines.values():
        _run(engine, spent, warm, new)
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for r in range(args.rounds):
        prompts = distinct if r == 0 else fresh()
        for name in list(engines)[:: 1 if r % 2 == 0 else -1]:
            runs[name].append(_run(*engines[name], prompts, new))
    # the issue's second caching figure: time to first token with 90% of the prompt sent
    # before (at least 3x faster with caching wanted)
    ttft = _ttft_shared(engines, vocab, 256 if smoke else 1000, 0.9, args.rounds, g)
    print("time to first token, 90% of the prompt shared:", ttft)
    shared_engine = _caching_engine(model, True, opts)
    _run(*shared_engine, warm, new)
    runs["shared_caching"] = [_run(*shared_engine, shared, new)]
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
    name = "engine_cpu_smoke.json" if smoke else f"engine_{card}.json"
    write_results(args.out, name, dev, rows, smoke=smoke, requests=n_req, new_tokens=new, block_size=bs,
                  prompt_lengths=lengths, prefix_caching_cost_at_0pct=cost,
                  wall_ratio_caching_on_off=on / off, ttft_90pct_shared=ttft)  # fmt: skip


if __name__ == "__main__":
    main()
