"""Chapter 29: the serving engine on the CPU: a paged KV cache, prefix caching,
continuous batching and sampling, through `opswap.llm.generate` and `LLMEngine`.

A tiny random Llama (2 layers, hidden 64, vocab 256) answers six prompts of mixed
lengths, four of them sharing a 24-token prefix: greedy (checked against transformers'
`generate` for one prompt) and sampled with a seed (the same seed gives the same sample
again). Then requests join a running engine between steps and one is aborted. Prints
tokens/s and the KV pool's statistics: blocks in use after the run (0), prefix-cache
hit rate, share of allocated slots holding tokens.

    python examples/ch29_generate.py
"""

from __future__ import annotations

import time

import torch
import transformers

from opswap.llm import LLMEngine, SamplingParams, generate


def main() -> None:
    torch.set_num_threads(1)  # tiny GEMMs: threads cost more than they give
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=256, initializer_range=0.1,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(0, 256, (24,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 9, 1, 14)]
    prompts += [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 31)]
    opts = dict(block_size=8, num_blocks=48, max_model_len=96, max_num_batched_tokens=32)

    engine = LLMEngine(model, **opts)
    greedy = SamplingParams(temperature=0, max_tokens=24)
    t0 = time.perf_counter()
    results = generate(engine, prompts, greedy)
    dt = time.perf_counter() - t0
    n = sum(len(r.token_ids) for r in results)
    s = engine.stats()
    print(f"greedy: {len(prompts)} prompts, {n} tokens in {dt:.2f} s ({n / dt:.0f} tokens/s, "
          f"{s.steps} steps, {s.tokens_computed} tokens computed)")  # fmt: skip
    print(f"  prefix cache: {s.blocks.hit_blocks} of {s.blocks.queried_blocks} prompt blocks "
          f"found ({s.blocks.hit_rate:.0%}); blocks in use after the run: {s.blocks.in_use}")  # fmt: skip
    for r in results[:3]:
        print(f"  {len(r.prompt_ids):2d}-token prompt ({r.num_cached_tokens} cached) -> "
              f"{r.token_ids[:10]} ... ({r.finish_reason})")  # fmt: skip
    ids = torch.tensor([prompts[4]])
    want = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
        eos_token_id=None, pad_token_id=0,
    )[0, ids.shape[1] :].tolist()  # fmt: skip
    assert results[4].token_ids == want, "greedy tokens differ from transformers'"
    print("  tokens equal to transformers' generate(do_sample=False): yes")

    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=16, seed=7,
                             logprobs=2)  # fmt: skip
    a = generate(engine, prompts, sampled)
    b = generate(engine, [prompts[2]], sampled)
    assert a[2].token_ids == b[0].token_ids, "a seeded request drew differently in a batch"
    lp = a[2].logprobs[0] if a[2].logprobs else None
    print(f"sampled (seed 7): {a[2].token_ids} (same alone and in the batch); first token "
          f"logprob {lp.logprob:.3f}, top 2 {[(t, round(p, 3)) for t, p in lp.top]}"
          if lp else "")  # fmt: skip

    # continuous batching: requests join between steps; one is aborted halfway
    engine = LLMEngine(model, **opts)
    util, step = [], 0
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=20), f"r{i}")
        engine.step()
        util.append(engine.stats().blocks.utilisation)
    engine.abort("r1")
    while engine.has_unfinished():
        engine.step()
        util.append(engine.stats().blocks.utilisation)
        step += 1
    s = engine.stats()
    print(f"streaming: 6 requests joining one per step, r1 aborted; {s.steps} steps, "
          f"slots holding tokens {min(util):.0%}-{max(util):.0%} of allocated, "
          f"blocks in use at the end: {s.blocks.in_use}")  # fmt: skip


if __name__ == "__main__":
    main()
