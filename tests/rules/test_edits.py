"""rules/_edits.replace_with: the insert / copy metadata / hand over readers / erase
sequence most rewrites end with, in both capture flavours."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opswap.graph import capture, op_kind
from opswap.rules._edits import replace_with


class Swish(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(6) + 0.5)

    def forward(self, x):
        s = x * torch.sigmoid(x)  # -> silu(x): the sigmoid goes too
        return s + 1.0, torch.relu(x * self.scale)  # the mul by a weight -> relu(x)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_replace_with_hands_over_readers_and_erases_what_is_left_unread(method):
    torch.manual_seed(0)
    model, x = Swish().eval(), torch.randn(3, 6)
    gm = capture(model, (x,), method=method).gm
    sig = next(n for n in gm.graph.nodes if op_kind(n) == "sigmoid")
    mul = next(iter(sig.users))
    shape = {k: mul.meta[k] for k in ("tensor_meta", "val") if k in mul.meta}
    new = replace_with(gm, mul, "silu", (mul.args[0] if mul.args[1] is sig else mul.args[1],))
    assert shape and all(new.meta[k] is v for k, v in shape.items())  # later matches read it
    assert op_kind(new) == "silu" and sig in gm.graph.nodes  # only `mul` removed by default
    assert not sig.users
    weighted = next(n for n in gm.graph.nodes if op_kind(n) == "mul")
    relu = next(iter(weighted.users))
    op = torch.ops.aten.relu.default if method == "export" else F.relu
    src = next(a for a in weighted.args if a.op == "placeholder")
    replace_with(gm, relu, op, (src,), remove=[relu, weighted, sig])
    gm.graph.lint()
    gm.recompile()
    kinds = [op_kind(n) for n in gm.graph.nodes if n.op == "call_function"]
    assert "sigmoid" not in kinds and "mul" not in kinds
    assert not any(n.op == "get_attr" for n in gm.graph.nodes)  # the weight only mul read
    for rows in (1, 3, 8):  # other batch sizes than the example's
        inp = torch.randn(rows, 6)
        got = gm(inp)
        assert torch.allclose(got[0], F.silu(inp) + 1.0, atol=1e-6)
        assert torch.allclose(got[1], torch.relu(inp), atol=0)
