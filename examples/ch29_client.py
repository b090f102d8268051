"""Chapter 29: an OpenAI-compatible server over the serving engine, and a client.

Starts `opswap.llm.server` on a free loopback port (uvicorn on a thread of this process)
with a tiny random Llama and a BPE tokenizer trained here on a few sentences, then talks
to it with httpx as any OpenAI client would: a completion, the same one streamed as
server-sent events (the pieces join to the same text), a chat completion through the
tokenizer's chat template, and a 400 for a bad request. The model's weights are random,
so the text is gibberish; the tokens are what `opswap.llm.generate` gives.

    python examples/ch29_client.py
    # the same against a real server:  opswap serve hf:llama --port 8000
"""

from __future__ import annotations

import json

import httpx
import torch
import transformers

from opswap.llm import LLMEngine
from opswap.llm.server import ServerThread, build_app
from opswap.llm.tokenizer import train_tokenizer

TEXTS = [
    "A server streams tokens to many clients at once.",
    "Each request gets its own queue of token deltas and its own blocks of KV cache.",
] * 3


def main() -> None:
    torch.set_num_threads(1)
    tok = train_tokenizer(TEXTS, 300)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=len(tok), initializer_range=0.1,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).eval()
    engine = LLMEngine(model, block_size=8, num_blocks=64, max_model_len=128)
    app = build_app(engine, tok, "tiny-llama")

    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        print(f"serving at {url}/v1: {client.get('/v1/models').json()['data'][0]['id']}")
        body = {"model": "tiny-llama", "prompt": "A server streams", "max_tokens": 12,
                "temperature": 0}  # fmt: skip
        r = client.post("/v1/completions", json=body).json()
        print(f"completion: {r['choices'][0]['text']!r} ({r['choices'][0]['finish_reason']}, "
              f"usage {r['usage']})")  # fmt: skip

        pieces = []
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    pieces.append(json.loads(line[6:])["choices"][0]["text"])
        print(f"streamed in {len(pieces)} events: {pieces}")
        print(f"  joined == the completion: {''.join(pieces) == r['choices'][0]['text']}")

        chat = {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8,
                "temperature": 0}  # fmt: skip
        c = client.post("/v1/chat/completions", json=chat).json()
        print(f"chat: {c['choices'][0]['message']}")

        bad = client.post("/v1/completions", json={**body, "temperature": -1})
        print(f"a bad request: {bad.status_code} {bad.json()['error']['message']}")
        blocks = [x for x in client.get("/metrics").text.splitlines() if "kv_blocks" in x]
        print("metrics: " + "; ".join(x for x in blocks if not x.startswith("#")))


if __name__ == "__main__":
    main()
