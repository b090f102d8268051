"""LLM inference for Hugging Face Llama-style models (chapter 29): a static KV cache,
split-K decode attention and greedy generation with CUDA graphs; and a serving engine
(paged KV cache, prefix caching, continuous batching, sampling) with offline `generate`.

    from opswap.llm import StaticDecoder
    tokens = StaticDecoder(model, max_len=256).generate(input_ids, max_new_tokens=64)

    from opswap.llm import SamplingParams, generate
    results = generate(model, [[1, 2, 3], [4, 5]], SamplingParams(temperature=0))
"""

from opswap.llm.blocks import BlockError, BlockManager, BlockStats
from opswap.llm.check import verify_decoder
from opswap.llm.decode import StaticDecoder
from opswap.llm.engine import EngineError, EngineStats, LLMEngine, RequestOutput
from opswap.llm.generate import GenerateResult, generate
from opswap.llm.hf_decoder import SUPPORTED, HFDecoder
from opswap.llm.quant import QuantError, WeightQuant, WeightStats
from opswap.llm.runner import ModelRunner, RunnerError, make_runner, register_runner
from opswap.llm.sampling import SamplingError, SamplingParams, TokenLogprob
from opswap.llm.speculative import SpeculativeConfig, SpeculativeError
from opswap.llm.static_cache import DecodeError, StaticKVCache

__all__ = [
    "SUPPORTED",
    "BlockError",
    "BlockManager",
    "BlockStats",
    "DecodeError",
    "EngineError",
    "EngineStats",
    "GenerateResult",
    "HFDecoder",
    "LLMEngine",
    "ModelRunner",
    "QuantError",
    "RequestOutput",
    "RunnerError",
    "SamplingError",
    "SamplingParams",
    "SpeculativeConfig",
    "SpeculativeError",
    "StaticDecoder",
    "StaticKVCache",
    "TokenLogprob",
    "WeightQuant",
    "WeightStats",
    "generate",
    "make_runner",
    "register_runner",
    "verify_decoder",
]
