"""Chapter 29: greedy decoding with a static KV cache and split-K decode attention.

A tiny random Llama (2 layers, 4 query heads over 2 kv heads, head dim 64) generates 16
tokens after a 6-token prompt, once through transformers' `generate(do_sample=False)`
and once through opswap's StaticDecoder; the tokens must be the same, and the decode
steps' logits agree with HF's forward over the same sequence. Then the decode attention
op alone against SDPA over a half-filled cache. On the CPU the decoder runs its CPU step
(opswap/llm/cpu_step.py) and the op its PyTorch reference; with a CUDA GPU the Triton
kernels run and the step is replayed as one CUDA graph.

    python examples/ch29_static_cache.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers

from opswap.kernels.decode_attention import decode_attention, plan_splits
from opswap.llm import StaticDecoder


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, intermediate_size=256, vocab_size=256, initializer_range=0.1,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).eval().to(device)
    prompt = torch.randint(0, 256, (1, 6), device=device)
    n = 16

    want = model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=False,
        eos_token_id=None,
    )  # fmt: skip
    dec = StaticDecoder(model, max_len=32)
    tokens, _, steps = dec.generate_with_logits(prompt, n)
    print("HF generate :", want[0, 6:].tolist())
    print("StaticDecoder:", tokens[0, 6:].tolist())
    assert torch.equal(tokens, want), "StaticDecoder's greedy tokens differ from HF's"
    with torch.no_grad():
        ref = model(want[:, :-1]).logits[:, 6:]
    err = float((steps - ref).abs().max())
    print(f"decode-step logits vs HF forward: max abs diff {err:.2e}")
    cache_mib = dec.cache.nbytes / 2**20
    print(f"static cache: {cache_mib:.2f} MiB for {dec.max_len} positions, allocated once")

    q = torch.randn(2, 8, 1, 64, device=device)
    k, v = torch.randn(2, 2, 100, 64, device=device), torch.randn(2, 2, 100, 64, device=device)
    lengths = torch.tensor([100, 37], dtype=torch.int32, device=device)
    o = decode_attention(q, k, v, lengths)
    keep = (torch.arange(100, device=device)[None, :] < lengths[:, None])[:, None, None, :]
    ref_o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)
    how = "the PyTorch reference on the CPU"
    if device == "cuda":
        splits, per = plan_splits(2, 2, 100, torch.device(device))
        how = f"Triton, {splits} splits of {per} keys"
    print(
        f"decode_attention over a cache of 100 keys, lengths {lengths.tolist()}: "
        f"max abs diff vs SDPA {float((o - ref_o).abs().max()):.2e} ({how})"
    )


if __name__ == "__main__":
    main()
