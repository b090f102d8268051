"""opswap::batched_embedding_bag: the Triton kernel (under TRITON_INTERPRET=1 in one child
Python, or on the GPU) and the CPU reference against a loop over the tables at odd shapes
(3 tables of 37, 5 and 100 rows, D 7 and 130, bags of 1, 9 and 40, batch 1 and 5), sum and
mean, weighted per sample, float32, float16 and int8 tables; empty bags; the CPU path is
one gather; opcheck and torch.export; errors for bad input."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _rows_check as rc  # noqa: E402

from opswap.kernels import embedding_bag as E  # noqa: E402

SIZES = (37, 5, 100)
# (batch, bag, dim, mean, weighted, table dtype)
CASES = [
    (5, 9, 7, False, False, "float32"),
    (1, 40, 130, True, True, "float32"),
    (5, 1, 7, True, False, "float16"),
    (5, 9, 130, False, True, "int8"),
]


def _key(c):
    return str(list(c))


def _tables(dim, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, dim, generator=g) for n in SIZES]


def _loop(tables, idx, psw, mean):
    """The model as written: one lookup and pooling per table."""
    outs = []
    for t, w in enumerate(tables):
        rows = w[idx[:, t]]
        if psw is not None:
            rows = rows * psw[:, t, :, None]
        outs.append(rows.mean(1) if mean else rows.sum(1))
    return torch.stack(outs, 1)


def _inputs(batch, bag, dim, mean, weighted, dtype):
    tables = _tables(dim, batch * bag + dim)
    g = torch.Generator().manual_seed(bag)
    idx = torch.stack([torch.randint(0, n, (batch, bag), generator=g) for n in SIZES], 1)
    psw = torch.rand(batch, len(SIZES), bag, generator=g) if weighted else None
    offsets = torch.tensor([0, SIZES[0], SIZES[0] + SIZES[1]])
    cat = torch.cat(tables)
    scale = bias = None
    if dtype == "int8":
        cat, scale, bias = E.quantize_rows(cat)
        deq = cat.float() * scale[:, None] + bias[:, None]
        tables = list(deq.split(list(SIZES)))
    elif dtype == "float16":
        cat = cat.half()
        tables = [t.half().float() for t in tables]
    return tables, cat, offsets, idx, psw, scale, bias


def _case(batch, bag, dim, mean, weighted, dtype):
    tables, cat, offsets, idx, psw, scale, bias = _inputs(batch, bag, dim, mean, weighted, dtype)
    dev = rc.DEVICE
    out = E.batched_embedding_bag(
        cat.to(dev), offsets.to(dev), idx.to(dev), None if psw is None else psw.to(dev), mean,
        None if scale is None else scale.to(dev), None if bias is None else bias.to(dev),
        torch.float32 if dtype != "float32" else None,
    ).cpu()  # fmt: skip
    want = _loop(tables, idx, psw, mean)
    return {"shape": list(out.shape), "dtype": str(out.dtype), "rel": rc.rel(out, want)}


@pytest.fixture(scope="module")
def interpreted():
    return rc.run_child(__file__)


@pytest.mark.parametrize("case", CASES, ids=_key)
def test_kernel_matches_the_loop_over_tables(interpreted, case):
    r = interpreted[_key(case)]
    assert r["shape"] == [case[0], 3, case[2]] and r["dtype"] == "torch.float32", r
    assert r["rel"] <= 1e-6, r  # dequantized exactly as the loop's tables: float32 sums


@pytest.mark.parametrize("case", CASES, ids=_key)
def test_cpu_reference_matches_the_loop(case):
    r = _case(*case)
    assert r["shape"] == [case[0], 3, case[2]] and r["rel"] <= 1e-6, r


def test_empty_bags_pool_to_zero_and_bad_input_is_one_sentence():
    tables, cat, off, idx, _, _, _ = _inputs(2, 3, 4, True, False, "float32")
    out = E.batched_embedding_bag(cat, off, idx[:, :, :0], None, True, None, None, None)
    assert out.shape == (2, 3, 4) and not out.any()
    with pytest.raises(E.KernelError, match="one offset per table"):
        E.batched_embedding_bag(cat, off[:2], idx, None, True, None, None, None)
    with pytest.raises(E.KernelError, match="scale and bias"):
        E.batched_embedding_bag(cat.to(torch.int8), off, idx, None, True, None, None, None)
    with pytest.raises(E.KernelError, match="do not match"):
        E.batched_embedding_bag(cat, off, idx, torch.rand(2, 3), False, None, None, None)


def test_quantize_rows_errs_half_a_step_and_quarters_the_bytes():
    w = torch.randn(50, 16) * 3
    q, s, b = E.quantize_rows(w)
    back = q.float() * s[:, None] + b[:, None]
    assert q.dtype == torch.int8 and ((back - w).abs() <= s[:, None] / 2 + 1e-6).all()
    assert q.numel() * q.element_size() * 4 == w.numel() * w.element_size()


def test_opcheck_and_export_keep_the_op():
    _, cat, off, idx, psw, _, _ = _inputs(3, 4, 6, True, True, "float32")
    torch.library.opcheck(E.batched_embedding_bag, (cat, off, idx, psw, True, None, None, None))

    class Bags(torch.nn.Module):
        def forward(self, i):
            return E.batched_embedding_bag(cat, off, i, None, False, None, None, None)

    ep = torch.export.export(Bags(), (idx,))
    assert torch.ops.opswap.batched_embedding_bag.default in {n.target for n in ep.graph.nodes}


if __name__ == "__main__":  # the interpreter's half of `interpreted`
    print(json.dumps({_key(c): _case(*c) for c in CASES}))
