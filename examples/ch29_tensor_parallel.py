"""Chapter 29: tensor-parallel serving, one model split over two ranks.

A tiny random Llama (2 layers, 4 query heads over 2 KV heads, MLP 96, vocab 161) serves
three greedy requests twice: in one process, and split over two ranks (`tensor_parallel=2`:
this process is rank 0 and runs the scheduler, rank 1 is spawned and holds the other half
of every layer's heads and MLP columns). On the CPU the ranks talk through gloo; on a host
with two GPUs rank r runs on cuda:r over NCCL. The tokens must be the same; the KV cache of
each rank holds only its KV heads.

    python examples/ch29_tensor_parallel.py
"""

from __future__ import annotations

import time

import torch
import transformers

from opswap.llm import LLMEngine, SamplingParams


def greedy(engine: LLMEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    ids = [engine.add_request(p, SamplingParams(max_tokens=n, temperature=0.0)) for p in prompts]
    out: dict[str, list[int]] = {}
    with torch.inference_mode():
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id] = o.token_ids
    return [out[i] for i in ids]


def main() -> None:
    torch.set_num_threads(1)
    device = "cuda" if torch.cuda.device_count() >= 2 else "cpu"
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, vocab_size=161, initializer_range=0.1,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 161, (n,), generator=g).tolist() for n in (3, 11, 25)]
    kw = dict(block_size=8, max_model_len=64, device=device)

    one = LLMEngine(model, **kw)
    want = greedy(one, prompts, 12)
    t0 = time.perf_counter()
    split = LLMEngine(model, tensor_parallel=2, **kw)
    started = time.perf_counter() - t0
    try:
        got = greedy(split, prompts, 12)
        print(f"one process : {want}")
        print(f"two ranks   : {got} (rank 1 started in {started:.1f} s)")
        assert got == want, "the split engine's greedy tokens differ from one process's"
        print(
            f"rank 0 holds {split.runner.heads} of {one.runner.heads} heads and "
            f"{split.runner.kv_heads} of {one.runner.kv_heads} KV heads; its KV cache "
            f"{tuple(split.k_cache.shape)} against {tuple(one.k_cache.shape)} in one process"
        )
        print(f"blocks in use after the run: {split.stats().blocks.in_use}")
    finally:
        split.close()


if __name__ == "__main__":  # the spawned rank imports this file: run nothing there
    main()
