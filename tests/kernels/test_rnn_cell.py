"""opswap::lstm_seq and opswap::gru_seq: the Triton kernel (under TRITON_INTERPRET=1 in one
child Python) against nn.LSTM / nn.GRU and a float64 run of the reference at odd shapes
(hidden 7, 33, 64; T 1 and 9; batch 1 and 5; both layouts; W_hh resident in registers or
streamed), fp32 and bf16; the CPU op, opcheck, torch.export and the errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import _rows_check as rc  # noqa: E402

from opswap.kernels import rnn_cell as R  # noqa: E402
from opswap.kernels._rows import KernelError  # noqa: E402

CASES = [
    (kind, hidden, steps, batch, batch_first, resident, "float32")
    for kind in ("lstm", "gru")
    for hidden in (7, 33, 64)
    for steps, batch, batch_first in ((1, 5, True), (9, 1, False), (9, 5, True))
    for resident in ((True, False) if hidden == 33 else (True,))
] + [
    ("lstm", 33, 9, 5, True, True, "bfloat16"),
    ("gru", 64, 9, 3, False, False, "bfloat16"),
]


def _key(c) -> str:
    return json.dumps(list(c))


def module(kind: str, features: int, hidden: int, batch_first: bool, seed: int) -> nn.RNNBase:
    torch.manual_seed(seed)
    cls = nn.LSTM if kind == "lstm" else nn.GRU
    return cls(features, hidden, batch_first=batch_first).eval()


def _weights(mod: nn.RNNBase) -> list[torch.Tensor]:
    return [mod.weight_ih_l0, mod.weight_hh_l0, mod.bias_ih_l0, mod.bias_hh_l0]


def _case(kind, hidden, steps, batch, batch_first, resident, dtype_name):
    dtype = getattr(torch, dtype_name)
    features = 6
    mod = module(kind, features, hidden, batch_first, seed=hidden + steps + batch)
    shape = (batch, steps, features) if batch_first else (steps, batch, features)
    x, h0, c0 = torch.randn(shape), torch.randn(batch, hidden), torch.randn(batch, hidden)
    lstm = kind == "lstm"
    w = [t.detach() for t in _weights(mod)]
    dev = rc.DEVICE  # the CPU under the interpreter, or the GPU (compiled kernels)
    with torch.no_grad():
        got = R.triton_forward(
            kind,
            x.to(dev, dtype),
            h0.to(dev, dtype),
            c0.to(dev, dtype) if lstm else None,
            *[t.to(dev, dtype) for t in w],
            batch_first,
            resident=resident,
        )
        got = tuple(t.cpu() if t is not None else None for t in got)
        truth = R.reference(
            kind,
            x.double(),
            h0.double(),
            c0.double() if lstm else None,
            *[t.double() for t in w],
            batch_first,
        )
        own = R.reference(
            kind,
            x.to(dtype),
            h0.to(dtype),
            c0.to(dtype) if lstm else None,
            *[t.to(dtype) for t in w],
            batch_first,
        )
        ref_out, state = mod(x, (h0[None], c0[None]) if lstm else h0[None])
    return {
        "shape": list(got[0].shape),
        "dtype": str(got[0].dtype),
        "out": rc.rel(got[0], truth[0]),
        "h": rc.rel(got[1], truth[1]),
        "c": rc.rel(got[2], truth[2]) if lstm else 0.0,
        "out_torch": rc.rel(own[0], truth[0]),
        "vs_module": float((got[0].float() - ref_out).abs().max()),
    }


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton")
    return rc.run_child(__file__)


@pytest.mark.parametrize("case", CASES, ids=_key)
def test_kernel_in_the_interpreter_matches_the_module_and_float64(interpreted, case):
    kind, hidden, steps, batch, batch_first, _, dtype_name = case
    r = interpreted[_key(case)]
    want = [batch, steps, hidden] if batch_first else [steps, batch, hidden]
    assert r["shape"] == want and r["dtype"] == f"torch.{dtype_name}"
    bound = rc.bound(getattr(torch, dtype_name), r["out_torch"])
    assert r["out"] <= bound and r["h"] <= bound and r["c"] <= bound, r
    if dtype_name == "float32":
        assert r["vs_module"] <= 2e-6, r  # nn.LSTM / nn.GRU itself, to float32 rounding


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_cpu_op_matches_the_module_and_exports(kind):
    mod = module(kind, 5, 11, True, seed=3)
    x, h0, c0 = torch.randn(3, 7, 5), torch.randn(3, 11), torch.randn(3, 11)
    w = _weights(mod)
    with torch.no_grad():
        if kind == "lstm":
            out, h, c = torch.ops.opswap.lstm_seq(x, h0, c0, *w, True)
            ref, (rh, rc_) = mod(x, (h0[None], c0[None]))
            assert torch.allclose(c, rc_[0], atol=1e-6)
        else:
            out, h = torch.ops.opswap.gru_seq(x, h0, *w, True)
            ref, rh = mod(x, h0[None])
    assert torch.allclose(out, ref, atol=1e-6) and torch.allclose(h, rh[0], atol=1e-6)
    op = torch.ops.opswap.lstm_seq.default if kind == "lstm" else torch.ops.opswap.gru_seq.default
    args = (x, h0, c0, *w, True) if kind == "lstm" else (x, h0, *w, True)
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))

    class M(nn.Module):
        def forward(self, x: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
            return op(x, h0, *(args[2:]))[0]

    ep = torch.export.export(M(), (x, h0))
    assert any(n.target is op for n in ep.graph.nodes)


def test_no_bias_and_an_empty_sequence():
    mod = nn.LSTM(4, 6, bias=False)
    x, h0, c0 = torch.randn(0, 2, 4), torch.randn(2, 6), torch.randn(2, 6)
    out, h, c = torch.ops.opswap.lstm_seq(
        x, h0, c0, mod.weight_ih_l0, mod.weight_hh_l0, None, None, False
    )
    assert out.shape == (0, 2, 6) and torch.equal(h, h0) and torch.equal(c, c0)


def test_wrong_shapes_are_refused_in_one_sentence():
    w_ih, w_hh = torch.randn(12, 4), torch.randn(12, 3)
    with pytest.raises(KernelError, match="W_hh"):
        torch.ops.opswap.gru_seq(
            torch.randn(2, 5, 4), torch.randn(2, 3), w_ih, torch.randn(9, 4), None, None, True
        )
    with pytest.raises(KernelError, match="the initial state is \\[3, 3\\]"):
        torch.ops.opswap.gru_seq(
            torch.randn(2, 5, 4), torch.randn(3, 3), w_ih[:9], w_hh[:9], None, None, True
        )
    with pytest.raises(KernelError, match="expected \\[12, 5\\]"):
        torch.ops.opswap.lstm_seq(
            torch.randn(2, 5, 5), torch.randn(2, 3), torch.randn(2, 3), w_ih, w_hh, None, None, True
        )


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("hidden,batch", [(256, 1), (1024, 64), (200, 37)])
def test_gpu_kernel_with_split_hidden_blocks_matches_the_module(kind, hidden, batch):
    """Large hidden sizes: several programs per batch tile meet at a barrier each step."""
    mod = module(kind, 48, hidden, True, seed=hidden).cuda()
    x = torch.randn(batch, 33, 48, device="cuda")
    h0, c0 = torch.randn(2, batch, hidden, device="cuda").unbind(0)
    lstm = kind == "lstm"
    settings = R._settings(batch, hidden, 4 if lstm else 3, x.device)
    assert settings["SPLIT"] > 1  # the barrier path
    # cuDNN's RNNs take TF32 by default: the module's fp32 reference without it
    with torch.no_grad(), torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        got = R.triton_forward(kind, x, h0, c0 if lstm else None, *_weights(mod), True)
        want, _ = mod(x, (h0[None], c0[None]) if lstm else h0[None])
    torch.testing.assert_close(got[0], want, atol=2e-5, rtol=1e-4)


@cuda
def test_gpu_kernel_and_cell_loop_replay_from_cuda_graphs():
    """The op under CUDA-graph capture (its step counters allocated inside), and the
    unrolled cell loop replayed whole by opswap.backends.cudagraph (the race's variant)."""
    from opswap.backends.cudagraph import CudaGraphed

    mod = module("lstm", 16, 64, True, seed=1).cuda()
    x, h0, c0 = (
        torch.randn(4, 9, 16, device="cuda"),
        torch.randn(4, 64, device="cuda"),
        torch.randn(4, 64, device="cuda"),
    )

    class Op(nn.Module):
        def forward(self, x, h, c):
            return torch.ops.opswap.lstm_seq(x, h, c, *_weights(mod), True)[0]

    class Loop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cell = nn.LSTMCell(16, 64).cuda()
            for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                getattr(self.cell, n).data.copy_(getattr(mod, f"{n}_l0"))

        def forward(self, x, h, c):
            outs = []
            for t in range(x.shape[1]):
                h, c = self.cell(x[:, t], (h, c))
                outs.append(h)
            return torch.stack(outs, 1)

    with torch.no_grad(), torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        want = mod(x, (h0[None], c0[None]))[0]
        for m in (Op(), Loop()):
            g = CudaGraphed(m)
            g.capture(x, h0, c0)
            for _ in range(2):
                torch.testing.assert_close(g(x, h0, c0), want, atol=2e-5, rtol=1e-4)


if __name__ == "__main__":
    print(json.dumps({_key(c): _case(*c) for c in CASES}))
