"""opswap::topk -> TopK over the last axis (the values as they are, int64 indices);
opswap::approx_topk -> the exact TopK: ONNX has no bucketed top-k, and the exact one
returns every value the bucketed one may return, so its recall is 1."""

from __future__ import annotations

from typing import Any  # onnxscript values: see _onnx

from opswap.backends.lowerings._onnx import ints, op
from opswap.backends.lowerings._registry import lowering


@lowering("opswap::topk", "TopK over the last axis")
def topk(x: Any, k: int, largest: bool, sorted: bool) -> tuple[Any, Any]:
    v, i = op.TopK(x, ints([k]), axis=-1, largest=int(bool(largest)), sorted=int(bool(sorted)))
    return v, i


@lowering("opswap::approx_topk", "TopK over the last axis (exact: recall 1)")
def approx_topk(x: Any, k: int, largest: bool, buckets: int, per_bucket: int) -> tuple[Any, Any]:
    v, i = op.TopK(x, ints([k]), axis=-1, largest=int(bool(largest)), sorted=1)
    return v, i
