"""Chapter 29: prompt-lookup speculative decoding and the GPT-2 runner on the CPU.

A tiny random Llama at transformers' default initialisation (its greedy output falls
into loops, text that repeats itself) and a tiny random GPT-2 generate for four prompts
with speculation off and on: the tokens are the same, the steps fewer. Prints steps,
drafts proposed and accepted, and tokens/s (a tiny model on the CPU: the figures show
the mechanism, not a GPU's speed-up).

    python examples/ch29_speculative.py
"""

from __future__ import annotations

import time
from typing import Any

import torch
import transformers

from opswap.llm import LLMEngine, SamplingParams, SpeculativeConfig


def _run(model: Any, prompts: list[list[int]], spec: SpeculativeConfig | None) -> tuple:
    engine = LLMEngine(model, block_size=8, num_blocks=64, max_model_len=120, speculative=spec)
    params = SamplingParams(temperature=0, max_tokens=48)
    for p in prompts:
        engine.add_request(p, params)
    outs: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
    dt = time.perf_counter() - t0
    return [outs[k] for k in sorted(outs)], engine.stats(), dt


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            vocab_size=256,
        )  # fmt: skip
    ).eval()
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_embd=64,
            n_layer=2,
            n_head=4,
            vocab_size=256,
            n_positions=128,
            bos_token_id=0,
            eos_token_id=0,
        )  # fmt: skip
    ).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (8,), generator=g).tolist() * 4 for _ in range(2)]
    prompts += [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 19)]
    for name, model in (("llama", llama), ("gpt2", gpt2)):
        off, s_off, t_off = _run(model, prompts, None)
        on, s_on, t_on = _run(model, prompts, SpeculativeConfig(num_tokens=4))
        assert on == off, "speculation changed greedy tokens"
        n = sum(len(t) for t in on)
        print(f"{name}: {n} tokens; off {s_off.steps} steps ({n / t_off:.0f} tokens/s), "
              f"on {s_on.steps} steps ({n / t_on:.0f} tokens/s), "
              f"{s_on.accepted_tokens} of {s_on.draft_tokens} drafts accepted; "
              f"tokens identical: yes; blocks in use after: {s_on.blocks.in_use}")  # fmt: skip


if __name__ == "__main__":
    main()
