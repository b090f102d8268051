import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opswap.graph import CATEGORIES, capture, category, op_kind
from opswap.graph.ops import compute_nodes


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.pool = nn.MaxPool2d(2)
        self.lin = nn.Linear(4, 6)
        self.emb = nn.Embedding(10, 4)
        self.gru = nn.GRU(4, 4, batch_first=True)

    def forward(self, x, ids):
        y = F.gelu(self.bn(self.conv(x)))
        y = self.pool(y).mean((2, 3))  # [B, 4]
        e = self.emb(ids).sum(1)  # [B, 4]
        s, _ = self.gru(self.emb(ids))
        z = self.lin(y + e + s[:, -1])
        z = z.transpose(0, 1).reshape(-1)
        return torch.softmax(z, 0)


EXPECTED = {
    "conv": "conv",
    "bn": "normalization",
    "pool": "pooling",
    "lin": "matmul",
    "emb": "embedding",
    "gru": "rnn",
}


@pytest.mark.parametrize("method", ["fx", "export"])
def test_taxonomy_same_in_both_flavours(method):
    m = Mixed().eval()
    inputs = (torch.randn(2, 3, 10, 10), torch.randint(0, 10, (2, 5)))
    gm = capture(m, inputs, method=method).gm
    cats = {category(n) for n in compute_nodes(gm)}
    kinds = {op_kind(n) for n in compute_nodes(gm)}
    for want in (
        "conv",
        "normalization",
        "pooling",
        "matmul",
        "embedding",
        "rnn",
        "activation",
        "softmax",
        "reduction",
        "data-movement",
        "elementwise",
    ):
        assert want in cats, (method, want, cats)
    for want in (
        "conv",
        "batch_norm",
        "gelu",
        "max_pool",
        "mean",
        "linear",
        "embedding",
        "transpose",
        "reshape",
        "softmax",
        "add",
        "sum",
    ):
        assert want in kinds, (method, want, kinds)
    assert cats <= set(CATEGORIES)


def test_module_leaves_categorised():
    gm = capture(Mixed().eval(), (torch.randn(2, 3, 10, 10), torch.randint(0, 10, (2, 5)))).gm
    by_target = {n.target: category(n) for n in gm.graph.nodes if n.op == "call_module"}
    for target, cat in EXPECTED.items():
        assert by_target[target] == cat


def test_unknown_ops_are_other():
    class Odd(nn.Module):
        def forward(self, x):
            return torch.fft.rfft(x).abs()

    gm = capture(Odd(), (torch.randn(4, 8),)).gm
    kinds = [op_kind(n) for n in compute_nodes(gm)]
    assert any(k.startswith("unknown:") for k in kinds)
    assert "other" in {category(n) for n in compute_nodes(gm)}


def test_operator_add_is_elementwise():
    g = torch.fx.Graph()
    a = g.placeholder("a")
    b = g.call_function(operator.add, (a, a))
    g.output(b)
    torch.fx.GraphModule(nn.Module(), g)
    assert op_kind(b) == "add" and category(b) == "elementwise"
