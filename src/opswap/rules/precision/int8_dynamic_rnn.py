"""precision.int8_dynamic_rnn: an nn.LSTM or nn.GRU -> int8 weights with dynamically
quantised inputs and hidden states (Int8DynamicRNN)."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.fx as fx
from torch import nn

from opswap.graph.ops import module_of
from opswap.graph.shapes import info
from opswap.rules._edits import install_module
from opswap.rules._matching import input_of
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.precision import _timing
from opswap.rules.precision._int8_rnn_module import Int8DynamicRNN
from opswap.rules.registry import register
from opswap.targets.base import Target, Timer

MIN_HIDDEN = 64


@register
class Int8DynamicRNNRule(Rule):
    """nn.LSTM / nn.GRU -> Int8DynamicRNN: each layer's input projection over all time
    steps is one int8 GEMM, each step's recurrent product another, with per-row dynamic
    input scales (the int8_linear kernel); gate arithmetic stays float32.

    Approximate (about 1% relative L2 on the outputs of a random layer, which the
    recurrence may carry further over long sequences: verification and bisection decide).
    Offered for unidirectional RNNs without projections, captured as modules (the FX
    flavour); on the `cpu` target the prediction is a measurement at the site's shape,
    since the per-step loop costs dispatch overhead that only large hidden sizes repay.
    """

    name = "precision.int8_dynamic_rnn"
    family = "precision"
    chapter = 6
    exactness = "approx"
    targets = ("cpu",)
    relieves = ("compute:rnn", "memory:rnn")
    description = (
        "nn.LSTM / nn.GRU -> int8 weights, input and hidden state quantised per row at run "
        "time, int32-accumulated GEMMs; gates in float32."
    )

    anchors = ("rnn",)

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        mod = module_of(node)
        if isinstance(mod, Int8DynamicRNN):
            return None
        if node.op != "call_module" or not isinstance(mod, (nn.LSTM, nn.GRU)):
            return Refused(
                f"{node.name} is not an nn.LSTM or nn.GRU module call (captured as ATen ops); "
                "int8 RNNs are offered for module calls in FX captures"
            )
        if mod.bidirectional or int(getattr(mod, "proj_size", 0) or 0):
            return Refused(
                f"{node.name} is bidirectional or projected; only plain RNNs are offered"
            )
        if mod.weight_ih_l0.dtype != torch.float32:
            return Refused(f"{node.name}'s weights are not float32")
        if mod.hidden_size < MIN_HIDDEN:
            return Refused(
                f"{node.name} has hidden size {mod.hidden_size}: below {MIN_HIDDEN} the "
                "quantise passes of each step cost more than the int8 GEMMs save"
            )
        x = input_of(node)
        xi = info(x) if x is not None else None
        if xi is None or xi.dtype != torch.float32:
            return Refused(f"the input of {node.name} is not a float32 tensor of known shape")
        return Found(
            (node,),
            f"{node.name} ({type(mod).__name__}, hidden {mod.hidden_size}, "
            f"{mod.num_layers} layer(s)) with int8 weights",
            dict(mod=mod, shape=tuple(xi.shape)),
            record=dict(rnn=node.name),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        node = found.nodes[0]
        install_module(gm, node, Int8DynamicRNN(found["mod"]), str(node.target))

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        mod, shape = found["mod"], found["shape"]
        if not _timing.is_this_cpu(target):
            return Estimate(note="no roofline for a recurrence: planned untimed")

        def make() -> tuple[Callable[[], object], Callable[[], object]]:
            g = torch.Generator().manual_seed(sum(shape) * 7 + mod.hidden_size)
            x = torch.randn(*shape, generator=g)
            q = Int8DynamicRNN(mod)
            return (lambda: mod(x)), (lambda: q(x))

        key = ("rnn", type(mod).__name__, shape, mod.hidden_size, mod.num_layers, mod.bias)
        t32, t8 = _timing.timed_pair(key, cast(Timer, target.timer), make)  # is_this_cpu: it is set
        weights = sum(p.numel() for p in mod.parameters() if p.dim() == 2)
        return Estimate(
            0.0,
            float(3 * weights),
            t32 - t8,
            f"timed at input {list(shape)} on this CPU: float32 {t32 * 1e6:.0f} us, "
            f"int8 {t8 * 1e6:.0f} us",
        )
