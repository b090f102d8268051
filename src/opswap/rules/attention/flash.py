"""attention.flash: `scaled_dot_product_attention` (F.scaled_dot_product_attention
after an FX capture, aten.scaled_dot_product_attention after torch.export) -> opswap's
Triton FlashAttention, `opswap::flash_attention`, where the measured crossover table says
it beats SDPA's own backends on the target.

What it takes: 4-D q, k, v in fp16 or bf16, head dim 64 or 128, no dropout, causal or a
boolean / additive attn_mask broadcast to [B, H, S_q, S_k], grouped-query k, v (with
enable_gqa) or as many kv heads as q heads, any scale. Everything else is refused with
the reason. Exact: the same softmax(q kᵀ · scale + mask) v, in fp32 tiles, rounded once.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from opswap.cost import node_cost
from opswap.graph.ops import arg, copy_meta, raw_name
from opswap.graph.shapes import info
from opswap.kernels import crossover
from opswap.rules import _triton
from opswap.rules._cost import op_time
from opswap.rules._edits import erase
from opswap.rules._triton import CPU_REASON
from opswap.rules.base import Estimate, Found, Refused
from opswap.rules.registry import register
from opswap.targets.base import Target

#: the head dims the kernel is tuned and measured for (it runs 16-256; the rule takes these)
HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16)


def _sdpa_args(node: fx.Node) -> dict:
    return {
        "q": arg(node, 0, "query"),
        "k": arg(node, 1, "key"),
        "v": arg(node, 2, "value"),
        "mask": arg(node, 3, "attn_mask"),
        "dropout": arg(node, 4, "dropout_p", 0.0),
        "causal": arg(node, 5, "is_causal", False),
        "scale": arg(node, 6, "scale"),
        "gqa": node.kwargs.get("enable_gqa", node.args[7] if len(node.args) > 7 else False),
    }


def _refusal(a: dict, node: fx.Node) -> str | None:
    """Why the kernel cannot take this call, in a user's words, or None."""
    infos = {n: info(a[n]) if isinstance(a[n], fx.Node) else None for n in ("q", "k", "v")}
    if any(i is None for i in infos.values()):
        return f"the shapes of {node.name}'s q, k and v are unknown"
    qi, ki, vi = infos["q"], infos["k"], infos["v"]
    assert qi is not None and ki is not None and vi is not None
    if not (len(qi.shape) == len(ki.shape) == len(vi.shape) == 4):
        return f"{node.name} is not on [B, H, S, D] tensors; the kernel takes 4-D q, k and v"
    d = qi.shape[-1]
    if not isinstance(d, int) or d not in HEAD_DIMS or ki.shape[-1] != d or vi.shape[-1] != d:
        return f"head dim {d} in {node.name}: the kernel is built and tuned for {HEAD_DIMS}"
    if qi.dtype not in DTYPES or not (qi.dtype == ki.dtype == vi.dtype):
        dt = str(qi.dtype).removeprefix("torch.")
        return (
            f"{node.name} is {dt} attention; the kernel pays on fp16 / bf16 tensor cores, so "
            "SDPA keeps it"
        )
    if not isinstance(a["dropout"], (int, float)) or a["dropout"] != 0:
        return f"{node.name} has dropout p={a['dropout']}; the kernel has no dropout (eval: p=0)"
    if not isinstance(a["causal"], bool) or not (
        a["scale"] is None or isinstance(a["scale"], (int, float))
    ):
        return f"{node.name}'s is_causal or scale is not a constant"
    hq, hk = qi.shape[1], ki.shape[1]
    if hq != hk and not (a["gqa"] and isinstance(hq, int) and isinstance(hk, int) and hq % hk == 0):
        return f"{node.name} has {hq} query heads and {hk} kv heads without enable_gqa"
    if qi.shape[0] != ki.shape[0] or ki.shape[:3] != vi.shape[:3]:
        return f"{node.name}'s q, k and v disagree on batch, or k and v on heads or length"
    m = a["mask"]
    if m is not None:
        mi = info(m) if isinstance(m, fx.Node) else None
        if mi is None:
            return f"{node.name}'s attn_mask is not a tensor of known shape"
        if not (mi.dtype == torch.bool or mi.dtype.is_floating_point) or len(mi.shape) > 4:
            return f"{node.name}'s attn_mask is {mi.dtype} of rank {len(mi.shape)}"
    return None


def _shape(found: Found) -> tuple[str, int]:
    qi, ki = info(found["q"]), info(found["k"])
    assert qi is not None and ki is not None
    sq, sk = (s if isinstance(s, int) else 4096 for s in (qi.shape[2], ki.shape[2]))
    return crossover.attention_shape(sq, sk, int(qi.shape[-1]), found["causal"]), sk


@register
class FlashTriton(_triton.TritonRule):
    """SDPA as opswap's own FlashAttention (Triton, forward and backward). Exact: the
    same function, with fp32 scores and softmax statistics, the probabilities rounded to
    the input dtype for the second matmul as SDPA's flash backend does. Picked on a CUDA
    target only where the crossover table has measured it faster than SDPA's fastest
    backend at that head dim and length."""

    name = "attention.flash"
    family = "attention"
    chapter = 8
    after = ("fusion.*", "attention.sdpa")
    relieves = ("compute:attention", "memory:attention")
    anchors = ("attention",)
    description = (
        "scaled_dot_product_attention (fp16/bf16, head dim 64 or 128, causal or a padding / "
        "additive mask, GQA, no dropout) -> opswap::flash_attention, our Triton "
        "FlashAttention forward and backward, where measured faster than SDPA (CUDA)."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        name = raw_name(node)
        if name.startswith("_scaled_dot_product"):
            return Refused(
                f"{node.name} is aten.{name}, an SDPA backend chosen at capture; the rule "
                "takes scaled_dot_product_attention (capture without decompositions)"
            )
        if name != "scaled_dot_product_attention":
            return None
        a = _sdpa_args(node)
        why = _refusal(a, node)
        if why is not None:
            return Refused(why)
        qi = info(a["q"])
        assert qi is not None
        scale = float(a["scale"]) if a["scale"] is not None else 1.0 / math.sqrt(qi.shape[-1])
        what = "causal" if a["causal"] else "masked" if a["mask"] is not None else "full"
        return Found(
            [node],
            f"{what} attention {node.name} ({list(qi.shape)}, "
            f"{str(qi.dtype).removeprefix('torch.')}) -> opswap::flash_attention",
            dict(a, scale=scale, node=node),
            record=dict(head_dim=int(qi.shape[-1]), causal=a["causal"], mask=what == "masked"),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        node = found["node"]
        g = gm.graph
        with g.inserting_before(node):
            new = g.call_function(
                torch.ops.opswap.flash_attention.default,
                (found["q"], found["k"], found["v"], found["causal"], found["scale"], None,
                 found["mask"]),
            )  # fmt: skip
            out = g.call_function(operator.getitem, (new, 0))
        copy_meta(out, node)
        node.replace_all_uses_with(out)
        erase(gm, [node])

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        if getattr(target, "kind", "cpu") != "cuda":
            overhead = target.op_overhead(True) if hasattr(target, "op_overhead") else 0.0
            return Estimate(0.0, 0.0, -max(overhead, 1e-9), CPU_REASON)
        qi = info(found["q"])
        assert qi is not None
        dev = crossover.device_class(target)
        shape, _ = _shape(found)
        entry = crossover.lookup("flash_attention", dev, qi.dtype, 0, 0, "forward", shape=shape)
        if entry is None:
            return Estimate(
                0.0,
                0.0,
                -1e-9,
                f"no measured crossover for flash_attention at {shape} on {dev} (none yet): "
                "SDPA's backends are kept until the kernel is measured faster",
            )
        t = op_time(node_cost(found["node"]), target, qi.dtype)
        speed = entry.speedup_vs_eager or 1.0
        note = f"measured at {speed}x SDPA's best backend at {shape} on {dev} ({entry.source})"
        if not entry.beats_eager:
            return Estimate(0.0, 0.0, -max(t * (1 / speed - 1), 1e-9), note)
        return Estimate(0.0, 0.0, max(t * (1 - 1 / speed), 1e-9), note)
