"""precision.autocast: the whole graph under torch.autocast(bfloat16), the outputs cast back
to their dtype, as one site; torch.export keeps the region in model.pt2."""

from __future__ import annotations

import torch
import torch.fx as fx

from opswap.cost import NodeCost, node_cost
from opswap.graph.ops import op_kind
from opswap.graph.shapes import info
from opswap.rules._cost import op_time
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.precision._half import ANCHORS, native
from opswap.rules.registry import register
from opswap.targets.base import Target

_ENTER = torch.amp.autocast_mode._enter_autocast
_EXIT = torch.amp.autocast_mode._exit_autocast


def _device_type(gm: fx.GraphModule) -> str:
    for t in (*gm.parameters(), *gm.buffers()):
        return t.device.type
    return "cpu"


def _low_precision_already(gm: fx.GraphModule) -> str | None:
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (_ENTER, _EXIT):
            return "the graph already runs under autocast"
    for name, mod in gm.named_modules():
        kind = type(mod).__name__
        if kind.startswith(("Half", "Int8", "Int4", "FP8", "Fp8")) or "WeightOnly" in kind:
            return (
                f"{name} ({kind}) already runs in low precision from another rule; autocast "
                "is the alternative to those, not an addition"
            )
    return None


@register
class Autocast(Rule):
    """The autocast-based mode of half precision: the graph body runs inside
    `torch.autocast(device, torch.bfloat16)`, whose op lists decide what runs in bfloat16
    (matmuls, convolutions, Linear) and what stays float32 (softmax, norms, reductions,
    exp, log, the losses), and every floating output is cast back to the dtype it had.

    Against `precision.bf16` (per op, weights held in bfloat16): autocast converts the
    weights on every call (its cast cache lasts one region, one forward), so it moves more
    bytes, but it needs no change to the model's ops and follows PyTorch's own lists. The
    region is two nodes of the graph (`_enter_autocast`, `_exit_autocast`), which
    torch.export writes into model.pt2 as a `wrap_with_autocast` call (checked: a saved
    and reloaded file gives the eager result bit for bit), so the race times and saves it
    like any rule. Predicted from the target's bfloat16 rate against float32 over the
    graph's compute ops, less the casts; a CPU without native bfloat16 is predicted slower.
    """

    name = "precision.autocast"
    family = "precision"
    chapter = 6
    exactness = "approx"
    after = ("fusion.*", "precision.bf16", "precision.fp16", "precision.int8_*")
    relieves = ("compute:matmul", "compute:conv")
    description = (
        "the whole graph under torch.autocast(bfloat16) (PyTorch's op lists decide what runs "
        "in half), outputs cast back to their dtype; kept in model.pt2 by torch.export."
    )
    # one site per graph, anchored on its first compute op (the region is the whole body)
    anchors = ANCHORS

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        compute = [n for n in gm.graph.nodes if op_kind(n) in ANCHORS]
        if not compute or node is not compute[0]:
            return None
        why = _low_precision_already(gm)
        if why:
            return Refused(why)
        infos = [info(n) for n in compute]
        if any(i is not None and i.dtype != torch.float32 for i in infos):
            return Refused("the graph's compute ops are not all float32")
        return Found(
            (node,),
            f"the graph under torch.autocast({_device_type(gm)!r}, bfloat16): "
            f"{len(compute)} compute op(s) in bfloat16",
            dict(compute=compute, device=_device_type(gm)),
            kept=(node,),
            record=dict(compute_ops=len(compute)),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        g = gm.graph
        out = next(n for n in g.nodes if n.op == "output")
        placeholders = [n for n in g.nodes if n.op == "placeholder"]
        where = placeholders[-1] if placeholders else next(iter(g.nodes))
        with g.inserting_after(where):
            enter = g.call_function(_ENTER, (found["device"], torch.bfloat16, True, None))
        values = torch.utils._pytree.tree_leaves(out.args[0])
        with g.inserting_before(out):
            casts = {}
            for v in values:
                vi = info(v) if isinstance(v, fx.Node) else None
                if vi is not None and vi.dtype.is_floating_point and v not in casts:
                    # _to_copy, not .to: torch.export puts a dtype assertion before a .to,
                    # with the dtype traced outside autocast (float32 for a matmul that
                    # gives bfloat16 in the region), and the reloaded file then fails it
                    casts[v] = g.call_function(
                        torch.ops.aten._to_copy.default, (v,), {"dtype": vi.dtype}
                    )
            g.call_function(_EXIT, (enter,))
        out.args = (
            torch.utils._pytree.tree_map(
                lambda v: casts.get(v, v) if isinstance(v, fx.Node) else v, out.args[0]
            ),
        )

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        is_native, why = native(target, torch.bfloat16)
        t_before = t_after = 0.0
        cast_bytes = 0
        for n in found["compute"]:
            c = node_cost(n)
            t_before += op_time(c, target, "float32")
            if is_native:
                t_after += op_time(NodeCost(c.flops, c.bytes // 2), target, "bfloat16")
                cast_bytes += c.bytes * 6 // 4  # each float32 operand read and written as bf16
            else:
                t_after += op_time(c, target, "float32")
                cast_bytes += c.bytes * 6 // 4
        t_casts = op_time(NodeCost(0, cast_bytes), target, "float32")
        return Estimate(
            0.0,
            float(-cast_bytes),
            t_before - t_after - t_casts,
            f"{len(found['compute'])} compute op(s) at {why}, plus their casts (autocast "
            "converts operands, weights included, on every call)",
        )
