"""Chapter 14: reshape and transpose. Rules that remove data movement a model does not need.

Most layout ops are free views (transpose, permute, view): removing one saves an op
dispatch, not memory traffic. Traffic is paid where a view meets an op that needs
contiguous memory (a `.contiguous()`, a reshape that cannot view, a matmul that must
fold batch dims) or where a kernel converts layouts internally (NCHW convolutions on
an NHWC backend). Each rule's `predict` says which of the two it saves, from the cost
model: a removed copy saves reading and writing its tensor (2x its bytes).

All rules here are exact: the rewritten graph computes the same values, up to the
rounding of a kernel that reads the same numbers in another order.
"""

from __future__ import annotations

import torch.fx as fx
from torch import nn
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from opswap.graph.ops import attr_tensor, copy_meta, fresh_attr_name, raw_name, set_attr_tensor
from opswap.graph.shapes import info, same_everywhere
from opswap.rules import _layout_nhwc as nhwc
from opswap.rules._layout_checks import (
    Check,
    constant_transpose_check,
    drop_attr_if_unused,
    dropout_check,
    identity_check,
    strided_operand_check,
)
from opswap.rules._layout_graph import (
    by_name,
    call,
    compose,
    erase_unused,
    matmul_reads_in_place,
    perm_of,
    shape_args,
    strides,
)
from opswap.rules._layout_shapes import chain_from, collapsed_shape, is_shape_op
from opswap.rules.base import Estimate, Miss, Rule, Site
from opswap.rules.registry import register


def _moved_bytes(nodes) -> int:
    """Bytes the cost model says these nodes move per call (0 for views and no-ops)."""
    from opswap.cost import node_cost

    total = 0
    for n in nodes:
        try:
            total += node_cost(n).bytes
        except Exception:  # a node created earlier in this pass has no shapes yet
            i = info(n)
            total += 2 * i.nbytes if i is not None else 0
    return total


def _estimate(bytes_saved: int, target, note: str) -> Estimate:
    bw = getattr(target, "mem_bandwidth", None)
    return Estimate(bytes_saved=float(bytes_saved),
                    time_saved_s=bytes_saved / bw if bw else None, note=note)


def _fewer(n: int) -> str:
    return f"{n} op dispatch{'es' if n != 1 else ''} fewer"


def _is_perm(node: fx.Node) -> bool:
    return perm_of(node) is not None


class _LayoutRule(Rule):
    family = "layout"
    chapter = 14
    exactness = "exact"

    def _nodes(self, gm: fx.GraphModule, site: Site) -> list[fx.Node]:
        names = by_name(gm)
        missing = [n for n in site.nodes if n not in names]
        if missing:
            raise KeyError(f"{', '.join(missing)} no longer in the graph")
        return [names[n] for n in site.nodes]

    def predict(self, gm: fx.GraphModule, site: Site, target) -> Estimate:
        try:
            return self._predict(gm, site, target)
        except KeyError as e:  # an earlier rewrite of this pass removed the site's nodes
            return Estimate(note=f"not predicted: {e.args[0] if e.args else e}")

    def _predict(self, gm: fx.GraphModule, site: Site, target) -> Estimate:
        raise NotImplementedError

    def _verdicts(self, checks) -> list[Site | Miss]:
        """Sites and misses from (node, Check) pairs. A site covers the node and the node
        names in data["also"], keyed by data["key"] (default: the node's name)."""
        found: list[Site | Miss] = []
        for node, check in checks:
            if check is None:
                continue
            if check.ok:
                nodes = [node, *check.data.pop("also", [])]
                key = check.data.pop("key", node.name)
                found.append(self.site(key, nodes, check.ok, **check.data))
            else:
                found.append(self.miss(node, check.why))
        return found


def _chain_sites(rule: _LayoutRule, gm: fx.GraphModule, is_link, describe) -> list[Site | Miss]:
    """Sites for maximal single-reader chains of `is_link` nodes; `describe(chain)` returns
    a Check whose data says what the chain becomes."""
    found: list[Site | Miss] = []
    for node in gm.graph.nodes:
        chain, stop = chain_from(node, is_link)
        if chain is None:
            continue
        if stop:
            found.append(rule.miss(*stop))
        if not chain[-1].users:
            continue  # dead code: removed by the next clean-up anyway
        check = describe(chain)
        if check is None:
            continue
        if check.why:
            found.append(rule.miss(chain[-1], check.why))
        else:
            found.append(rule.site("+".join(n.name for n in chain), chain,
                                   f"{' -> '.join(n.name for n in chain)} {check.ok}",
                                   **check.data))
    return found


def _replace_chain(gm: fx.GraphModule, chain: list[fx.Node], op: str | None, arg) -> None:
    """Make the chain's readers read `op(chain input, arg)`, or the input itself (op None)."""
    src, last = chain[0].args[0], chain[-1]
    if op is None:
        last.replace_all_uses_with(src)
    else:
        with gm.graph.inserting_after(last):
            new = call(gm.graph, last, op, (src, arg))
        copy_meta(new, last)
        last.replace_all_uses_with(new)
    erase_unused(gm.graph, chain)


# --------------------------------------------------------------------------- cancel_transpose


def _composed(chain: list[fx.Node]) -> Check | None:
    total = perm_of(chain[0])
    for n in chain[1:]:
        total = compose(total, perm_of(n))
    identity = total == sorted(total)
    if len(chain) == 1 and not identity:
        return None
    what = "cancel out" if identity else f"compose to permute{tuple(total)}"
    return Check(what, data={"perm": total, "identity": identity})


@register
class CancelTranspose(_LayoutRule):
    name = "layout.cancel_transpose"
    description = (
        "Transpose/permute chains: one that composes to the identity is removed, any other "
        "becomes a single permute. Transposes are views, so this saves op dispatches, and a "
        "later copy no longer gathers a tensor that was only turned back."
    )

    def match(self, gm: fx.GraphModule) -> list[Site | Miss]:
        return _chain_sites(self, gm, _is_perm, _composed)

    def rewrite(self, gm: fx.GraphModule, site: Site) -> None:
        identity = site.data["identity"]
        _replace_chain(gm, self._nodes(gm, site), None if identity else "permute",
                       list(site.data["perm"]))

    def _predict(self, gm, site, target) -> Estimate:
        fewer = len(site.nodes) - (0 if site.data["identity"] else 1)
        return _estimate(0, target, f"transposes are views: no data moves; {_fewer(fewer)}")


# --------------------------------------------------------------------------- collapse_view


def _collapsed(chain: list[fx.Node]) -> Check | None:
    if same_everywhere(chain[0].args[0], chain[-1]):  # at the example and every probe
        return Check("leave the shape unchanged", data={"identity": True})
    if len(chain) == 1:
        return None
    shape, reason = collapsed_shape(chain)
    if reason:
        return Check(why=reason)
    src = chain[0].args[0].name
    shown = [a.name if isinstance(a, fx.Node) else
             "*".join(f"{src}.size({d})" for d in a) if isinstance(a, tuple) else a
             for a in shape]
    return Check(f"as one reshape to {shown}", data={"identity": False})


@register
class CollapseView(_LayoutRule):
    name = "layout.collapse_view"
    description = (
        "Chains of view/reshape/flatten/(un)squeeze become one reshape to the final shape, "
        "and a view to the shape a tensor already has is removed. All of them keep elements "
        "in row-major order, so one reshape of the chain's input gives the same tensor. "
        "They are views: this saves op dispatches, not memory traffic."
    )

    def match(self, gm: fx.GraphModule) -> list[Site | Miss]:
        return _chain_sites(self, gm, is_shape_op, _collapsed)

    def rewrite(self, gm: fx.GraphModule, site: Site) -> None:
        chain = self._nodes(gm, site)
        if site.data["identity"]:
            _replace_chain(gm, chain, None, None)
            return
        shape, reason = collapsed_shape(chain)
        if reason:
            raise ValueError(reason)
        with gm.graph.inserting_before(chain[-1]):
            shape = shape_args(gm.graph, chain[-1], chain[0].args[0], shape)
        _replace_chain(gm, chain, "reshape", shape)

    def _predict(self, gm, site, target) -> Estimate:
        fewer = len(site.nodes) - (0 if site.data["identity"] else 1)
        return _estimate(0, target, f"views move no data; {_fewer(fewer)}")


# --------------------------------------------------------------------------- permute_matmul


@register
class PermuteMatmul(_LayoutRule):
    name = "layout.permute_matmul"
    description = (
        "A transposed constant feeding a matmul (x @ W.t()) becomes linear(x, W), or the "
        "constant is stored pre-transposed, so no transpose runs per call and a batched "
        "matmul no longer copies a strided weight. A .contiguous() between a transpose and "
        "a matmul that can read the strided operand directly is dropped: BLAS reads a "
        "column-major matrix through its transpose flag, so the operand's copy no longer "
        "goes through memory (2x its bytes saved per call)."
    )

    def match(self, gm: fx.GraphModule) -> list[Site | Miss]:
        checks = []
        for node in gm.graph.nodes:
            perm = perm_of(node)
            if perm is not None and node.args[0].op == "get_attr":
                checks.append((node, constant_transpose_check(gm, node, perm)))
            elif (raw_name(node) == "contiguous" and node.op != "call_module" and node.args
                  and isinstance(node.args[0], fx.Node) and _is_perm(node.args[0])):
                checks.append((node, strided_operand_check(node, node.args[0])))
        return self._verdicts(checks)

    def rewrite(self, gm: fx.GraphModule, site: Site) -> None:
        nodes = self._nodes(gm, site)
        mode = site.data["mode"]
        if mode == "contiguous":
            nodes[0].replace_all_uses_with(nodes[0].args[0])
            erase_unused(gm.graph, nodes)
            return
        tr = nodes[0]
        w_node = tr.args[0]
        if mode == "linear":
            mm = nodes[1]
            with gm.graph.inserting_after(mm):
                new = call(gm.graph, mm, "linear", (mm.args[0], w_node))
            copy_meta(new, mm)
            mm.replace_all_uses_with(new)
            erase_unused(gm.graph, nodes)
            return
        w = attr_tensor(gm, w_node)
        stored = w.detach().permute(site.data["perm"]).contiguous()
        attr = fresh_attr_name(gm, f"{w_node.target}_permuted")
        set_attr_tensor(gm, attr, stored, as_param=isinstance(w, nn.Parameter))
        with gm.graph.inserting_before(tr):
            new = gm.graph.get_attr(attr)
        new.meta["tensor_meta"] = _extract_tensor_metadata(stored)
        tr.replace_all_uses_with(new)
        erase_unused(gm.graph, [tr])
        drop_attr_if_unused(gm, w_node)

    def _predict(self, gm, site, target) -> Estimate:
        nodes = self._nodes(gm, site)
        mode = site.data["mode"]
        if mode == "contiguous":
            return _estimate(_moved_bytes(nodes), target, "the operand's copy is no longer "
                             "written and read back; BLAS reads it through its transpose flag")
        if mode == "linear":
            return _estimate(0, target, "BLAS already read W^T in place, so no data moves; "
                             f"{_fewer(1)} (transpose and matmul become one linear)")
        tr = nodes[0]
        i, st = info(tr), strides(tr)
        copied = i is not None and st is not None and not matmul_reads_in_place(i.shape, st)
        note = ("matmul copied the strided constant every call" if copied
                else "no data moved per call before either")
        if len(tr.args[0].users) > 1:
            note += f"; {tr.args[0].name} is also read elsewhere, so both layouts are stored"
        return _estimate(2 * i.nbytes if copied else 0, target, f"{note}; {_fewer(1)}")


# --------------------------------------------------------------------------- drop_dropout


@register
class DropDropout(_LayoutRule):
    name = "layout.drop_dropout"
    description = (
        "Dropout in eval mode (nn.Dropout in eval, F.dropout(training=False), "
        "aten.dropout(x, p, False)) returns its input, so the op is removed. Nothing is "
        "copied either way: this saves a dispatch (and a module call) and lets the ops on "
        "either side fuse."
    )

    def match(self, gm: fx.GraphModule) -> list[Site | Miss]:
        return self._verdicts((n, dropout_check(n)) for n in gm.graph.nodes)

    def rewrite(self, gm: fx.GraphModule, site: Site) -> None:
        (node,) = self._nodes(gm, site)
        node.replace_all_uses_with(node.args[0] if node.args else node.kwargs["input"])
        erase_unused(gm.graph, [node])

    def _predict(self, gm, site, target) -> Estimate:
        return _estimate(0, target, f"eval-mode dropout returns its input: no data moves; "
                         f"{_fewer(1)}")


# --------------------------------------------------------------------------- drop_identity


@register
class DropIdentity(_LayoutRule):
    name = "layout.drop_identity"
    description = (
        "Ops that return their input (nn.Identity, aten.alias, .contiguous() of a contiguous "
        "tensor, .to() the dtype it has) and copies nobody needs (a clone with the same "
        "strides, in a graph that writes nothing in place) are removed. A removed clone "
        "saves writing and re-reading its tensor; the others save a dispatch."
    )

    def match(self, gm: fx.GraphModule) -> list[Site | Miss]:
        return self._verdicts((n, identity_check(gm, n)) for n in gm.graph.nodes)

    def rewrite(self, gm: fx.GraphModule, site: Site) -> None:
        (node,) = self._nodes(gm, site)
        node.replace_all_uses_with(node.args[0])
        erase_unused(gm.graph, [node])

    def _predict(self, gm, site, target) -> Estimate:
        (node,) = self._nodes(gm, site)
        if raw_name(node) in ("clone", "_to_copy"):
            return _estimate(_moved_bytes([node]), target,
                             f"a copy no longer written and read back; {_fewer(1)}")
        return _estimate(0, target, f"it returned its input: no data moves; {_fewer(1)}")


# --------------------------------------------------------------------------- channels_last


def _nhwc_plan(site: Site) -> nhwc.NhwcPlan:
    d = site.data
    return nhwc.NhwcPlan(d["convs"], d["entries"], d["outputs"], d["views"])


@register
class ChannelsLast(_LayoutRule):
    name = "layout.channels_last"
    targets = ("cpu", "cuda")
    late = True
    description = (
        "Runs a CNN in channels-last (NHWC) memory format: conv weights stored NHWC, the 4-D "
        "inputs of the first convs converted once, 4-D outputs converted back. On backends "
        "whose fast conv kernels are NHWC (oneDNN, cuDNN tensor cores) an NCHW conv "
        "reorders its input and output every call. Pays only on a target that prefers "
        "channels_last; elsewhere the conversions are pure cost and the planner skips it."
    )

    def match(self, gm: fx.GraphModule) -> list[Site | Miss]:
        plan = nhwc.plan_nhwc(gm)
        if not plan.convs:
            return [self.miss("model", "the model has no 2-D convolution on 4-D activations, "
                              "so channels_last has nothing to speed up")]
        if nhwc.already_nhwc(gm, plan):
            return [self.miss("model", "every convolution already runs channels_last")]
        desc = (f"{len(plan.convs)} conv(s) in NHWC; {', '.join(plan.entries)} converted in"
                + (f", {', '.join(plan.outputs)} back" if plan.outputs else ""))
        nodes = dict.fromkeys(plan.convs + plan.entries + plan.outputs + plan.views)
        return [self.site("model", list(nodes), desc, convs=plan.convs, entries=plan.entries,
                          outputs=plan.outputs, views=plan.views)]

    def rewrite(self, gm: fx.GraphModule, site: Site) -> None:
        nhwc.rewrite_nhwc(gm, by_name(gm), _nhwc_plan(site))
        nhwc.check_runs(gm)

    def _predict(self, gm, site, target) -> Estimate:
        plan = _nhwc_plan(site)
        saved, paid = nhwc.traffic(plan, by_name(gm))
        layout = getattr(target, "layout", None) or getattr(target, "preferred_layout", None)
        if layout != "channels_last":
            bw = getattr(target, "mem_bandwidth", None)
            return Estimate(bytes_saved=-float(paid),
                            time_saved_s=-max(paid, 1) / bw if bw else -1e-9,
                            note=f"{getattr(target, 'name', target)} prefers {layout or 'NCHW'} "
                                 "layout: the conversions would be paid and nothing saved")
        n_conv = len(plan.entries + plan.outputs + plan.views)
        return _estimate(saved - paid, target, f"{len(plan.convs)} conv(s) stop reordering "
                         f"activations ({saved} B) for {n_conv} conversion(s) ({paid} B)")
