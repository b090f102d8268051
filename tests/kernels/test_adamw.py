"""opswap::adamw and opswap.train.optim.AdamW: n steps on a small model take the same
parameters as torch.optim.AdamW (fp32: the foreach path here, the Triton kernel in a child
Python under TRITON_INTERPRET=1 with work items smaller than the tensors), with weight
decay, amsgrad, maximize, two param groups and a parameter without a gradient on some
steps; bf16 params with float32 states against torch's steps on a float32 copy; the
state_dict round trip; errors in one sentence."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _rows_check as rc  # noqa: E402

from opswap.kernels import adamw as A  # noqa: E402
from opswap.train.optim import AdamW, OptimizerError  # noqa: E402

#: (weight_decay, amsgrad, maximize)
SETTINGS = [(0.0, False, False), (0.1, False, False), (0.05, True, False), (0.01, False, True)]


def _model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(
        torch.nn.Linear(13, 33), torch.nn.GELU(), torch.nn.Linear(33, 7), torch.nn.LayerNorm(7)
    )
    return m.to(rc.DEVICE, dtype)  # the GPU in a child on a CUDA machine, else the CPU


def _groups(model, lr):
    ps = list(model.parameters())
    return [{"params": ps[:2]}, {"params": ps[2:], "lr": lr * 0.5}]


def _train(model, opt, steps, seed=1, master=None):
    g = torch.Generator().manual_seed(seed)
    for i in range(steps):
        x = torch.randn(5, 13, generator=g).to(rc.DEVICE, next(model.parameters()).dtype)
        src = master if master is not None else model
        loss = src(x.float() if master is not None else x).square().mean()
        opt.zero_grad()
        loss.backward()
        if master is not None:  # the bf16 model takes the fp32 master's gradients
            for p, q in zip(model.parameters(), master.parameters(), strict=True):
                p.grad = q.grad.to(p.dtype)
        if i % 2 == 1:  # the last weight has no gradient on odd steps
            list(model.parameters())[2].grad = None
            if master is not None:
                list(master.parameters())[2].grad = None
        yield


def run_pair(wd, amsgrad, maximize, steps=6, lr=1e-2):
    """The largest difference of any parameter after `steps` between opswap's AdamW and
    torch's (foreach), from the same start and given the same gradients each step (so that
    rounding differences do not change the trajectory)."""
    a, b = _model(), _model()
    kw = {"weight_decay": wd, "amsgrad": amsgrad, "maximize": maximize, "betas": (0.8, 0.95)}
    oa = AdamW(_groups(a, lr), lr=lr, **kw)
    ob = torch.optim.AdamW(_groups(b, lr), lr=lr, foreach=True, **kw)
    for _ in _train(a, oa, steps):
        for p, q in zip(a.parameters(), b.parameters(), strict=True):
            q.grad = None if p.grad is None else p.grad.clone()
        oa.step()
        ob.step()
    a.requires_grad_(False)
    b.requires_grad_(False)
    start = _model().requires_grad_(False)
    moved = max(
        float((p - q).abs().max()) for p, q in zip(a.parameters(), start.parameters(), strict=True)
    )
    diff = max(
        float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )
    return {"diff": diff, "moved": moved}


@pytest.mark.parametrize("setting", SETTINGS)
def test_foreach_path_takes_torch_adamw_steps(setting):
    r = run_pair(*setting)
    assert r["moved"] > 1e-3  # the steps did something
    assert r["diff"] <= 1e-6, r


def test_bf16_params_keep_float32_states_and_follow_an_fp32_run():
    bf, master = _model(torch.bfloat16), _model()
    ob = AdamW(bf.parameters(), lr=1e-2, weight_decay=0.1)
    om = torch.optim.AdamW(master.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    for _ in _train(bf, ob, 5, master=master):
        ob.step()
        om.step()
        with torch.no_grad():  # the master keeps the bf16 model's rounding, as mixed
            for p, q in zip(bf.parameters(), master.parameters(), strict=True):
                q.copy_(p.float())
    st = ob.state[next(bf.parameters())]
    assert st["exp_avg"].dtype == torch.float32 and st["exp_avg_sq"].dtype == torch.float32
    for p, q in zip(bf.parameters(), master.parameters(), strict=True):
        assert p.dtype == torch.bfloat16
        torch.testing.assert_close(
            p.detach().float(), q.detach(), rtol=0, atol=2.0**-7 * float(q.detach().abs().max())
        )


def test_state_dict_round_trip_continues_the_same_run():
    for dtype in (torch.float32, torch.bfloat16):
        a = _model(dtype)
        oa = AdamW(_groups(a, 1e-2), lr=1e-2, amsgrad=True)
        for _ in _train(a, oa, 3):
            oa.step()
        sd = copy.deepcopy(oa.state_dict())
        assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
        b = copy.deepcopy(a)
        ob = AdamW(_groups(b, 1e-2), lr=1e-2, amsgrad=True)
        ob.load_state_dict(sd)
        assert ob.state[next(b.parameters())]["exp_avg"].dtype == torch.float32
        for _ in zip(_train(a, oa, 3, seed=5), _train(b, ob, 3, seed=5), strict=True):
            oa.step()
            ob.step()
        for p, q in zip(a.parameters(), b.parameters(), strict=True):
            assert torch.equal(p, q)
        assert float(ob.state[next(b.parameters())]["step"]) == 6.0


def test_torch_adamw_state_dict_loads():
    a, b = _model(), _model()
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2, foreach=True)
    for _ in _train(b, ob, 2):
        ob.step()
    oa = AdamW(a.parameters(), lr=1e-2)
    oa.load_state_dict(ob.state_dict())
    a.load_state_dict(b.state_dict())
    for _ in zip(_train(a, oa, 2, seed=9), _train(b, ob, 2, seed=9), strict=True):
        oa.step()
        ob.step()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"lr": -1.0}, "lr must be a non-negative float"),
        ({"betas": (0.9, 1.0)}, r"betas must be two numbers in \[0, 1\)"),
        ({"eps": -1e-8}, "eps must be non-negative"),
        ({"weight_decay": -0.1}, "weight_decay must be non-negative"),
    ],
)
def test_bad_settings_are_refused_in_one_sentence(kwargs, message):
    with pytest.raises(OptimizerError, match=message):
        AdamW(_model().parameters(), **kwargs)


def test_a_sparse_gradient_is_refused_in_one_sentence():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(OptimizerError, match="does not take sparse gradients"):
        AdamW(emb.parameters()).step()


def test_the_op_checks_its_lists():
    p = torch.randn(3)
    with pytest.raises(ValueError, match="one grad, exp_avg, exp_avg_sq, step"):
        A.adamw([p], [p.clone()], [], [], [], [1.0], 1e-3, 0.9, 0.999, 0.0, 1e-8, False)


# ----------------------------------------------------------------------------- Triton


@pytest.fixture(scope="module")
def interpreted():
    return rc.run_child(__file__)


@pytest.mark.parametrize("setting", SETTINGS)
def test_triton_kernel_in_the_interpreter_takes_torch_adamw_steps(interpreted, setting):
    r = interpreted[str(list(setting))]
    assert r["triton"] and r["moved"] > 1e-3
    assert r["diff"] <= 2e-6, r


def test_triton_kernel_on_unaligned_views(interpreted):
    assert interpreted["unaligned"] <= 2e-6


def _child() -> dict:
    A.CHUNK = 128  # work items smaller than the tensors: items cross each tensor
    A.BLOCK = 32
    calls = []
    real = A.triton_step

    def counted(*a, **k):
        calls.append(len(a[0].params))
        return real(*a, **k)

    A.triton_step = counted
    out = {}
    for s in SETTINGS:
        calls.clear()
        r = run_pair(*s)
        out[str(list(s))] = {**r, "triton": bool(calls) and sum(calls) > 0}
    out["unaligned"] = _unaligned()
    return out


def _unaligned() -> float:
    """Params, grads and states that are views one element into their buffers (addresses
    not multiples of 16 bytes: the kernel runs without its alignment hints): the largest
    difference from the foreach step after three steps."""
    res = []

    def foreach(*a):
        return A.foreach_step(A.Tensors(*a[:6]), A.Hyper(*a[6:]))

    for step in (A.adamw, foreach):
        g = torch.Generator().manual_seed(4)
        bufs = [torch.randn(301, generator=torch.Generator().manual_seed(i)) for i in range(4)]
        p, gr, m, v = (b.to(rc.DEVICE)[1:] for b in bufs)
        m.zero_()
        v.zero_()
        for t in (1.0, 2.0, 3.0):
            gr.copy_(torch.randn(300, generator=g).to(rc.DEVICE))
            step([p], [gr], [m], [v], [], [t], 1e-2, 0.9, 0.99, 0.1, 1e-8, False)
        res.append(p.clone())
    return float((res[0] - res[1]).abs().max())


if __name__ == "__main__":
    print(json.dumps(_child()))
