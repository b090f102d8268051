"""The lm_head and its cross-entropy, found in a graph of model + loss, made one call of
opswap.train.losses.linear_cross_entropy (opswap::linear_cross_entropy): the logits are
never written. Only `prepare` makes this rewrite: it needs the loss inside the graph,
which an inference capture never has.

What it takes: `Linear(h) -> [view / reshape / flatten / contiguous]* -> cross_entropy`
with the logits read by nothing else, the cross-entropy's input [N, V] (the head's
rows, flattened) and no class weights.
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import fx, nn

from opswap.graph.shapes import info
from opswap.train.losses import linear_cross_entropy

_RESHAPES = {"view", "reshape", "flatten", "contiguous"}
_aten = torch.ops.aten
#: the same reshapes in an exported (ATen) graph
_ATEN_RESHAPES = {
    _aten.view.default,
    _aten.reshape.default,
    _aten._unsafe_view.default,
    _aten.flatten.using_ints,
    _aten.contiguous.default,
}
_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}  # aten's enum
_CE_SIGNATURE = inspect.signature(F.cross_entropy)


@dataclass
class Fused:
    replaced: list[str] = field(default_factory=list)
    left: list[tuple[str, str]] = field(default_factory=list)  # (where, why)


def _is_ce(node: fx.Node, gm: fx.GraphModule) -> bool:
    if node.op == "call_function":
        return node.target in (F.cross_entropy, _aten.cross_entropy_loss.default)
    if node.op == "call_module":
        return isinstance(gm.get_submodule(str(node.target)), nn.CrossEntropyLoss)
    return False


def _ce_settings(node: fx.Node, gm: fx.GraphModule) -> tuple[Any, Any, dict[str, Any]]:
    """(input, target, settings) of a cross-entropy node."""
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        assert isinstance(mod, nn.CrossEntropyLoss)
        args = list(node.args) + [
            node.kwargs.get(k) for k in ("input", "target") if k in node.kwargs
        ]
        return (
            args[0],
            args[1],
            dict(
                weight=mod.weight,
                ignore_index=mod.ignore_index,
                reduction=mod.reduction,
                label_smoothing=mod.label_smoothing,
            ),
        )
    if node.target is _aten.cross_entropy_loss.default:
        names = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
        given = dict(zip(names, node.args, strict=False)) | dict(node.kwargs)
        return (
            given.get("input", given.get("self")),
            given["target"],
            dict(
                weight=given.get("weight"),
                ignore_index=given.get("ignore_index", -100),
                reduction=_REDUCTIONS.get(int(cast(Any, given.get("reduction", 1))), "?"),
                label_smoothing=given.get("label_smoothing", 0.0),
            ),
        )
    bound = _CE_SIGNATURE.bind(*node.args, **node.kwargs)
    bound.apply_defaults()
    a = bound.arguments
    settings = {k: a[k] for k in ("weight", "ignore_index", "reduction", "label_smoothing")}
    if a["size_average"] is not None or a["reduce"] is not None:
        settings["weight"] = "legacy size_average/reduce"
    return a["input"], a["target"], settings


def _shape_read(node: fx.Node) -> bool:
    """`x.shape`, `x.size()`, `x.size(d)` or `x.dim()`: reads of the logits that a
    rewrite can answer without them."""
    if node.op == "call_function" and node.target is getattr:
        return len(node.args) > 1 and node.args[1] == "shape"
    return node.op == "call_method" and node.target in ("size", "dim")


def logits_size(hidden: torch.Tensor, weight: torch.Tensor, *dim: int) -> Any:
    """What `(hidden @ weight.T).size(*dim)` would be, without the product."""
    full = torch.Size([*hidden.shape[:-1], weight.shape[0]])
    return full[dim[0]] if dim else full


def logits_dim(hidden: torch.Tensor) -> int:
    return hidden.dim()


def _answer_shape_reads(gm: fx.GraphModule, linear: fx.Node, hidden: Any, weight: Any) -> None:
    for user in [u for u in linear.users if _shape_read(u)]:
        with gm.graph.inserting_before(user):
            if user.op == "call_method" and user.target == "dim":
                new = gm.graph.call_function(logits_dim, (hidden,))
            else:
                dims = tuple(user.args[1:]) if user.op == "call_method" else ()
                new = gm.graph.call_function(logits_size, (hidden, weight, *dims))
        user.replace_all_uses_with(new)
        gm.graph.erase_node(user)


def _drop_unread_sizes(gm: fx.GraphModule) -> None:
    """The size reads and their indexing that only the removed reshapes read."""
    pure = (logits_size, logits_dim, operator.getitem)
    for node in reversed(list(gm.graph.nodes)):
        if node.op == "call_function" and node.target in pure and not node.users:
            gm.graph.erase_node(node)


def _head(node: fx.Node, gm: fx.GraphModule) -> tuple[fx.Node, list[fx.Node]] | None:
    """(the Linear node, the reshapes after it) the CE's input comes from, or None."""
    chain: list[fx.Node] = []
    cur = node
    while cur.op in ("call_method", "call_function") and (
        (cur.op == "call_method" and cur.target in _RESHAPES)
        or (cur.op == "call_function" and getattr(cur.target, "__name__", "") in _RESHAPES)
        or cur.target in _ATEN_RESHAPES
    ):
        chain.append(cur)
        prev = cur.args[0]
        if not isinstance(prev, fx.Node):
            return None
        cur = prev
    if cur.op == "call_module" and isinstance(gm.get_submodule(str(cur.target)), nn.Linear):
        return cur, chain
    if cur.op == "call_function" and cur.target in (F.linear, _aten.linear.default):
        return cur, chain
    return None


def fuse_loss_head(gm: fx.GraphModule) -> Fused:
    """Rewrite every lm_head + cross-entropy of `gm` in place (its graph is prepare's
    private capture); what was fused and what nearly was, with why."""
    out = Fused()
    for node in list(gm.graph.nodes):
        if not _is_ce(node, gm):
            continue
        logits, target, settings = _ce_settings(node, gm)
        if not isinstance(logits, fx.Node) or not isinstance(target, fx.Node):
            continue
        found = _head(logits, gm)
        if found is None:
            continue
        linear, chain = found
        why = _refusal(linear, chain, logits, settings)
        if why:
            out.left.append((node.name, why))
            continue
        with gm.graph.inserting_before(linear):  # before every reader of the logits
            if linear.op == "call_module":
                path = str(linear.target)
                mod = gm.get_submodule(path)
                hidden = linear.args[0] if linear.args else linear.kwargs["input"]
                weight: Any = gm.graph.get_attr(f"{path}.weight")
                bias: Any = gm.graph.get_attr(f"{path}.bias") if mod.bias is not None else None
            else:  # F.linear(input, weight, bias=None) or aten.linear(self, weight, bias?)
                args = dict(zip(("input", "weight", "bias"), linear.args, strict=False))
                args |= {("input" if k == "self" else k): v for k, v in linear.kwargs.items()}
                hidden, weight, bias = args["input"], args["weight"], args.get("bias")
        _answer_shape_reads(gm, linear, hidden, weight)
        with gm.graph.inserting_before(node):
            rows = gm.graph.call_method("flatten", (hidden, 0, -2))
            loss = gm.graph.call_function(
                linear_cross_entropy,
                (rows, weight, target, bias),
                dict(
                    ignore_index=int(settings["ignore_index"]),
                    label_smoothing=float(settings["label_smoothing"]),
                    reduction=str(settings["reduction"]),
                ),
            )
        loss.meta = dict(node.meta)
        node.replace_all_uses_with(loss)
        for dead in [node, *chain, linear]:
            gm.graph.erase_node(dead)
        out.replaced.append(
            f"{linear.name} -> {node.name}: the Linear head and its cross-entropy in one "
            "opswap::linear_cross_entropy, the logits never written"
        )
    if out.replaced:
        _drop_unread_sizes(gm)
        gm.graph.lint()
        gm.recompile()
    return out


def _refusal(
    linear: fx.Node, chain: list[fx.Node], logits: fx.Node, settings: dict[str, Any]
) -> str | None:
    for n in [linear, *chain]:
        readers = [u for u in n.users if not (n is linear and _shape_read(u))]
        if len(readers) != 1:  # the next reshape, or the loss
            names = ", ".join(u.name for u in readers)
            return f"{n.name} (the logits) is also read elsewhere: {names}"
    if settings["weight"] is not None:
        return "the cross-entropy has class weights, which the fused loss does not take"
    if settings["reduction"] not in ("mean", "sum", "none"):
        return f"reduction {settings['reduction']!r} is not one the fused loss takes"
    shape = info(logits)
    head = info(linear)
    if shape is None or head is None:
        return "the logits' shapes are unknown"
    if len(shape.shape) != 2 or shape.shape[-1] != head.shape[-1]:
        return (
            f"the cross-entropy's input is {list(shape.shape)}, not the head's rows "
            f"flattened to [N, {head.shape[-1]}]"
        )
    return None
