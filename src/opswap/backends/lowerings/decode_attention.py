"""opswap::decode_attention has no lowering: it is the decode step of opswap.llm's
static-cache loop, which runs in-process (CUDA graphs) and is never exported."""

from __future__ import annotations

from opswap.backends.lowerings._registry import no_lowering

no_lowering(
    "opswap::decode_attention",
    "a serving op: one decode step over a static KV cache, run in-process (CUDA graphs), "
    "not exported",
    __name__,
)
