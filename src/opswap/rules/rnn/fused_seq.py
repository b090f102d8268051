"""rnn.fused_seq: an nn.LSTM / nn.GRU (a module call, or aten.lstm / aten.gru from
torch.export) -> opswap::lstm_seq / opswap::gru_seq per layer, opswap's persistent Triton
recurrence, where the measured crossover says it beats cuDNN."""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx
from torch import nn
from torch.fx.node import Argument

from opswap.cost import NodeCost
from opswap.graph.ops import arg, attr_tensor, copy_meta, module_of, raw_name
from opswap.graph.shapes import info
from opswap.kernels import crossover
from opswap.rules._cost import saving
from opswap.rules._edits import call, drop_dead_attrs, erase
from opswap.rules._triton import CPU_REASON
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.registry import register
from opswap.targets.base import Target


@dataclasses.dataclass
class Seq:
    """One RNN call: its kind, input, initial state, weights per layer (get_attr nodes, or
    the module's parameter paths), and what reads its outputs."""

    kind: str  # "lstm" | "gru"
    node: fx.Node
    x: fx.Node
    h0: fx.Node | None
    c0: fx.Node | None
    layers: int
    bias: bool
    batch_first: bool
    hidden: int
    batch: int
    dtype: torch.dtype
    params: list[fx.Node | str]  # per layer: w_ih, w_hh[, b_ih, b_hh]
    #: (getitem of the call, index, and for an FX LSTM's (h, c) the getitems below it)
    reads: list[tuple[fx.Node, int]]
    nested: list[tuple[fx.Node, int]]


def _getitems(node: fx.Node) -> list[tuple[fx.Node, int]] | str:
    out = []
    for u in node.users:
        if u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int):
            out.append((u, int(u.args[1])))
        else:
            return f"{u.name} reads {node.name}'s outputs as a whole"
    return out


def read(gm: fx.GraphModule, node: fx.Node) -> Seq | str | None:
    """The RNN call at `node`, or why opswap's kernel cannot take it, or None."""
    mod = module_of(node)
    if mod is not None:
        if type(mod) not in (nn.LSTM, nn.GRU):
            return None
        assert isinstance(mod, (nn.LSTM, nn.GRU))
        kind = "lstm" if isinstance(mod, nn.LSTM) else "gru"
        if mod.bidirectional or int(getattr(mod, "proj_size", 0) or 0):
            return f"{node.name} is bidirectional or projected; the kernel runs one direction"
        if mod.training and mod.dropout and mod.num_layers > 1:
            return f"{node.name} is in training mode with dropout between layers"
        layers, bias, batch_first, hidden = (
            mod.num_layers,
            bool(mod.bias),
            bool(mod.batch_first),
            mod.hidden_size,
        )
        names = ["weight_ih", "weight_hh"] + (["bias_ih", "bias_hh"] if bias else [])
        params: list[fx.Node | str] = [
            f"{node.target}.{n}_l{i}" for i in range(layers) for n in names
        ]
        hx = arg(node, 1, "hx")
    else:
        name = raw_name(node)
        if name not in ("lstm", "gru") or len(node.args) < 9:
            return None
        kind = name
        _, hx, plist, has_bias, n_layers, dropout, train, bidir, first_dim = node.args[:9]
        if bidir:
            return f"{node.name} is bidirectional; the kernel runs one direction"
        if train and dropout and isinstance(n_layers, int) and n_layers > 1:
            return f"{node.name} runs in training mode with dropout between layers"
        if not isinstance(plist, (list, tuple)) or not all(
            isinstance(p, fx.Node) and attr_tensor(gm, p) is not None for p in plist
        ):
            return f"the weights of {node.name} are not constants of the model"
        params = list(plist)  # type: ignore[arg-type]
        per = 4 if has_bias else 2
        if not isinstance(n_layers, int) or len(params) != per * n_layers:
            return f"{node.name} has projections or a layout of weights the kernel does not take"
        first = attr_tensor(gm, params[1])
        assert first is not None
        hidden = int(first.shape[1])
        layers, bias, batch_first = n_layers, bool(has_bias), bool(first_dim)
    x = arg(node, 0, "input")
    xi = info(x) if isinstance(x, fx.Node) else None
    if xi is None or len(xi.shape) != 3:
        return f"the input of {node.name} is not a batched [B, T, F] / [T, B, F] tensor"
    if xi.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"{node.name} runs in {xi.dtype}; the kernel takes float32, bfloat16 and float16"
    h0: Argument
    c0: Argument = None
    if kind == "lstm" and isinstance(hx, (tuple, list)):
        h0, c0 = hx
    elif kind == "lstm" and hx is not None:
        return f"the initial (h, c) of {node.name} is one value {hx}; the rule takes a pair"
    else:
        h0 = hx
    if (h0 is not None and not isinstance(h0, fx.Node)) or (
        c0 is not None and not isinstance(c0, fx.Node)
    ):
        return f"the initial state of {node.name} is not a pair of tensors"
    reads = _getitems(node)
    if isinstance(reads, str):
        return reads
    nested: list[tuple[fx.Node, int]] = []
    if mod is not None and kind == "lstm":
        for g, i in reads:
            if i == 1:
                inner = _getitems(g)
                if isinstance(inner, str):
                    return inner
                nested += inner
    assert isinstance(x, fx.Node)
    return Seq(
        kind,
        node,
        x,
        h0,
        c0,
        int(layers),
        bool(bias),
        batch_first,
        hidden,
        xi.shape[0] if batch_first else xi.shape[1],
        xi.dtype,
        params,
        reads,
        nested,
    )


def install(gm: fx.GraphModule, seq: Seq) -> None:
    graph, node = gm.graph, seq.node
    op = (
        torch.ops.opswap.lstm_seq.default
        if seq.kind == "lstm"
        else torch.ops.opswap.gru_seq.default
    )
    per = len(seq.params) // seq.layers
    with graph.inserting_before(node):
        params = [p if isinstance(p, fx.Node) else graph.get_attr(p) for p in seq.params]
        x: fx.Node = seq.x
        hs: list[fx.Node] = []
        cs: list[fx.Node] = []
        for layer in range(seq.layers):
            w = params[per * layer : per * (layer + 1)]
            w_ih, w_hh = w[0], w[1]
            b_ih, b_hh = (w[2], w[3]) if seq.bias else (None, None)
            h0 = (
                call(graph, node, "select.int" if _aten(node) else "select", (seq.h0, 0, layer))
                if seq.h0 is not None
                else None
            )
            if seq.kind == "lstm":
                c0 = (
                    call(graph, node, "select.int" if _aten(node) else "select", (seq.c0, 0, layer))
                    if seq.c0 is not None
                    else None
                )
                new = graph.call_function(op, (x, h0, c0, w_ih, w_hh, b_ih, b_hh, seq.batch_first))
                cs.append(graph.call_function(operator.getitem, (new, 2)))
            else:
                new = graph.call_function(op, (x, h0, w_ih, w_hh, b_ih, b_hh, seq.batch_first))
            x = graph.call_function(operator.getitem, (new, 0))
            hs.append(graph.call_function(operator.getitem, (new, 1)))
        h_n = call(graph, node, "stack", (hs, 0))
        c_n = call(graph, node, "stack", (cs, 0)) if cs else None
    values = {0: x, 1: h_n, 2: c_n}
    for g, i in seq.nested:  # an FX LSTM's (h_n, c_n)
        v = values[i + 1]
        assert v is not None
        copy_meta(v, g)
        g.replace_all_uses_with(v)
    for g, i in seq.reads:
        if g.users and not (seq.nested and i == 1):
            v = values[i]
            assert v is not None
            copy_meta(v, g)
            g.replace_all_uses_with(v)
    gone = [g for g, _ in seq.nested] + [g for g, _ in seq.reads] + [node]
    unread = [n for n in (h_n, c_n) if n is not None] + hs + cs  # states nothing reads
    drop_dead_attrs(gm, erase(gm, gone + unread))


def _aten(node: fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)


@register
class FusedSeq(Rule):
    """nn.LSTM / nn.GRU -> opswap::lstm_seq / opswap::gru_seq per layer: every step's input
    projection in one GEMM, then one persistent Triton kernel over the time steps (the
    recurrent product and the gates fused, W_hh kept in registers where it fits).
    Exact: the same gates in float32 (fp32 products without TF32), only the order of the
    sums differs from cuDNN's. Planned on CUDA only where the measured crossover table
    (benchmarks/bench_rnn.py) has the kernel faster than cuDNN at the site's hidden size
    and batch; elsewhere the site is skipped with that reason."""

    name = "rnn.fused_seq"
    family = "rnn"
    chapter = 19
    exactness = "exact"
    implementation = "triton"
    targets = ("cuda",)
    after = ("rnn.cell_loop",)
    relieves = ("compute:rnn", "memory:rnn")
    anchors = ("rnn",)
    description = (
        "nn.LSTM / nn.GRU (one direction) -> opswap::lstm_seq / gru_seq: the input projection "
        "as one GEMM, the recurrence as one persistent Triton kernel (CUDA, where measured "
        "faster than cuDNN)."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        seq = read(gm, node)
        if seq is None or isinstance(seq, str):
            return Refused(seq) if isinstance(seq, str) else None
        what = "LSTM" if seq.kind == "lstm" else "GRU"
        return Found(
            [node, *(g for g, _ in seq.reads), *(g for g, _ in seq.nested)],
            f"run the {what} {node.name} ({seq.layers} layer(s), hidden {seq.hidden}) as "
            f"opswap::{seq.kind}_seq",
            dict(seq=seq),
            key=node.name,
            outputs=[g for g, _ in seq.reads] + [g for g, _ in seq.nested],
            record=dict(rnn=node.name, kind=seq.kind, layers=seq.layers, hidden=seq.hidden),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        install(gm, found["seq"])

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        seq: Seq = found["seq"]
        kernel = f"{seq.kind}_seq"
        if getattr(target, "kind", "cpu") != "cuda":
            overhead = target.op_overhead(True) if hasattr(target, "op_overhead") else 0.0
            return Estimate(0.0, 0.0, -max(overhead, 1e-9), CPU_REASON)
        dev = crossover.device_class(target)
        entry = crossover.lookup(kernel, dev, seq.dtype, seq.hidden, seq.batch)
        est = saving(target, [seq.node], [NodeCost(0, 0)], f"{kernel} at hidden {seq.hidden}")
        if entry is None:
            return Estimate(
                0.0,
                0.0,
                -1e-9,
                f"{kernel} is not measured against cuDNN on {dev} at hidden {seq.hidden}, "
                f"batch {seq.batch} (benchmarks/bench_rnn.py --update-crossover measures it)",
            )
        sign = 1.0 if entry.beats_eager else -1.0
        return dataclasses.replace(
            est,
            flops_saved=0.0,
            bytes_saved=0.0,
            time_saved_s=sign * max(abs(est.time_saved_s or 0.0), 1e-9),
            note=f"measured at {entry.speedup_vs_eager}x cuDNN on {dev} ({entry.source})",
        )
