"""Optimizers built on opswap's fused kernels.

    opt = opswap.train.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)

is torch.optim.AdamW (same arguments, same state_dict keys: `step`, `exp_avg`,
`exp_avg_sq`, `max_exp_avg_sq`) whose step is one fused pass over all the parameters of
a dtype on a GPU (`opswap::adamw`, kernels/adamw.py), and torch's `_foreach` steps
elsewhere. The moment estimates are float32 whatever the parameter's dtype, so a bf16
model keeps full-precision optimizer state (torch's AdamW keeps them in the parameter's
dtype).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from opswap.errors import OpswapError
from opswap.kernels import adamw as _adamw

__all__ = ["AdamW", "OptimizerError"]


class OptimizerError(OpswapError, ValueError):
    """An optimizer was given a setting or a parameter it cannot take."""


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
        for group in self.param_groups:
            params, grads, ms, vs, mx, steps = [], [], [], [], [], []
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
                params.append(p)
                grads.append(p.grad)
                ms.append(state["exp_avg"])
                vs.append(state["exp_avg_sq"])
                if amsgrad:
                    mx.append(state["max_exp_avg_sq"])
                steps.append(float(state["step"]))
            if not params:
                continue
            beta1, beta2 = group["betas"]
            _adamw.adamw(
                params, grads, ms, vs, mx, steps,
                float(group["lr"]), float(beta1), float(beta2),
                float(group["weight_decay"]), float(group["eps"]), bool(group["maximize"]),
            )  # fmt: skip
        return loss
