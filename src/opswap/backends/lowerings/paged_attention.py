"""opswap::paged_decode_attention and opswap::paged_prefill_attention have no lowering: they
are the attention of opswap.llm's serving engine over its paged KV cache (block tables,
per-sequence lengths), which runs in-process and is never exported; ONNX has no op that
reads a cache through a block table."""

from __future__ import annotations

from opswap.backends.lowerings._registry import no_lowering

for _op in ("opswap::paged_decode_attention", "opswap::paged_prefill_attention"):
    no_lowering(
        _op,
        "a serving op: attention over a paged KV cache through block tables, run in-process "
        "by the serving engine, not exported",
        __name__,
    )
