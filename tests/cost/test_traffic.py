"""Bytes per node: reads + writes of an op run alone; views move nothing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opswap.cost import node_cost
from opswap.graph.capture import capture
from opswap.graph.ops import compute_nodes, op_kind, raw_name

FLAVOURS = ("fx", "export")
F32 = 4


def costs(model: nn.Module, inputs: tuple, method: str) -> dict[str, object]:
    """node name -> (raw op name, NodeCost) for every compute node."""
    c = capture(model.eval(), inputs, method=method)
    return {n.name: (raw_name(n), op_kind(n), node_cost(n)) for n in compute_nodes(c.gm)}


def by_kind(model, inputs, method, kind):
    found = [cost for _, k, cost in costs(model, inputs, method).values() if k == kind]
    assert found, kind
    return found


@pytest.mark.parametrize("method", FLAVOURS)
def test_layer_norm_bytes(method):
    ln = nn.Sequential(nn.LayerNorm(32))
    (cost,) = by_kind(ln, (torch.randn(2, 16, 32),), method, "layer_norm")
    act = 2 * 16 * 32 * F32
    assert cost.read == act + 2 * 32 * F32  # input, weight, bias
    assert cost.written == act
    assert cost.bytes == 2 * act + 2 * 32 * F32


@pytest.mark.parametrize("method", FLAVOURS)
def test_linear_reads_input_and_weights_writes_output(method):
    (cost,) = by_kind(nn.Sequential(nn.Linear(12, 5)), (torch.randn(3, 12),), method, "linear")
    assert cost.read == (3 * 12 + 5 * 12 + 5) * F32
    assert cost.written == 3 * 5 * F32


@pytest.mark.parametrize("method", FLAVOURS)
def test_batch_norm_reads_running_stats_not_counter(method):
    (cost,) = by_kind(
        nn.Sequential(nn.BatchNorm2d(6)), (torch.randn(2, 6, 5, 3),), method, "batch_norm"
    )
    act = 2 * 6 * 5 * 3 * F32
    assert cost.read == act + 4 * 6 * F32  # weight, bias, running mean and var
    assert cost.written >= act


class Views(nn.Module):
    def forward(self, x):
        a = x.view(3, 4, 10)
        b = a.transpose(1, 2)
        c = b.permute(0, 2, 1)
        d = c.unsqueeze(0).squeeze(0)
        e = d[:, 1:, :]
        f, g = torch.split(e, 5, dim=2)
        h = f.expand(2, 3, 3, 5)
        return h.reshape(2, 3, 15), g


@pytest.mark.parametrize("method", FLAVOURS)
def test_views_move_no_bytes(method):
    found = costs(Views(), (torch.randn(3, 40),), method)
    views = {
        name: c
        for name, (_, kind, c) in found.items()
        if kind in ("view", "transpose", "permute", "squeeze", "slice", "split", "expand")
    }
    assert len(views) >= 7
    for name, cost in views.items():
        assert cost.bytes == 0, name
    # reshape of the expanded (stride-0) tensor cannot be a view: it copies, reading
    # the 3x3x5 elements behind the broadcast once and writing all 2x3x3x5
    (reshape,) = [c for _, kind, c in found.values() if kind == "reshape"]
    assert reshape.read == 3 * 3 * 5 * F32
    assert reshape.written == 2 * 3 * 15 * F32


class TransposeThenCopy(nn.Module):
    def forward(self, x):
        t = x.transpose(1, 2)
        flat_ok = x.reshape(x.shape[0], -1)  # contiguous: a view
        same = x.contiguous()  # already contiguous: no copy
        packed = t.contiguous()  # the transpose is paid here
        return flat_ok, same, packed


@pytest.mark.parametrize("method", FLAVOURS)
def test_contiguous_pays_for_the_view_before_it(method):
    x = torch.randn(2, 5, 7)
    found = costs(TransposeThenCopy(), (x,), method)
    contig = sorted(c.bytes for _, kind, c in found.values() if kind == "contiguous")
    # export drops the no-op x.contiguous(); FX keeps it at 0 bytes
    assert contig[-1] == 2 * x.numel() * F32
    assert contig[:-1] == ([0] if method == "fx" else [])
    for _, kind, c in found.values():
        if kind in ("transpose", "reshape", "view"):
            assert c.bytes == 0


@pytest.mark.parametrize("method", FLAVOURS)
def test_eval_dropout_and_identity_are_free(method):
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.3), nn.Identity(), nn.ReLU())
    found = costs(model, (torch.randn(3, 4),), method)
    free = [c for _, kind, c in found.values() if kind in ("dropout", "identity")]
    assert all(c.bytes == 0 and c.flops == 0 for c in free)
    (relu,) = [c for _, kind, c in found.values() if kind == "relu"]
    assert relu.bytes == 2 * 3 * 4 * F32


def test_training_dropout_is_not_free():
    class TrainDrop(nn.Module):
        def forward(self, x):
            return F.dropout(x, 0.5, training=True)

    (cost,) = by_kind(TrainDrop(), (torch.randn(6, 7),), "fx", "dropout")
    assert cost.bytes >= 2 * 6 * 7 * F32


@pytest.mark.parametrize("method", FLAVOURS)
def test_embedding_reads_only_gathered_rows(method):
    emb = nn.Sequential(nn.Embedding(1000, 16))
    idx = torch.randint(0, 1000, (2, 5))
    (cost,) = by_kind(emb, (idx,), method, "embedding")
    rows = 2 * 5 * 16 * F32
    assert cost.read == 2 * 5 * 8 + rows  # int64 indices + the rows, not the 64 kB table
    assert cost.written == rows
    assert cost.flops == 0


@pytest.mark.parametrize("method", FLAVOURS)
def test_advanced_indexing_gathers(method):
    class Pick(nn.Module):
        def forward(self, x, i):
            return x[i]

    x, i = torch.randn(50, 8), torch.tensor([3, 1, 4])
    found = costs(Pick(), (x, i), method)
    gathers = [c for _, kind, c in found.values() if c.bytes]
    assert len(gathers) == 1
    assert gathers[0].written == 3 * 8 * F32
    assert gathers[0].read == 3 * 8 * F32 + 3 * 8  # the gathered rows and the index


@pytest.mark.parametrize("method", FLAVOURS)
def test_elementwise_broadcast_reads_each_input_once(method):
    class AddSelf(nn.Module):
        def forward(self, x, b):
            return x + x * b

    x, b = torch.randn(4, 9), torch.randn(9)
    found = costs(AddSelf(), (x, b), method)
    mul = [c for raw, kind, c in found.values() if kind == "mul"][0]
    add = [c for raw, kind, c in found.values() if kind == "add"][0]
    assert mul.read == (36 + 9) * F32 and mul.written == 36 * F32
    assert add.read == 2 * 36 * F32  # x and x*b, each once


def test_half_precision_halves_bytes():
    lin32 = by_kind(nn.Sequential(nn.Linear(8, 8)), (torch.randn(4, 8),), "fx", "linear")[0]
    lin16 = by_kind(
        nn.Sequential(nn.Linear(8, 8)).half(), (torch.randn(4, 8).half(),), "fx", "linear"
    )[0]
    assert lin16.bytes * 2 == lin32.bytes
    assert lin16.flops == lin32.flops
