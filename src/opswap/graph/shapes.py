"""Shape and dtype of every node, from one real run of the captured graph.

Both capture paths run `ShapeProp`, so every node carries
`node.meta["tensor_meta"]` in the same form; `info(node)` reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}[{','.join(map(str, self.shape))}]"


def _itemsize(dtype: torch.dtype) -> int:
    if dtype == torch.bool:
        return 1
    return torch.empty((), dtype=dtype).element_size()


def propagate(gm: fx.GraphModule, example_inputs: tuple) -> None:
    """Annotate every node of gm with shapes and dtypes by running it once (no grad)."""
    with torch.no_grad():
        ShapeProp(gm).propagate(*example_inputs)


def _flatten(meta) -> list[TensorInfo]:
    if isinstance(meta, TensorMetadata):
        return [TensorInfo(tuple(int(s) for s in meta.shape), meta.dtype)]
    if isinstance(meta, torch.Tensor):
        return [TensorInfo(tuple(int(s) for s in meta.shape), meta.dtype)]
    if isinstance(meta, (list, tuple)):
        return [t for m in meta for t in _flatten(m)]
    if isinstance(meta, dict):
        return [t for m in meta.values() for t in _flatten(m)]
    return []


def infos(node: fx.Node) -> list[TensorInfo]:
    """All tensors a node produces (several for tuple outputs), in order."""
    if "tensor_meta" in node.meta:
        return _flatten(node.meta["tensor_meta"])
    if "val" in node.meta:
        return _flatten(node.meta["val"])
    return []


def info(node) -> TensorInfo | None:
    """The (first) tensor a node produces, or None for non-tensor values and constants."""
    if not isinstance(node, fx.Node):
        return None
    found = infos(node)
    return found[0] if found else None


def shape(node) -> tuple[int, ...] | None:
    i = info(node)
    return i.shape if i is not None else None
