"""opswap::topk: the three Triton paths (register sort, tile merge, radix select; under
TRITON_INTERPRET=1 in one child Python, or on the GPU) against torch.topk at odd shapes
(n 1, 7, 1000, 4097; k 1, 3, 100, n) in float32, float16 and bfloat16, largest and
smallest, on rows with ties, NaN and -inf: values identical, every index valid
(x[idx] == value), equal values in column order; the CPU op, opcheck and torch.export;
opswap::approx_topk's recall on random rows and its bucket choice."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _rows_check as rc  # noqa: E402

from opswap.kernels import topk as T  # noqa: E402

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# (rows, n, k, dtype, largest): each path, both orders, every dtype somewhere; the
# interpreter sorts slowly, so the register and tile paths take few cases
CASES = [
    (2, 1, 1, F32, True),
    (3, 7, 1, BF16, True),
    (3, 7, 3, F16, False),
    (3, 7, 7, F32, False),
    (2, 1000, 3, F32, True),
    (2, 4097, 1, BF16, True),
    (2, 4097, 3, F32, False),
    (3, 4097, 100, F32, True),
    (3, 4097, 100, BF16, False),
    (3, 4097, 4097, F16, True),
    (2, 9000, 1000, F32, False),
]


def _key(c):
    return str([c[0], c[1], c[2], str(c[3]), c[4]])


def _row(rows, n, dtype, seed):
    """Random values with ties (a repeated value), a NaN and -inf where the row is long."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g)
    if n > 6:
        x[0, 2] = float("nan")
        x[-1, :4] = float("-inf")
        x[rows // 2, 1:6] = x[rows // 2, 0]
    return x.to(dtype)


def _case(rows, n, k, dtype, largest):
    x = _row(rows, n, dtype, n + k).to(rc.DEVICE)
    v, i = T.topk(x, k, largest, True)
    rv, _ = torch.topk(x, k, largest=largest)
    nan = v.isnan()
    back = x.gather(-1, i)
    ties_in_order = True
    for r in range(rows):
        for j in range(k - 1):
            if v[r, j] == v[r, j + 1] and i[r, j] > i[r, j + 1]:
                ties_in_order = False
    return {
        "path": T.path(n, k),
        "shape": list(v.shape),
        "dtypes": [str(v.dtype), str(i.dtype)],
        "values": bool(torch.equal(v.nan_to_num(0.5), rv.nan_to_num(0.5)))
        and bool(torch.equal(nan, rv.isnan())),
        "indices_valid": bool(torch.equal(back.nan_to_num(0.5), v.nan_to_num(0.5)))
        and bool(torch.equal(back.isnan(), nan)),
        "distinct": all(len(set(i[r].tolist())) == k for r in range(rows)),
        "ties_in_order": ties_in_order,
    }


@pytest.fixture(scope="module")
def interpreted():
    return rc.run_child(__file__)


def test_the_cases_take_every_path():
    assert {T.path(c[1], c[2]) for c in CASES} == {"register", "tiles", "radix"}


@pytest.mark.parametrize("case", CASES, ids=_key)
def test_kernel_matches_torch_topk(interpreted, case):
    rows, n, k, dtype, _ = case
    r = interpreted[_key(case)]
    assert r["shape"] == [rows, k] and r["dtypes"] == [str(dtype), "torch.int64"], r
    assert r["values"] and r["indices_valid"] and r["distinct"] and r["ties_in_order"], r


def test_cpu_op_is_torch_topk_and_bad_k_is_one_sentence():
    x = torch.randn(4, 3, 50)
    v, i = T.topk(x, 5, False, True)
    rv, ri = torch.topk(x, 5, largest=False)
    assert torch.equal(v, rv) and torch.equal(i, ri) and v.is_contiguous()
    with pytest.raises(T.KernelError, match="out of range"):
        T.topk(x, 51, True, True)
    with pytest.raises(T.KernelError, match="not a scalar"):
        T.topk(torch.tensor(1.0), 1, True, True)


def test_opcheck_and_export_keep_the_op():
    x = torch.randn(3, 5, 40)
    torch.library.opcheck(T.topk, (x, 4, True, True))
    torch.library.opcheck(T.approx_topk, (torch.randn(3, 64), 4, True, 4, 3))

    class Head(torch.nn.Module):
        def forward(self, a):
            return T.topk(a, 3, True, True)[0] + 1

    ep = torch.export.export(Head(), (x,))
    assert torch.ops.opswap.topk.default in {n.target for n in ep.graph.nodes}


@pytest.mark.parametrize(("n", "k"), [(4096, 16), (1000, 10), (32768, 64)])
def test_approx_topk_holds_its_recall_on_random_rows(n, k):
    b, kp = T.buckets_for(n, k)
    assert b > 1 and kp * b >= k and n % b == 0
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(64, n, generator=g)
    v, i = T.approx_topk(x, k, True, b, kp)
    _, ri = torch.topk(x, k)
    hits = sum(len(set(a.tolist()) & set(c.tolist())) for a, c in zip(i, ri, strict=True))
    recall = hits / (64 * k)
    assert recall >= T.RECALL - 0.02, (b, kp, recall)  # 64 rows: sampling slack
    assert torch.equal(x.gather(-1, i), v)  # the values are x's, sorted
    assert torch.all(v[:, :-1] >= v[:, 1:])
    with pytest.raises(T.KernelError, match="cannot hold"):
        T.approx_topk(x, k, True, 1, k - 1)
    ev, ei = T.approx_topk(x[:, 1:], k, True, b, kp)  # n - 1: not divisible, exact
    assert torch.equal(ev, torch.topk(x[:, 1:], k)[0])


if __name__ == "__main__":  # the interpreter's half of `interpreted`
    print(json.dumps({_key(c): _case(*c) for c in CASES}))
