"""opswap::linear_cross_entropy against float32 `F.cross_entropy(F.linear(h, W, b), ...)`
(softcap as cap * tanh(logits / cap)): the loss and every gradient, at odd shapes, with
ignored targets (some, all), label smoothing, each reduction, chunks smaller than the
batch; eager and under torch.compile(fullgraph=True); fp32 and bf16 inputs; the PyTorch
path here and the Triton kernel in a child Python under TRITON_INTERPRET=1."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import _rows_check as rc  # noqa: E402

from opswap.kernels import linear_cross_entropy as L  # noqa: E402

#: (N, H, V): one row, rows that cross 4-row chunks, vocabularies smaller than, around and
#: past a kernel block
SHAPES = [(1, 8, 5), (7, 24, 129), (33, 8, 1000), (33, 24, 129), (7, 8, 1000)]
#: bf16 inputs against the float32 reference: logits and dlogits are rounded to bf16
#: (as eager bf16 rounds them), so a relative error of a few bf16 units
BF16_REL = 2.0**-6


def reference(h, w, b, t, ignore_index, smoothing, reduction, cap):
    x = F.linear(h.float(), w.float(), None if b is None else b.float())
    if cap is not None:
        x = cap * torch.tanh(x / cap)
    return F.cross_entropy(
        x, t, ignore_index=ignore_index, label_smoothing=smoothing, reduction=reduction
    )


def _inputs(n, h, v, dtype, bias, ignored, seed=0):
    g = torch.Generator().manual_seed(seed + n * 131 + h * 7 + v)
    hid = torch.randn(n, h, generator=g).to(dtype)
    w = (torch.randn(v, h, generator=g) / h**0.5 * 3).to(dtype)
    b = torch.randn(v, generator=g).to(dtype) if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    if ignored == "some":
        t[::3] = -100
    elif ignored == "all":
        t[:] = -100
    dev = rc.DEVICE  # the GPU in a child on a CUDA machine, else the CPU
    return hid.to(dev), w.to(dev), None if b is None else b.to(dev), t.to(dev)


def _loss(fn, hid, w, b, t, reduction, smoothing, cap):
    return fn(hid, w, t, b, -100, smoothing, reduction, cap)


def _op(hid, w, t, b, ii, smoothing, reduction, cap):
    return L.linear_cross_entropy(hid, w, t, b, ii, smoothing, reduction, cap, True)[0]


def compare(n, h, v, dtype, bias, ignored, reduction, smoothing, cap, fn=_op, rows=4):
    """Relative errors of (loss, dh, dW, db) against the float32 reference, the gradients
    for a random incoming gradient."""
    hid, w, b, t = _inputs(n, h, v, dtype, bias, ignored)
    leaves = [x.requires_grad_() for x in (hid, w, b) if x is not None]
    with L.chunk_rows_set(rows):
        loss = _loss(fn, hid, w, b, t, reduction, smoothing, cap)
        dy = torch.randn(loss.shape, generator=torch.Generator().manual_seed(1)).to(loss.device)
        got = torch.autograd.grad(loss, leaves, dy)
    ref_leaves = [x.detach().float().requires_grad_() for x in leaves]
    rh, rw = ref_leaves[:2]
    rb = ref_leaves[2] if bias else None
    want = reference(rh, rw, rb, t, -100, smoothing, reduction, cap)
    if bool((t == -100).all()) and reduction == "mean":
        assert float(loss.detach()) == 0.0
        assert all(int(torch.count_nonzero(x)) == 0 for x in got)
        return {"loss": 0.0, "grads": [0.0] * len(got), "dtypes_ok": True}
    wgrads = torch.autograd.grad(want, ref_leaves, dy)
    return {
        "loss": _rel(loss, want),
        "grads": [_rel(a, e) for a, e in zip(got, wgrads, strict=True)],
        "dtypes_ok": loss.dtype == torch.float32
        and all(a.dtype == x.dtype for a, x in zip(got, leaves, strict=True)),
    }


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    den = b.norm()
    return float((a - b).norm() / den) if den > 0 else float((a - b).norm())


def _ok(r, dtype):
    tol = 1e-5 if dtype == torch.float32 else BF16_REL
    return r["dtypes_ok"] and r["loss"] <= tol and all(e <= tol for e in r["grads"])


# the cases the interpreter child runs too
CASES = [
    (shape, dtype, bias, ignored, reduction, smoothing, cap)
    for shape, bias, ignored, reduction, smoothing, cap in [
        (SHAPES[0], False, "none", "mean", 0.0, None),
        (SHAPES[1], True, "some", "mean", 0.1, None),
        (SHAPES[2], False, "some", "sum", 0.0, 5.0),
        (SHAPES[3], True, "some", "none", 0.2, 3.0),
        (SHAPES[4], True, "none", "mean", 0.0, 3.0),
        (SHAPES[1], False, "all", "mean", 0.1, None),
        (SHAPES[2], True, "all", "sum", 0.0, 5.0),
        (SHAPES[4], False, "all", "none", 0.1, None),
    ]
    for dtype in (torch.float32, torch.bfloat16)
]


def _key(c):
    return str([list(c[0]), str(c[1]), *c[2:]])


@pytest.mark.parametrize("case", CASES, ids=_key)
def test_pytorch_path_matches_float32_cross_entropy(case):
    shape, dtype, *rest = case
    r = compare(*shape, dtype, *rest)
    assert _ok(r, dtype), r


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("reduction", L.REDUCTIONS)
def test_every_shape_and_reduction_in_one_chunk_and_in_many(shape, reduction):
    for rows in (1, 3, 64):
        r = compare(*shape, torch.float32, True, "some", reduction, 0.05, 4.0, rows=rows)
        assert _ok(r, torch.float32), (rows, r)


def test_all_ignored_gives_zero_loss_and_zero_gradients_not_nan():
    hid, w, b, t = _inputs(7, 8, 129, torch.float32, True, "all")
    leaves = [x.requires_grad_() for x in (hid, w, b)]
    for reduction in L.REDUCTIONS:
        loss = L.linear_cross_entropy(hid, w, t, b, -100, 0.1, reduction, None, True)[0]
        grads = torch.autograd.grad(loss.sum(), leaves)
        assert torch.count_nonzero(loss) == 0 and not loss.isnan().any()
        assert all(torch.count_nonzero(g) == 0 for g in grads)
    # the peer's failure: PyTorch's own mean over no targets is NaN
    assert reference(hid, w, b, t, -100, 0.0, "mean", None).isnan()


def test_another_ignore_index_and_a_gradient_recomputed_when_the_forward_kept_none():
    hid, w, b, t = _inputs(9, 8, 17, torch.float32, False, "none")
    t[2] = 3
    hid.requires_grad_()
    w.requires_grad_()
    # with_grad=False: the backward recomputes the logits (the route of reduction="none")
    loss = L.linear_cross_entropy(hid, w, t, None, 3, 0.0, "mean", None, False)[0]
    got = torch.autograd.grad(loss * 2.5, [hid, w])
    want = torch.autograd.grad(reference(hid, w, None, t, 3, 0.0, "mean", None) * 2.5, [hid, w])
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


def test_a_retained_graph_gives_the_same_gradients_twice():
    hid, w, b, t = _inputs(7, 8, 129, torch.float32, True, "some")
    hid.requires_grad_()
    loss = L.linear_cross_entropy(hid, w, t, b, -100, 0.0, "sum", None, True)[0]
    (g1,) = torch.autograd.grad(loss * 3.0, [hid], retain_graph=True)
    (g2,) = torch.autograd.grad(loss * 3.0, [hid])
    torch.testing.assert_close(g1, g2)
    want = torch.autograd.grad(reference(hid, w, b, t, -100, 0.0, "sum", None) * 3.0, [hid])[0]
    torch.testing.assert_close(g1, want, rtol=1e-5, atol=1e-6)


def test_a_bad_reduction_is_refused_in_one_sentence():
    hid, w, _, t = _inputs(3, 8, 5, torch.float32, False, "none")
    with pytest.raises(ValueError, match="reduction must be one of mean, sum, none, not 'avg'"):
        L.linear_cross_entropy(hid, w, t, None, -100, 0.0, "avg", None, True)


def test_chunks_hold_at_most_chunk_elements_logits():
    assert L.chunk_rows(8192, 128256) == 256
    assert L.chunk_rows(7, 5) == 7
    assert L.chunk_rows(100000, 1 << 26) == 1
    assert L.chunk_rows(8192, 32000, cuda=False) == 128
    with L.chunk_rows_set(3):
        assert L.chunk_rows(7, 5) == 3


def test_opcheck_both_ops():
    hid, w, b, t = _inputs(7, 8, 129, torch.float32, True, "some")
    hid.requires_grad_()
    w.requires_grad_()
    for reduction in L.REDUCTIONS:
        args = (hid, w, t, b, -100, 0.1, reduction, 3.0, True)
        torch.library.opcheck(torch.ops.opswap.linear_cross_entropy.default, args)
        lse = L.linear_cross_entropy(*args)[1].detach()
        g = torch.ones(7) if reduction == "none" else torch.tensor(1.5)
        bargs = (g, hid.detach(), w.detach(), t, b, lse, -100, 0.1, reduction, 3.0)
        torch.library.opcheck(torch.ops.opswap.linear_cross_entropy_backward.default, bargs)


# ----------------------------------------------------------------------------- compile

COMPILE_CASES = [
    ((7, 24, 129), torch.float32, True, "some", "mean", 0.1, None),
    ((33, 8, 1000), torch.float32, False, "some", "none", 0.0, 5.0),
    ((7, 8, 129), torch.bfloat16, True, "some", "sum", 0.0, None),
]


def _compiled():
    torch._dynamo.reset()

    def fn(hid, w, t, b, ii, smoothing, reduction, cap):
        return _op(hid, w, t, b, ii, smoothing, reduction, cap) * 1.0

    return torch.compile(fn, fullgraph=True)


@pytest.mark.parametrize("case", COMPILE_CASES, ids=_key)
def test_under_torch_compile_fullgraph_loss_and_gradients_are_exact(case):
    """The loss under compile with ignored targets is the reference's (a known peer's was
    not), and so is every gradient."""
    shape, dtype, *rest = case
    r = compare(*shape, dtype, *rest, fn=_compiled())
    assert _ok(r, dtype), r


# ----------------------------------------------------------------------------- Triton


@pytest.fixture(scope="module")
def interpreted():
    return rc.run_child(__file__)


@pytest.mark.parametrize("case", CASES, ids=_key)
def test_triton_kernel_in_the_interpreter_matches_float32_cross_entropy(interpreted, case):
    r = interpreted["cases"][_key(case)]
    assert _ok(r, case[1]), r


def test_the_interpreter_ran_the_triton_kernel_and_compiled_it_too(interpreted):
    assert interpreted["triton"] == 1
    r = interpreted["compiled"]
    assert _ok(r, torch.float32), r


def _child() -> dict:
    from opswap.kernels import _lce_chunk
    from opswap.kernels._rows import runs_triton

    calls = []
    real = _lce_chunk.triton_chunk

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    L.triton_chunk = counted  # the module's own name for it
    cases = {_key(c): compare(*c[0], *c[1:]) for c in CASES}
    ran = int(bool(calls) and runs_triton(torch.ones(1, device=rc.DEVICE)))
    compiled = compare(*COMPILE_CASES[0][0], *COMPILE_CASES[0][1:], fn=_compiled())
    return {"cases": cases, "triton": ran, "compiled": compiled}


if __name__ == "__main__":
    print(json.dumps(_child()))


# ----------------------------------------------------------------------------- public API


def test_public_api_takes_batch_and_sequence_dims_and_the_module_shares_the_head():
    from opswap.train.losses import LinearCrossEntropy, linear_cross_entropy

    torch.manual_seed(3)
    head = torch.nn.Linear(12, 37)
    h = torch.randn(2, 5, 12, requires_grad=True)
    t = torch.randint(0, 37, (2, 5))
    t[0, :2] = -100
    loss = LinearCrossEntropy(head, label_smoothing=0.1, softcap=6.0)(h, t)
    loss.backward()
    ref_head = torch.nn.Linear(12, 37)
    ref_head.load_state_dict(head.state_dict())
    hr = h.detach().clone().requires_grad_()
    x = ref_head(hr)
    want = F.cross_entropy(
        (6.0 * torch.tanh(x / 6.0)).flatten(0, 1), t.flatten(), label_smoothing=0.1
    )
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad, hr.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head.weight.grad, ref_head.weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head.bias.grad, ref_head.bias.grad, rtol=1e-5, atol=1e-6)
    rows = linear_cross_entropy(h, head.weight, t, head.bias, reduction="none")
    assert rows.shape == (2, 5) and float(rows[0, 0].detach()) == 0.0
    with torch.no_grad():  # no gradient wanted: the forward computes none
        torch.testing.assert_close(
            linear_cross_entropy(h, head.weight, t, head.bias),
            F.cross_entropy(ref_head(h).flatten(0, 1), t.flatten()),
        )


@pytest.mark.parametrize(
    "change, message",
    [
        ({"weight": torch.randn(9, 7)}, r"weight must be \[vocab, 8\] to match"),
        ({"target": torch.randint(0, 9, (4,))}, r"target \[4\] must have hidden's leading dims"),
        ({"target": torch.tensor([0, 1, 9, 2, 3])}, "target holds class 9, outside"),
        ({"target": torch.tensor([0, -1, 2, 2, 3])}, "target holds class -1, outside"),
        ({"target": torch.zeros(5)}, "target must hold class indices"),
        ({"reduction": "avg"}, "reduction must be one of mean, sum, none, not 'avg'"),
        ({"bias": torch.randn(8)}, r"bias must be \[9\]"),
        ({"weight": torch.randn(9, 8, dtype=torch.float64)}, "cast them to one dtype"),
        ({"label_smoothing": 1.5}, r"label_smoothing must be in \[0, 1\]"),
        ({"softcap": 0.0}, "softcap must be a positive number"),
        ({"hidden": torch.arange(40).reshape(5, 8)}, "hidden must be a floating-point"),
    ],
)
def test_public_api_refuses_bad_input_in_one_sentence(change, message):
    from opswap.train.losses import LossError, linear_cross_entropy

    args = {
        "hidden": torch.randn(5, 8),
        "weight": torch.randn(9, 8),
        "target": torch.tensor([0, 1, -100, 2, 8]),
        "bias": None,
    }
    kwargs = {k: change.pop(k) for k in ("reduction", "label_smoothing", "softcap") if k in change}
    args.update(change)
    with pytest.raises(LossError, match=message) as e:
        linear_cross_entropy(**args, **kwargs)
    assert str(e.value).count(". ") == 0 and "\n" not in str(e.value)
