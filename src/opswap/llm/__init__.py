"""LLM inference: a static KV cache, split-K decode attention and greedy generation with
CUDA graphs for Hugging Face Llama-style models (chapter 29).

    from opswap.llm import StaticDecoder
    tokens = StaticDecoder(model, max_len=256).generate(input_ids, max_new_tokens=64)
"""

from opswap.llm.check import verify_decoder
from opswap.llm.decode import StaticDecoder
from opswap.llm.hf_decoder import SUPPORTED, HFDecoder
from opswap.llm.static_cache import DecodeError, StaticKVCache

__all__ = [
    "SUPPORTED",
    "DecodeError",
    "HFDecoder",
    "StaticDecoder",
    "StaticKVCache",
    "verify_decoder",
]
