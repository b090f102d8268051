"""Whether a module is already distributed (DDP, FSDP, DTensor parameters), and torch's
FSDP2 entry points across versions: shared by train.prepare (which refuses such a model)
and train.distributed (which wraps a prepared one)."""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from torch import nn

__all__ = ["dtensor_type", "fully_shard_function", "wrapped_how"]


def dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return None
    return DTensor


def fully_shard_function() -> Callable[..., nn.Module]:
    """torch's FSDP2 `fully_shard`: public in torch.distributed.fsdp (torch 2.6 on), in
    torch.distributed._composable.fsdp before."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard  # type: ignore[no-redef]
    return fully_shard  # type: ignore[return-value]


def _fsdp2_module_type() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import FSDPModule  # type: ignore[no-redef]
        except ImportError:
            return None
    return FSDPModule


def wrapped_how(module: nn.Module) -> str | None:
    """How `module` is already distributed, in words ("wrapped in DistributedDataParallel",
    ...), or None when it is a plain module."""
    if not dist.is_available():
        return None
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        return "wrapped in DistributedDataParallel"
    if isinstance(module, FullyShardedDataParallel):
        return "wrapped in FullyShardedDataParallel"
    fsdp2 = _fsdp2_module_type()
    if fsdp2 is not None and any(isinstance(m, fsdp2) for m in module.modules()):
        return "sharded by fully_shard (FSDP2)"
    dtensor = dtensor_type()
    if dtensor is not None and any(isinstance(p, dtensor) for p in module.parameters()):
        return "sharded (its parameters are DTensors)"
    return None
