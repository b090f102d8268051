"""What the GPU low-bit rules (precision.int8_weight_only, precision.int4_weight_only,
precision.fp8_linear) share: reading a Linear site (its weight, dtype, device and rows),
installing the replacement module, and pricing a GEMM by the roofline."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from opswap.cost import NodeCost
from opswap.graph.ops import arg, module_of
from opswap.graph.shapes import info
from opswap.rules._cost import op_time
from opswap.rules._edits import install_module, swap_in_module
from opswap.rules._matching import input_of
from opswap.rules._weights import Weighted, weighted
from opswap.rules.base import Found, Refused
from opswap.rules.precision._lowbit_modules import FP8Linear, WeightOnlyLinear
from opswap.targets.base import Target

HALF = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class LinearSite:
    w: Weighted
    rows: int  # rows (batch x tokens) at the example shape
    k: int
    n: int


def read_site(node: fx.Node, gm: fx.GraphModule, scheme: str) -> LinearSite | Refused | None:
    """The Linear at `node` if the low-bit GPU schemes can take it, or why not."""
    if isinstance(module_of(node), (WeightOnlyLinear, FP8Linear)):
        return None  # already low-bit
    w = weighted(gm, node)
    if isinstance(w, str):
        return Refused(w)
    dtype = w.weight.dtype
    if dtype not in HALF:
        name = str(dtype).removeprefix("torch.")
        return Refused(
            f"{node.name}'s weight is {name}; {scheme} is offered for bfloat16 and float16 "
            "layers (cast the model to bfloat16 first)"
        )
    why = gpu_reason(w.weight.device, scheme)
    if why:
        return Refused(f"{node.name}'s weight is on {why}")
    n, k = w.weight.shape
    x = input_of(node)
    xi = info(x) if x is not None else None
    if xi is None or xi.dtype != dtype:
        return Refused(f"the input of {node.name} is not a {dtype} tensor of known shape")
    return LinearSite(w, xi.numel // max(k, 1), k, n)


def gpu_reason(device: torch.device, scheme: str) -> str | None:
    """Why `device` cannot run the low-bit kernels (completing "the weight is on ..."), or
    None: a CUDA GPU of compute capability 8.0 or later (bfloat16 tensor cores)."""
    if device.type != "cuda":
        return (
            f"the {device.type}; {scheme} runs its kernel on a CUDA GPU (optimize with "
            "--device cuda)"
        )
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 0):
        return (
            f"a GPU of compute capability {cap[0]}.{cap[1]}; {scheme} needs 8.0 or later "
            "(bfloat16 tensor cores)"
        )
    return None


def found(node: fx.Node, site: LinearSite, description: str) -> Found:
    return Found(
        (node,), description, dict(w=site.w, rows=site.rows), record=dict(linear=node.name)
    )


def install(gm: fx.GraphModule, node: fx.Node, mod: torch.nn.Module, suffix: str) -> None:
    if node.op == "call_module":
        install_module(gm, node, mod, str(node.target))
        return
    swap_in_module(
        gm,
        mod,
        (input_of(node),),
        node,
        [node],
        f"{node.name}_{suffix}",
        home=arg(node, 1, "weight"),
    )


def bf16_gemm(m: int, k: int, n: int, bias: bool) -> NodeCost:
    """The Linear as it runs in bfloat16: x, W and y each moved once."""
    return NodeCost(2 * m * k * n, 2 * (m * k + k * n + m * n) + (2 * n if bias else 0))


def time_of(costs: list[NodeCost], target: Target, dtype: str) -> float:
    return sum(op_time(c, target, dtype) for c in costs)
