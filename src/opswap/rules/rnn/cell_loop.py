"""rnn.cell_loop: a Python loop over an LSTMCell / GRUCell / RNNCell, unrolled by the
capture, -> one nn.LSTM / nn.GRU / nn.RNN call over the whole sequence."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch import nn

from opswap.cost import NodeCost
from opswap.graph.ops import copy_meta, is_aten, module_of
from opswap.graph.shapes import info
from opswap.rules._cost import saving
from opswap.rules._edits import call, drop_dead_attrs, erase, fresh_path
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.registry import register
from opswap.rules.rnn import _chain
from opswap.targets.base import Target

_SEQ: dict[str, type[nn.LSTM] | type[nn.GRU] | type[nn.RNN]] = {
    "lstm": nn.LSTM,
    "gru": nn.GRU,
    "rnn": nn.RNN,
}


def sequence_module(chain: _chain.Chain) -> nn.RNNBase:
    """The one-layer nn.LSTM / nn.GRU / nn.RNN that computes the chain's cell over the
    whole sequence. The cell's tensors map one to one onto layer 0's (PyTorch keeps the
    gate order of the cell in the sequence module: i, f, g, o for LSTM; r, z, n for GRU,
    the n gate's hidden bias inside r * (...) in both)."""
    size = (chain.input_size, chain.hidden_size)
    first = chain.axis == 1
    mod: nn.RNNBase
    if chain.kind == "rnn":
        mod = nn.RNN(*size, 1, chain.nonlinearity, chain.bias, first)
    elif chain.kind == "gru":
        mod = nn.GRU(*size, num_layers=1, bias=chain.bias, batch_first=first)
    else:
        mod = nn.LSTM(*size, num_layers=1, bias=chain.bias, batch_first=first)
    w = chain.weights
    ref = w["weight_ih"]
    mod = mod.to(device=ref.device, dtype=ref.dtype)
    with torch.no_grad():
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            if name in w:
                grad = w[name].requires_grad
                setattr(mod, f"{name}_l0", nn.Parameter(w[name].clone(), requires_grad=grad))
    mod.flatten_parameters()
    return mod.eval()


def describe(chain: _chain.Chain) -> str:
    what = {"lstm": "LSTMCell", "gru": "GRUCell", "rnn": "RNNCell"}[chain.kind]
    layout = "batch-first" if chain.axis == 1 else "time-major"
    return (
        f"{chain.steps} steps of {what} {chain.cells[0].node.name} over {chain.source.name} "
        f"({layout}, hidden {chain.hidden_size})"
    )


def install(gm: fx.GraphModule, chain: _chain.Chain, mod: nn.Module, base: str) -> fx.Node:
    """Call `mod` on the chain's sequence and initial state in place of the loop; every
    step output read outside the loop, and the stack of h's, take their values from the
    call. Returns the call."""
    graph, first = gm.graph, chain.cells[0]
    like = first.node
    outside = list(_chain.outside_readers(chain))
    inside = set(chain.nodes())
    path = fresh_path(gm, base.replace(".", "_"))
    gm.add_submodule(path, mod)
    t_out = 1 if chain.axis == 1 else 0  # the time dim of the module's output
    with graph.inserting_before(first.node):
        seq: fx.Node = chain.source
        if chain.narrow:
            seq = call(graph, like, "narrow", (seq, chain.axis, chain.start, chain.steps))
        args: tuple = (seq,)
        if first.h_in is not None:
            h0 = call(graph, like, "unsqueeze", (first.h_in, 0))
            if chain.kind == "lstm":
                assert first.c_in is not None
                args = (seq, (h0, call(graph, like, "unsqueeze", (first.c_in, 0))))
            else:
                args = (seq, h0)
        new = graph.call_module(path, args)
        out = graph.call_function(operator.getitem, (new, 0))
        state = graph.call_function(operator.getitem, (new, 1))
        if chain.kind == "lstm":
            h_n = graph.call_function(operator.getitem, (state, 0))
            c_n = graph.call_function(operator.getitem, (state, 1))
        else:
            h_n, c_n = state, None
        last = chain.steps - 1
        for k, name, node in outside:
            if k == last:
                src = h_n if name == "h" else c_n
                value = call(graph, like, "squeeze.dim" if is_aten(like) else "squeeze", (src, 0))
            else:
                value = call(
                    graph, like, "select.int" if is_aten(like) else "select", (out, t_out, k)
                )
            copy_meta(value, node)
            node.replace_all_uses_with(value, delete_user_cb=lambda u: u not in inside)
        if chain.collect is not None:
            value = out
            if chain.collect_dim != t_out:
                value = call(
                    graph, like, "transpose.int" if is_aten(like) else "transpose", (out, 0, 1)
                )
                value = call(graph, like, "clone" if is_aten(like) else "contiguous", (value,))
            copy_meta(value, chain.collect)
            chain.collect.replace_all_uses_with(value)
    steps = [c.x for c in chain.cells]
    bases = [a for s in steps for a in s.all_input_nodes]
    bases += [a for b in bases for a in b.all_input_nodes]
    drop_dead_attrs(gm, erase(gm, [*chain.nodes(), *steps, *bases]))
    _drop_cell_module(gm, first.node, path)
    return new


def _drop_cell_module(gm: fx.GraphModule, cell: fx.Node, path: str) -> None:
    """Remove the cell module when no node calls it any more (an FX capture)."""
    if cell.op != "call_module":
        return
    target = str(cell.target)
    if any(n.op == "call_module" and str(n.target) == target for n in gm.graph.nodes):
        return
    if any(n.op == "get_attr" and str(n.target).startswith(target + ".") for n in gm.graph.nodes):
        return
    parent, _, leaf = target.rpartition(".")
    owner = gm.get_submodule(parent) if parent else gm
    if hasattr(owner, leaf):
        delattr(owner, leaf)


def loop_cost(chain: _chain.Chain) -> tuple[NodeCost, list[fx.Node]]:
    """What one sequence call costs (FLOPs of the cells, bytes of the sequence in and out,
    the input weights once and the recurrent weights per step) and the nodes it removes."""
    gates = {"lstm": 4, "gru": 3}.get(chain.kind, 1)
    x = info(chain.cells[0].x)
    batch = x.shape[0] if x is not None and x.shape else 1
    item = torch.empty((), dtype=chain.dtype).element_size()
    g = gates * chain.hidden_size
    flops = 2 * chain.steps * batch * g * (chain.input_size + chain.hidden_size)
    nbytes = item * (
        chain.steps * batch * (chain.input_size + chain.hidden_size)
        + g * chain.input_size
        + chain.steps * g * chain.hidden_size
    )
    return NodeCost(flops, nbytes), [c.node for c in chain.cells]


@register
class CellLoop(Rule):
    """A loop over one cell, step k reading time step k of one tensor and the state step
    k-1 left, -> one nn.LSTM / nn.GRU / nn.RNN (layer 0 holds the cell's tensors,
    unchanged). Exact: the same gates on the same numbers; the sequence module computes
    every step's input projection as one GEMM (oneDNN's fused RNN or ATen's loop on the
    CPU, cuDNN on CUDA), so only the order of the sums differs. Refused when the loop's
    length follows the input, when the state is changed (or dropout sits) between steps,
    or when the steps do not walk one tensor in order."""

    name = "rnn.cell_loop"
    family = "rnn"
    chapter = 19
    exactness = "exact"
    targets = ("cpu", "cuda")
    relieves = ("compute:rnn", "memory:rnn")
    anchors = ("rnn_cell",)
    description = (
        "A Python loop over LSTMCell / GRUCell / RNNCell (T calls of one cell) -> one "
        "nn.LSTM / nn.GRU / nn.RNN over the sequence (cuDNN, oneDNN), the initial state passed."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        chain = _chain.read(gm, node)
        if chain is None or isinstance(chain, str):
            return Refused(chain) if isinstance(chain, str) else None
        outs = [n for _, _, n in _chain.outside_readers(chain)]
        if chain.collect is not None:
            outs.append(chain.collect)
        return Found(
            chain.nodes(),
            f"replace the {describe(chain)} by one {_SEQ[chain.kind].__name__}",
            dict(chain=chain),
            key=f"{chain.cells[0].node.name}..{chain.cells[-1].node.name}",
            outputs=outs,
            record=dict(cell=node.name, steps=chain.steps, kind=chain.kind),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        chain: _chain.Chain = found["chain"]
        first = chain.cells[0].node
        mod = module_of(first)
        base = f"{first.target}_seq" if mod is not None else f"{first.name}_seq"
        install(gm, chain, sequence_module(chain), base)

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        cost, removed = loop_cost(found["chain"])
        return saving(target, removed, [cost], f"{len(removed)} cell calls -> 1 sequence call")
