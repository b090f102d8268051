"""A prepared model trained by several processes: DistributedDataParallel and FSDP2.

    dist.init_process_group("nccl")                      # in each process
    prepared = opswap.train.prepare(model, (ids, labels), loss_fn, target="h100")
    ddp = opswap.train.distributed.wrap(prepared, mode="ddp")      # or mode="fsdp2"
    opt = opswap.train.optim.AdamW(ddp.parameters())
    for ids, labels in data:                             # this rank's share of the batch
        ddp(ids, labels).backward(); opt.step(); opt.zero_grad()
    model.load_state_dict(full_state_dict(ddp))          # every rank calls it

The order is prepare, then wrap. `prepare` captures and checks a model on one process;
DDP and FSDP2 then work on what it returns as on any module: DDP's hooks sit on the
parameters' gradient accumulators, which the fused ops' backward feeds as aten's do, and
FSDP2 all-gathers the parameters before the prepared graph runs, so the kernels see whole,
plain tensors. The other order is refused: a model already wrapped (DDP, FSDP, DTensor
parameters) is not something `prepare` captures.

FSDP2 shards the prepared module as one unit. The prepared graph reads every parameter
directly (it calls no submodule's forward), so a `fully_shard` on a submodule would never
see its forward and its parameters would stay sharded: wrap shards the root only, which
shards the gradients and the optimizer's state (the parameters are gathered for the whole
step). FSDP2 replaces the parameters by new DTensor Parameters, so after `wrap(...,
"fsdp2")` the user's model no longer holds the trained ones; `full_state_dict` gathers
them under the model's own names. Under DDP the parameters stay the user's own.

BatchNorm: as in any DDP run, each rank normalises by its own batch and DDP copies rank 0's
buffers to the others before each forward (`broadcast_buffers=True`). SyncBatchNorm is the
user's choice: `wrap(..., sync_batchnorm=True)` (or `convert_sync_batchnorm(prepared)`, or
torch's `nn.SyncBatchNorm.convert_sync_batchnorm(prepared)`) converts the BatchNorm
modules the prepared graph calls (their parameters and statistics stay the model's own);
opswap's refuses when the graph holds BatchNorm as ATen ops with no module to convert.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import fx, nn

from opswap.errors import OpswapError
from opswap.train._wrapped import dtensor_type, fully_shard_function, wrapped_how

if TYPE_CHECKING:
    from opswap.train.prepare import Prepared

__all__ = [
    "MODES",
    "DistributedError",
    "convert_sync_batchnorm",
    "full_state_dict",
    "wrap",
    "wrapped_how",
]

#: the ways `wrap` distributes a prepared module
MODES = ("ddp", "fsdp2")


class DistributedError(OpswapError, ValueError):
    """A prepared model cannot be distributed as asked."""


def _prepared_of(module: nn.Module) -> Any:
    """The Prepared inside `module` (itself, or a DDP's `.module`), or None."""
    from opswap.train.prepare import Prepared

    inner = getattr(module, "module", module)
    return inner if isinstance(inner, Prepared) else None


def _batchnorm_ops(gm: fx.GraphModule) -> list[str]:
    """Names of the nodes that compute a batch norm as an ATen op (not a module call)."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and "batch_norm" in str(node.target):
            out.append(node.name)
    return out


def convert_sync_batchnorm(prepared: Prepared) -> Prepared:
    """`prepared` with the BatchNorm modules its graph calls turned into SyncBatchNorm (in
    place; returned for chaining). The converted modules hold the model's own Parameters
    and running statistics. Refused when the graph computes BatchNorm as ATen ops (the
    capture went through torch.export): there is no module to convert."""
    from opswap.train.prepare import Prepared

    if not isinstance(prepared, Prepared):
        raise DistributedError(
            "convert_sync_batchnorm takes the module opswap.train.prepare returns, not a "
            f"{type(prepared).__name__}."
        )
    ops = _batchnorm_ops(prepared.graph)
    if ops:
        raise DistributedError(
            f"The prepared graph computes BatchNorm as ATen ops ({', '.join(ops[:3])}: the "
            "capture went through torch.export), with no module to convert to SyncBatchNorm; "
            "leave it as it is (each rank normalises by its own batch)."
        )
    prepared.graph = nn.SyncBatchNorm.convert_sync_batchnorm(prepared.graph)
    return prepared


def _device_type(module: nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def wrap(
    prepared: nn.Module,
    mode: str = "ddp",
    *,
    mesh: Any = None,
    sync_batchnorm: bool = False,
    **options: Any,
) -> nn.Module:
    """`prepared` (what `opswap.train.prepare` returned) distributed over the default
    process group: `mode="ddp"` wraps it in DistributedDataParallel (on a GPU, on the
    parameters' device), `mode="fsdp2"` shards it with `fully_shard` as one unit over
    `mesh` (default: a 1-D mesh of every rank on the parameters' device type). `options`
    go to DistributedDataParallel or fully_shard as they are (e.g. `mp_policy`,
    `broadcast_buffers`). `sync_batchnorm` converts the BatchNorm modules the graph calls
    to SyncBatchNorm first. Returns the wrapped module; call it as the prepared one."""
    from opswap.train.prepare import Prepared

    if mode not in MODES:
        raise DistributedError(f"mode must be one of {', '.join(MODES)}, not {mode!r}.")
    if not isinstance(prepared, nn.Module):
        raise DistributedError(f"wrap takes a prepared nn.Module, not {type(prepared).__name__}.")
    how = wrapped_how(prepared)
    if how is not None:
        raise DistributedError(f"{type(prepared).__name__} is already {how}; wrap it once.")
    if not isinstance(prepared, Prepared):
        raise DistributedError(
            f"wrap takes the module opswap.train.prepare returns, not a {type(prepared).__name__}; "
            "wrap a plain model with DistributedDataParallel or fully_shard directly."
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise DistributedError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group "
            "in every process before wrap."
        )
    device = _device_type(prepared)
    if sync_batchnorm:
        if device.type == "cpu":
            raise DistributedError(
                "SyncBatchNorm runs on GPUs only (DistributedDataParallel refuses it on the "
                "CPU); leave sync_batchnorm off there."
            )
        convert_sync_batchnorm(prepared)
    try:
        if mode == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            if device.type == "cuda" and "device_ids" not in options:
                options["device_ids"] = [device.index]
            return DistributedDataParallel(prepared, **options)
        if mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        return fully_shard_function()(prepared, mesh=mesh, **options)
    except TypeError as e:  # an option the wrapper does not take
        what = "DistributedDataParallel" if mode == "ddp" else "fully_shard"
        raise DistributedError(f"{what} refused the options {sorted(options)}: {e}.") from None


def full_state_dict(wrapped: nn.Module) -> dict[str, torch.Tensor]:
    """The trained parameters and buffers of a wrapped (or plain) prepared module under
    the user's model's names, whole tensors: load them with `model.load_state_dict`. Under
    FSDP2 it gathers the shards, a collective: every rank calls it. An entry of the model
    that the prepared graph does not hold (a buffer the capture found constant) is left
    out: the model keeps its own."""
    prepared = _prepared_of(wrapped)
    if prepared is None:
        raise DistributedError(
            f"full_state_dict takes a prepared module or one wrapped by wrap, not a "
            f"{type(wrapped).__name__}."
        )
    dtensor = dtensor_type()
    held: dict[str, torch.Tensor] = {}
    for key, value in prepared.state_dict().items():
        name = key.removeprefix("graph.")
        if prepared.with_loss:
            name = name.removeprefix("model.")
        if dtensor is not None and isinstance(value, dtensor):
            value = value.full_tensor()  # type: ignore[attr-defined]
        held[name] = value
    out: dict[str, torch.Tensor] = {}
    for group in prepared.model_keys:  # a tied weight is held under one of its names
        found = next((held[k] for k in group if k in held), None)
        if found is not None:
            out.update(dict.fromkeys(group, found))
    return out
