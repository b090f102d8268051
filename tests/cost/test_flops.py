"""FLOPs per node: hand-computed cases and agreement with torch's FlopCounterMode."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from opswap.cost import conv_flops, node_cost, sdpa_flops
from opswap.graph.capture import capture
from opswap.graph.ops import category, compute_nodes, op_kind

FLAVOURS = ("fx", "export")
HEAVY = ("conv", "matmul", "attention", "rnn")


def counted(model: nn.Module, *inputs) -> int:
    """FlopCounterMode's total for one run (math SDPA, so attention shows up as bmm)."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc, torch.no_grad():
        model(*inputs)
    return fc.get_total_flops()


def graph_flops(model: nn.Module, inputs: tuple, method: str, categories=HEAVY) -> int:
    c = capture(model.eval(), inputs, method=method)
    assert c.method == method
    return sum(node_cost(n).flops for n in compute_nodes(c.gm) if category(n) in categories)


def only_node(model: nn.Module, inputs: tuple, kind: str, method: str = "fx"):
    c = capture(model.eval(), inputs, method=method)
    nodes = [n for n in compute_nodes(c.gm) if op_kind(n) == kind]
    assert len(nodes) == 1, [op_kind(n) for n in compute_nodes(c.gm)]
    return nodes[0]


class Fn(nn.Module):
    """Wrap a function of the inputs as a module (weights as parameters where given)."""

    def __init__(self, fn, n_inputs: int = 1, **params):
        super().__init__()
        self.fn = fn
        self.n_inputs = n_inputs
        for k, v in params.items():
            self.register_parameter(k, nn.Parameter(v))

    def forward(self, a, b=None, c=None, d=None):  # fixed arity: FX cannot trace *args
        return self.fn(self, *[a, b, c, d][: self.n_inputs])


# --------------------------------------------------------------------------- hand-computed


@pytest.mark.parametrize("method", FLAVOURS)
def test_conv2d_exact_count(method):
    node = only_node(nn.Conv2d(3, 8, 3), (torch.randn(1, 3, 8, 8),), "conv", method)
    assert node_cost(node).flops == 2 * 8 * 6 * 6 * 3 * 3 * 3


@pytest.mark.parametrize("method", FLAVOURS)
def test_depthwise_and_grouped_conv(method):
    dw = only_node(
        nn.Conv2d(8, 8, 3, groups=8, padding=1), (torch.randn(2, 8, 10, 10),), "conv", method
    )
    # each output channel sees one input channel: 2 * N * C * H * W * k*k
    assert node_cost(dw).flops == 2 * 2 * 8 * 10 * 10 * 9
    g = only_node(nn.Conv2d(6, 4, 3, groups=2), (torch.randn(1, 6, 7, 9),), "conv", method)
    assert node_cost(g).flops == 2 * 4 * 5 * 7 * (6 // 2) * 9


@pytest.mark.parametrize("method", FLAVOURS)
def test_strided_conv(method):
    node = only_node(nn.Conv2d(3, 5, 3, stride=2), (torch.randn(1, 3, 11, 11),), "conv", method)
    assert node_cost(node).flops == 2 * 5 * 5 * 5 * 3 * 9  # 11 -> 5 with stride 2


@pytest.mark.parametrize("method", FLAVOURS)
def test_linear_counts_products_not_bias(method):
    node = only_node(nn.Linear(17, 5), (torch.randn(3, 7, 17),), "linear", method)
    assert node_cost(node).flops == 2 * 3 * 7 * 5 * 17


@pytest.mark.parametrize("method", FLAVOURS)
def test_bmm(method):
    node = only_node(
        Fn(lambda s, a, b: torch.bmm(a, b), 2),
        (torch.randn(4, 5, 7), torch.randn(4, 7, 3)),
        "matmul",
        method,
    )
    assert node_cost(node).flops == 2 * 4 * 5 * 3 * 7


@pytest.mark.parametrize("method", FLAVOURS)
def test_sdpa_hand_count(method):
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 4, 12, 8), torch.randn(2, 4, 12, 6)
    node = only_node(
        Fn(lambda s, q, k, v: F.scaled_dot_product_attention(q, k, v), 3),
        (q, k, v),
        "attention",
        method,
    )
    # Q K^T: 2*B*H*Sq*Sk*D, then P V: 2*B*H*Sq*Sk*Dv
    assert node_cost(node).flops == 2 * 2 * 4 * 16 * 12 * 8 + 2 * 2 * 4 * 16 * 12 * 6
    assert sdpa_flops(q.shape, k.shape, v.shape) == node_cost(node).flops


@pytest.mark.parametrize("method", FLAVOURS)
def test_matrix_vector_matmul(method):
    # FlopCounterMode has no formula for aten.mv, so this one is checked by hand.
    node = only_node(
        Fn(lambda s, a, b: a @ b, 2), (torch.randn(3, 5, 7), torch.randn(7)), "matmul", method
    )
    assert node_cost(node).flops == 2 * 3 * 5 * 7


def test_conv_flops_formula_transposed():
    # transposed conv: every input position scatters into C_out/groups * k channels
    assert conv_flops((1, 4, 5, 5), (4, 3, 3, 3), (1, 3, 11, 11), transposed=True) == (
        2 * 25 * 4 * 3 * 9
    )


# --------------------------------------------------------------------------- FlopCounterMode


CONVS = [
    (nn.Conv1d(4, 6, 3, stride=2), (2, 4, 31)),
    (nn.Conv1d(6, 6, 5, groups=3, dilation=2, padding=3), (3, 6, 17)),
    (nn.Conv2d(3, 8, 3, padding=1), (2, 3, 13, 11)),
    (nn.Conv2d(8, 8, 3, stride=2, groups=8), (1, 8, 15, 15)),
    (nn.Conv2d(6, 9, (1, 5), stride=(1, 2), groups=3), (2, 6, 7, 19)),
    (nn.Conv3d(2, 4, (3, 2, 2), stride=(1, 2, 1)), (1, 2, 5, 9, 6)),
    (nn.ConvTranspose1d(4, 6, 4, stride=2), (2, 4, 9)),
    (nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2, output_padding=1), (1, 4, 5, 7)),
    (nn.ConvTranspose3d(2, 3, 2, stride=2), (1, 2, 3, 4, 5)),
]


def _conv_id(x) -> str:
    return type(x).__name__ if isinstance(x, nn.Module) else "x".join(map(str, x))


@pytest.mark.parametrize("method", FLAVOURS)
@pytest.mark.parametrize("conv,shape", CONVS, ids=_conv_id)
def test_conv_agrees_with_flop_counter(conv, shape, method):
    x = torch.randn(*shape)
    expected = counted(conv.eval(), x)
    # In a container the conv is an FX call_module leaf; export gives aten.conv*.
    assert graph_flops(nn.Sequential(conv), (x,), method) == expected
    if method == "fx" and not isinstance(conv, nn.modules.conv._ConvTransposeNd):
        # traced as the root module, FX records F.conv*d with the weight as a get_attr node
        assert graph_flops(conv, (x,), "fx") == expected


MATMULS = [
    ("matmul-broadcast", lambda s, a, b: torch.matmul(a, b), [(2, 1, 5, 7), (3, 7, 4)]),
    ("matmul-1d-3d", lambda s, a, b: a @ b, [(7,), (3, 7, 4)]),
    ("mm", lambda s, a, b: torch.mm(a, b), [(9, 13), (13, 5)]),
    ("addmm", lambda s, c, a, b: torch.addmm(c, a, b), [(5,), (9, 13), (13, 5)]),
    ("baddbmm", lambda s, c, a, b: torch.baddbmm(c, a, b), [(3, 4, 6), (3, 4, 5), (3, 5, 6)]),
    ("einsum", lambda s, a, b: torch.einsum("bij,bjk->bik", a, b), [(2, 3, 4), (2, 4, 5)]),
    ("F.linear", lambda s, x: F.linear(x, s.w, s.b), [(2, 3, 11)]),
]


@pytest.mark.parametrize("method", FLAVOURS)
@pytest.mark.parametrize("name,fn,shapes", MATMULS, ids=[m[0] for m in MATMULS])
def test_matmul_agrees_with_flop_counter(name, fn, shapes, method):
    model = Fn(fn, len(shapes), w=torch.randn(6, 11), b=torch.randn(6))
    xs = tuple(torch.randn(*s) for s in shapes)
    expected = counted(model, *xs)
    assert expected > 0
    assert graph_flops(model, xs, method) == expected


@pytest.mark.parametrize("method", FLAVOURS)
def test_sdpa_agrees_with_flop_counter_gqa_and_mask(method):
    q, k, v = torch.randn(2, 4, 9, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    mask = torch.rand(9, 7) > 0.3
    model = Fn(
        lambda s, q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True),
        4,
    )
    assert graph_flops(model, (q, k, v, mask), method) == counted(model, q, k, v, mask)


def test_multihead_attention_module_agrees_with_flop_counter():
    mha = nn.MultiheadAttention(16, 2, batch_first=True, kdim=12, vdim=10).eval()
    q, k, v = torch.randn(2, 5, 16), torch.randn(2, 7, 12), torch.randn(2, 7, 10)
    model = Fn(lambda s, q, k, v: s.mha(q, k, v)[0], 3)
    model.mha = mha
    with FlopCounterMode(display=False) as fc:  # grad on: the fast path would hide the matmuls
        model(q, k, v)
    assert graph_flops(model, (q, k, v), "fx") == fc.get_total_flops()


# --------------------------------------------------------------------------- recurrent


@pytest.mark.parametrize("method", FLAVOURS)
def test_gru_agrees_with_flop_counter(method):
    gru = nn.GRU(8, 16, num_layers=2, bidirectional=True)
    model = Fn(lambda s, x: s.gru(x)[0])
    model.gru = gru
    x = torch.randn(5, 3, 8)  # [T, B, I]
    expected = counted(model.eval(), x)
    assert expected > 0
    assert graph_flops(model, (x,), method) == expected


@pytest.mark.parametrize("method", FLAVOURS)
def test_lstm_counts_gate_matmuls(method):
    lstm = nn.LSTM(8, 16, num_layers=2, batch_first=True, proj_size=4)
    model = Fn(lambda s, x: s.lstm(x)[0])
    model.lstm = lstm
    x = torch.randn(3, 5, 8)  # [B, T, I]
    # per step and batch row, each weight matrix is one matrix-vector product
    mats = 4 * 16 * 8 + 4 * 16 * 4 + 4 * 16 + (4 * 16 * 4 + 4 * 16 * 4 + 4 * 16)
    assert graph_flops(model, (x,), method) == 2 * 3 * 5 * mats


def test_lstm_matches_an_unrolled_lstm_cell_loop():
    lstm = nn.LSTM(6, 10)
    cell = nn.LSTMCell(6, 10)
    x = torch.randn(4, 3, 6)  # [T, B, I]
    with FlopCounterMode(display=False) as fc:
        h = c = torch.zeros(3, 10)
        for t in range(4):
            h, c = cell(x[t], (h, c))
    model = Fn(lambda s, x: s.lstm(x)[0])
    model.lstm = lstm
    assert graph_flops(model, (x,), "fx") == fc.get_total_flops() > 0


# --------------------------------------------------------------------------- per-element families


@pytest.mark.parametrize("method", FLAVOURS)
def test_per_element_constants(method):
    x = torch.randn(2, 3, 5, 7)
    n = x.numel()
    model = Fn(lambda s, x: s.pool(torch.softmax(F.gelu(s.bn(x)) + 1.5, dim=-1)))
    model.bn = nn.BatchNorm2d(3).eval()
    model.pool = nn.MaxPool2d(2)
    c = capture(model.eval(), (x,), method=method)
    flops = {op_kind(nd): node_cost(nd).flops for nd in compute_nodes(c.gm)}
    assert flops["batch_norm"] == 4 * n  # eval: (x - mean) * rstd * w + b
    assert flops["gelu"] == 5 * n
    assert flops["add"] == n
    assert flops["softmax"] == 5 * n
    assert flops["max_pool"] == (2 * 3 * 2 * 3) * 4  # one compare per window element


class Zoo(nn.Module):
    """Many op families in one graph, to check nothing raises in either flavour."""

    def __init__(self):
        super().__init__()
        self.gn = nn.GroupNorm(2, 4)
        self.inorm = nn.InstanceNorm2d(4, affine=True)
        self.rms = nn.RMSNorm(6)
        self.up = nn.Upsample(scale_factor=2, mode="bilinear")
        self.shuffle = nn.PixelShuffle(2)
        self.bag = nn.EmbeddingBag(30, 5, mode="sum")
        self.cell = nn.LSTMCell(6, 7)
        self.act = nn.Hardswish()

    def forward(self, x, idx, offsets, v):
        y = self.act(self.inorm(self.gn(x)))
        y = self.shuffle(self.up(y))
        z = F.pad(y, (1, 1)).mean(dim=(2, 3))
        top = torch.topk(v, 3, dim=-1).values
        srt = torch.sort(v, dim=-1).values.cumsum(-1)
        h, c = self.cell(self.rms(v))
        w = torch.cat([h, c], dim=-1).var(dim=-1, keepdim=True)
        bag = self.bag(idx, offsets)
        return z, top, srt, w, bag, v.repeat(1, 2).half()


@pytest.mark.parametrize("method", FLAVOURS)
def test_many_op_families_are_costed(method):
    xs = (
        torch.randn(2, 4, 5, 6),
        torch.randint(0, 30, (9,)),
        torch.tensor([0, 4]),
        torch.randn(2, 6),
    )
    c = capture(Zoo().eval(), xs, method=method)
    costs = {n.name: (op_kind(n), node_cost(n)) for n in compute_nodes(c.gm)}
    for _, cost in costs.values():
        assert cost.flops >= 0 and cost.bytes >= 0 and cost.bytes == cost.read + cost.written
    kinds = {k for k, _ in costs.values()}
    assert {"group_norm", "hardswish", "embedding_bag", "rnn_cell"} <= kinds
    (cell,) = [cost for k, cost in costs.values() if k == "rnn_cell"]
    assert cell.flops == 2 * 2 * (4 * 7 * 6 + 4 * 7 * 7)
    (bag,) = [cost for k, cost in costs.values() if k == "embedding_bag"]
    assert bag.flops == 9 * 5  # one add per gathered element
    ups = [cost for k, cost in costs.values() if k == "upsample"]
    assert ups and ups[0].flops == 8 * 2 * 4 * 10 * 12  # bilinear: 4 taps, a multiply-add each
