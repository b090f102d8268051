"""attention.flash_triton: `aten.scaled_dot_product_attention` -> `opswap::flash_attention`,
opswap's Triton FlashAttention forward, where the crossover table measured it faster than
the best of SDPA's backends for the site's head dim, length and causality."""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from opswap.cost import NodeCost, node_cost
from opswap.graph.ops import arg, copy_meta, raw_name
from opswap.graph.shapes import info
from opswap.kernels.flash_attention import HEAD_DIMS
from opswap.rules import _triton
from opswap.rules._edits import erase
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.registry import register


@register
class FlashTriton(Rule):
    """SDPA without a mask (or causal) and without dropout, in fp16 or bf16, as opswap's
    FlashAttention kernel: exact up to rounding (the softmax's sums run in tiles). The
    planner takes it only where the measured table says it beats SDPA's own backends
    (cuDNN, flash, efficient) on the target; elsewhere it is refused with the figure."""

    name = "attention.flash_triton"
    family = "attention"
    chapter = 8
    exactness = "exact"
    targets = ("cuda", "cpu")
    after = ("fusion.*", "layout.drop_*")
    relieves = ("compute:attention",)
    anchors = ("attention",)
    description = (
        "scaled_dot_product_attention (no mask or causal, no dropout, fp16/bf16) -> "
        "opswap::flash_attention, a Triton FlashAttention forward (CUDA), where measured faster."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        if raw_name(node) != "scaled_dot_product_attention":
            return None
        q, k, v = (arg(node, i, n) for i, n in enumerate(("query", "key", "value")))
        if not all(isinstance(t, fx.Node) for t in (q, k, v)):
            return None
        if arg(node, 3, "attn_mask") is not None:
            return Refused("it has an explicit attn_mask; the kernel takes causal or key lengths")
        if float(arg(node, 4, "dropout_p", 0.0) or 0.0) != 0.0:
            return Refused("dropout_p is not 0; the kernel has no dropout")
        causal = arg(node, 5, "is_causal", False)
        scale = arg(node, 6, "scale", None)
        if isinstance(causal, fx.Node) or isinstance(scale, fx.Node):
            return Refused("is_causal or scale is computed in the graph, not a constant")
        qi, ki, vi = info(q), info(k), info(v)
        if qi is None or ki is None or vi is None or len(qi.shape) != 4 or len(ki.shape) != 4:
            return Refused("q, k and v are not known 4-D tensors [batch, heads, seq, head_dim]")
        d = int(qi.shape[-1])
        if d not in HEAD_DIMS or int(ki.shape[-1]) != d or int(vi.shape[-1]) != d:
            return Refused(f"head dim {d}: the kernel takes {', '.join(map(str, HEAD_DIMS))}")
        if qi.dtype not in (torch.float16, torch.bfloat16):
            return Refused(
                f"{q.name} is {qi.dtype}; the kernel runs fp16 or bf16 (fp32 would go through "
                "TF32 tensor cores, which SDPA's fp32 does not)"
            )
        hq, hk = int(qi.shape[1]), int(ki.shape[1])
        if hk != hq and (not arg(node, 7, "enable_gqa", False) or hq % hk):
            return Refused(f"{hq} query heads against {hk} key heads without enable_gqa")
        sq, sk = int(qi.shape[2]), int(ki.shape[2])
        s = 1.0 / math.sqrt(d) if scale is None else float(scale)
        return Found(
            (node,),
            f"{node.name}: attention over {sk} keys, head dim {d}"
            f"{', causal' if causal else ''} -> opswap::flash_attention",
            dict(q=q, k=k, v=v, causal=bool(causal), scale=s, d=d, sq=sq, sk=sk, dtype=qi.dtype),
            record=dict(causal=bool(causal), scale=s),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        node = found.nodes[0]
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(
                torch.ops.opswap.flash_attention.default,
                (found["q"], found["k"], found["v"], found["causal"], found["scale"], None),
            )
        copy_meta(new, node)
        node.replace_all_uses_with(new)
        erase(gm, [node])

    def predict(self, gm: fx.GraphModule, found: Found, target) -> Estimate:
        own = node_cost(found.nodes[0])
        return _triton.predict(
            target,
            "flash_attention",
            found.nodes,
            NodeCost(own.flops, own.bytes),
            found["dtype"],
            found["d"],
            found["sk"],
            f"attention over {found['sk']} keys at head dim {found['d']}, one kernel for "
            "SDPA's one (roofline parity)",
            pass_="forward,causal" if found["causal"] else "forward",
        )
