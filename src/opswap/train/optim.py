"""Optimizers built on opswap's fused kernels.

    opt = opswap.train.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)

is torch.optim.AdamW (same arguments, same state_dict keys: `step`, `exp_avg`,
`exp_avg_sq`, `max_exp_avg_sq`) whose step is one fused pass over all the parameters of
a dtype on a GPU (`opswap::adamw`, kernels/adamw.py), and torch's `_foreach` steps
elsewhere. The moment estimates are float32 whatever the parameter's dtype, so a bf16
model keeps full-precision optimizer state (torch's AdamW keeps them in the parameter's
dtype).

Sharded parameters (FSDP2's `fully_shard`, tensor parallelism: DTensors) are stepped shard
by shard: AdamW is elementwise, so when a parameter, its gradient and its moment
estimates are laid out alike, the update of each rank's local shard is the update of the
whole (the kernel reads `.to_local()` tensors). A gradient laid out otherwise (a partial
sum, another mesh) takes torch's `_foreach` steps on the DTensors, which redistribute it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from opswap.errors import OpswapError
from opswap.kernels import adamw as _adamw
from opswap.train._wrapped import dtensor_type

__all__ = ["AdamW", "OptimizerError"]


class OptimizerError(OpswapError, ValueError):
    """An optimizer was given a setting or a parameter it cannot take."""


def _local(tensors: list[torch.Tensor], dtensor: type | None) -> list[torch.Tensor] | None:
    """The local shards of `tensors` when every one is a DTensor laid out as the first
    (same mesh, same placements), so that the elementwise step of each shard is the step
    of the whole; None when none is a DTensor or they differ (the caller steps the
    DTensors themselves)."""
    if dtensor is None or not isinstance(tensors[0], dtensor):
        return None
    spec = (tensors[0].device_mesh, tuple(tensors[0].placements))  # type: ignore[attr-defined]
    for t in tensors:
        if not isinstance(t, dtensor) or (t.device_mesh, tuple(t.placements)) != spec:  # type: ignore[attr-defined]
            return None
    return [t.to_local() for t in tensors]  # type: ignore[attr-defined]


def _state_dtype(p: torch.Tensor) -> torch.dtype:
    return torch.float32 if p.dtype in (torch.bfloat16, torch.float16) else p.dtype


class AdamW(torch.optim.Optimizer):
    """AdamW with a fused step: the update torch.optim.AdamW makes (decoupled weight decay,
    bias correction, optional amsgrad and maximize), one kernel launch per parameter dtype
    on CUDA."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        amsgrad: bool = False,
        maximize: bool = False,
    ) -> None:
        if isinstance(lr, torch.Tensor) or not 0.0 <= lr:
            raise OptimizerError(f"lr must be a non-negative float, not {lr!r}.")
        if not 0.0 <= eps:
            raise OptimizerError(f"eps must be non-negative, not {eps}.")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise OptimizerError(f"betas must be two numbers in [0, 1), not {betas!r}.")
        if not 0.0 <= weight_decay:
            raise OptimizerError(f"weight_decay must be non-negative, not {weight_decay}.")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
        }
        super().__init__(params, defaults)

    def _init_state(self, p: torch.Tensor, amsgrad: bool) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            dtype = _state_dtype(p)
            fmt = torch.contiguous_format if p.is_contiguous() else torch.preserve_format
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=fmt)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=fmt)
            if amsgrad:
                state["max_exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=fmt)
        elif amsgrad and "max_exp_avg_sq" not in state:  # amsgrad turned on mid-run
            state["max_exp_avg_sq"] = torch.zeros_like(state["exp_avg_sq"])
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, then the moment estimates of a bf16/fp16 param put back in float32
        (torch's load casts every state tensor to its param's dtype), each a copy."""
        super().load_state_dict(state_dict)
        saved = state_dict["state"]
        for g_saved, group in zip(state_dict["param_groups"], self.param_groups, strict=True):
            for pid, p in zip(g_saved["params"], group["params"], strict=True):
                if pid not in saved or p not in self.state:
                    continue
                for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                    if isinstance(saved[pid].get(k), torch.Tensor):
                        v = saved[pid][k].to(device=p.device, dtype=_state_dtype(p), copy=True)
                        self.state[p][k] = v
                # a step of its own: torch's load would share the saved dict's counter
                self.state[p]["step"] = torch.tensor(float(saved[pid].get("step", 0.0)))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step for every parameter that has a gradient; returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        dtensor = dtensor_type()
        for group in self.param_groups:
            params, grads, ms, vs, mx, steps = [], [], [], [], [], []
            spread: list[list[torch.Tensor]] = []  # DTensors whose gradient is laid out otherwise
            amsgrad = bool(group["amsgrad"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise OptimizerError(
                        "AdamW does not take sparse gradients; use torch.optim.SparseAdam."
                    )
                if p.is_complex():
                    raise OptimizerError(
                        "opswap's AdamW takes real parameters; use torch.optim.AdamW for "
                        "complex ones."
                    )
                state = self._init_state(p, amsgrad)
                state["step"] += 1
                row = [p, p.grad, state["exp_avg"], state["exp_avg_sq"]]
                if amsgrad:
                    row.append(state["max_exp_avg_sq"])
                local = _local(row, dtensor)
                if local is None and dtensor is not None and isinstance(p, dtensor):
                    if not isinstance(row[1], dtensor):
                        raise OptimizerError(
                            "A sharded (DTensor) parameter has a plain tensor as its gradient; "
                            "let the sharding wrapper (FSDP2, tensor parallelism) set it."
                        )
                    spread.append(row + [state["step"]])
                    continue
                row = local if local is not None else row
                params.append(row[0])
                grads.append(row[1])
                ms.append(row[2])
                vs.append(row[3])
                if amsgrad:
                    mx.append(row[4])
                steps.append(float(state["step"]))
            beta1, beta2 = group["betas"]
            hyper = (
                float(group["lr"]), float(beta1), float(beta2),
                float(group["weight_decay"]), float(group["eps"]), bool(group["maximize"]),
            )  # fmt: skip
            if params:
                _adamw.adamw(params, grads, ms, vs, mx, steps, *hyper)
            for row in spread:  # torch's ops on the DTensors: they redistribute the gradient
                _adamw.foreach_step(
                    _adamw.Tensors([row[0]], [row[1]], [row[2]], [row[3]],
                                   [row[4]] if amsgrad else [], [float(row[-1])]),
                    _adamw.Hyper(*hyper),
                )  # fmt: skip
        return loss
