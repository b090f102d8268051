"""A module replayed from CUDA graphs, one per input signature: the race's
`opswap+cudagraph` variant, and what `load_optimized` returns when that variant won.

On a GPU a graph of many small kernels is often bound by the host: every op of opswap's
eager graph goes through Python and the dispatcher before its kernel starts (about
10 µs each on an H100 host), so a BERT-base layer at batch 1 launches slower than the
GPU runs it. A CUDA graph records the launches once and replays them with one call.
`CudaGraphed` captures the wrapped module the first time it sees an input signature
(shapes, strides, dtypes, device): three warm-up calls on a side stream, then one call
under `torch.cuda.graph`, into input buffers it owns. A later call with that signature
copies the inputs into those buffers, replays the graph and returns copies of its
outputs (the graph writes the same buffers on every replay, so handing them out would
let the next call change what the caller holds). Any other call (keyword inputs, a
non-tensor or CPU input) runs the module as it is.

A model whose forward synchronises with the host (`.item()`, a data-dependent branch)
cannot be captured: `CudaGraphed.capture` raises, and the race lists the variant as
failed with that reason.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

#: warm-up calls before a capture (cuBLAS and Triton pick and load their kernels there)
WARMUP = 3


class CudaGraphed(nn.Module):
    """`module` replayed from a CUDA graph per input signature (see the module's
    docstring)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self._graphs: dict[tuple, tuple[list[torch.Tensor], torch.cuda.CUDAGraph, Any]] = {}

    @staticmethod
    def _key(args: tuple) -> tuple | None:
        if not args or not all(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
            return None
        return tuple((tuple(a.shape), a.stride(), a.dtype, a.device) for a in args)

    def capture(self, *args: torch.Tensor) -> None:
        """Record the graph for the signature of `args` now (raises where the module cannot
        be captured)."""
        key = self._key(args)
        if key is None:
            raise ValueError("a CUDA graph takes CUDA tensors as positional inputs only")
        # normal tensors even when the first call comes under torch.inference_mode: a later
        # call outside it copies into them, which an inference tensor refuses (seen in the
        # race on an H100: captured under inference_mode, verified under no_grad)
        with torch.inference_mode(False):
            static = [a.detach().clone() for a in args]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                self.module(*static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.module(*static)
        self._graphs[key] = (static, graph, out)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        key = None if kwargs else self._key(args)
        if key is None:
            return self.module(*args, **kwargs)
        if key not in self._graphs:
            self.capture(*args)
        static, graph, out = self._graphs[key]
        for buffer, a in zip(static, args, strict=True):
            buffer.copy_(a)
        graph.replay()
        return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)

    def extra_repr(self) -> str:
        return f"{len(self._graphs)} graph(s) captured"
