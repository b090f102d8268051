"""Every lowering of an opswap op, run in ONNX Runtime against the op itself in PyTorch,
at the example's batch and at others (the file keeps batch dynamic); and the contract:
every op opswap's kernels register has a lowering or a registered reason for none."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import typing
from pathlib import Path

import onnx
import pytest
import torch
from torch import nn

from opswap.backends.lowerings import (
    INT8_FORMS,
    LOWERED,
    NOT_LOWERED,
    Options,
    _registry,
    lowering,
    lowering_modules,
    no_lowering,
    registered,
    table,
    uncovered,
)
from opswap.backends.ort import ort_artifact
from opswap.graph.dynamic import Axis, Dynamic
from opswap.graph.observers import QParams
from opswap.kernels import int8_linear as k8
from opswap.kernels.activation import ACTIVATIONS
from opswap.kernels.embedding_bag import quantize_rows
from opswap.rules.precision._int8_module import Int8Linear
from opswap.rules.precision._int8_static_module import Int8StaticConv2d, Int8StaticLinear
from opswap.rules.precision._lowbit_modules import FP8Linear, WeightOnlyLinear

K, N = 200, 24  # K not a multiple of 128: INT4's padded last group
BATCH = Dynamic([Axis("batch", ((0, 0),), 3, 4)])


class _Int8Op(nn.Module):
    """opswap::int8_linear called directly (weights [K, N] int8)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("wq", torch.randint(-127, 128, (K, N), dtype=torch.int8))
        self.register_buffer("scale", torch.rand(N) * 0.01 + 1e-3)
        self.register_buffer("bias", torch.randn(N))

    def forward(self, x):
        return torch.ops.opswap.int8_linear(x, self.wq, self.scale, self.bias)


class _Gemm(nn.Module):
    """opswap::gemm with a bias or none, an activation, a residual (x's first N columns),
    and the weight [N, K] or [K, N]."""

    def __init__(self, w, b, activation, b_transposed):
        super().__init__()
        self.register_buffer("w", w if b_transposed else w.t().contiguous())
        self.register_buffer("b", b)
        self.act, self.bt = activation, b_transposed

    def forward(self, x):
        res = x[:, :N] * 0.5
        return torch.ops.opswap.gemm(x, self.w, self.b, res, self.act, self.bt, "ieee")


class _Row(nn.Module):
    """One of the row kernels' ops on x [B, S, H] with a weight [H] (a buffer)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.register_buffer("w", torch.rand(2 * 37) + 0.5)

    def forward(self, x):
        return self.fn(x, self.w)


class _Kernels(nn.Module):
    """The softmax, reduction, RoPE, attention and bias+GELU ops on x [B, 4, 6, 8]:
    GQA, causal with key lengths, bool and additive masks, positions, both rotations."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.register_buffer("w", torch.rand(8) + 0.5)
        self.register_buffer("cos", torch.randn(6, 8))
        self.register_buffer("sin", torch.randn(6, 8))
        keep = (torch.rand(1, 1, 6, 6) > 0.4) | torch.eye(6, dtype=torch.bool)  # no empty row
        self.register_buffer("keep", keep)
        self.register_buffer("bias", torch.randn(1, 1, 6, 6))
        self.register_buffer("pos", torch.tensor([5, 0, 1, 2, 3, 4]))
        self.register_buffer("table", torch.randn(20, 5))
        q, scale, bias = quantize_rows(torch.randn(20, 5))
        self.register_buffer("q", q)
        self.register_buffer("qscale", scale)
        self.register_buffer("qbias", bias)

    def forward(self, x):
        ops = torch.ops.opswap
        k, v = x[:, :2] * 0.5, x[:, 1:3] + 1  # two kv heads for four query heads
        lengths = (x[:, 0, 0, 0] * 0 + 4).long()  # [B], as the batch
        r = {
            "softmax": ops.softmax(x, None),
            "softmax_half": ops.softmax(x, torch.float16).float(),
            "log_softmax": ops.log_softmax(x, None),
            "masked_bool": ops.masked_softmax(x[..., :6], self.keep, 0.5, None),
            "masked_add": ops.masked_softmax(x[..., :6], self.bias, 1.0, None),
            "var_biased": ops.row_reduce(x, "var", False, False),
            "dot": ops.row_dot(x, x * self.w, True),
            "bias_gelu": ops.bias_gelu_cuda(x, self.w),
        }
        for kind in ("sum", "mean", "max", "var", "sumsq", "meansq"):
            r[kind] = ops.row_reduce(x, kind, True, kind == "mean")
        r["rope_q"], r["rope_k"] = ops.rope(x, k, self.cos, self.sin, None, False)
        r["rope_pos_q"], r["rope_pos_k"] = ops.rope(x, k, self.cos, self.sin, self.pos, True)
        r["flash"], r["lse"] = ops.flash_attention(x, k, v, True, 0.3, lengths, None)
        r["flash_bool"], r["lse_bool"] = ops.flash_attention(x, x, x, False, 0.3, None, self.keep)
        r["flash_add"], _ = ops.flash_attention(x, k, v, False, 0.3, None, self.bias)
        r["topk"], r["topk_idx"] = ops.topk(x, 3, True, True)
        r["bottomk"], r["bottomk_idx"] = ops.topk(x, 8, False, True)
        r["approx_topk"], r["approx_idx"] = ops.approx_topk(x, 2, True, 1, 2)
        idx = (x[:, :2, :, :3].abs() * 7).long().clamp_max(9)  # [B, 2 tables, 6, 3]
        idx = idx.reshape(x.shape[0], 2, -1)
        off = torch.tensor([0, 10])
        r["bags"] = ops.batched_embedding_bag(self.table, off, idx, None, False, None, None, None)
        r["bags_mean_w"] = ops.batched_embedding_bag(
            self.table, off, idx, x[:, :2, :, :3].reshape(idx.shape), True, None, None, None
        )
        r["bags_int8"] = ops.batched_embedding_bag(
            self.q, off, idx, None, False, self.qscale, self.qbias, None
        )
        return r


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(K, N)


class _Each(nn.Module):
    """Every module on the same input: one export covers them all."""

    def __init__(self, **mods: nn.Module):
        super().__init__()
        self.mods = nn.ModuleDict(mods)

    def forward(self, x):
        return {k: m(x) for k, m in self.mods.items()}


class _GroupNorm(nn.Module):
    def __init__(self, groups, channels, affine):
        super().__init__()
        torch.manual_seed(groups)
        self.groups = groups
        self.w = nn.Parameter(torch.rand(channels) + 0.5) if affine else None
        self.b = nn.Parameter(torch.randn(channels)) if affine else None

    def forward(self, x):
        return torch.ops.opswap.group_norm(x, self.groups, self.w, self.b, 1e-5)


class _ConvOp(nn.Module):
    """opswap::conv_im2col or conv_fft on x [B, 3, H, W] with a constant weight."""

    def __init__(self, fft: bool):
        super().__init__()
        torch.manual_seed(3)
        self.fft = fft
        self.register_buffer("w", torch.randn(6, 1, 5, 3) if fft else torch.randn(4, 3, 3, 2))
        self.register_buffer("b", torch.randn(6 if fft else 4))

    def forward(self, x):
        if self.fft:  # depthwise-like: 2 outputs per input channel, stride 1
            return torch.ops.opswap.conv_fft(x, self.w, self.b, [2, 1], 3)
        return torch.ops.opswap.conv_im2col(x, self.w, None, [2, 1], [1, 0], [1, 2], 1)


class _Seq(nn.Module):
    """opswap::lstm_seq / gru_seq on x [B, T, F] with an nn.LSTM's / nn.GRU's weights, fed
    batch-first or transposed to time-major; the sequence plus the last state."""

    def __init__(self, kind: str, batch_first: bool, bias: bool = True, initial: bool = True):
        super().__init__()
        torch.manual_seed(2)
        cls = nn.LSTM if kind == "lstm" else nn.GRU
        self.rnn, self.kind, self.batch_first = cls(6, 9, bias=bias), kind, batch_first
        self.initial = initial

    def forward(self, x):
        r = self.rnn
        w = (
            r.weight_ih_l0,
            r.weight_hh_l0,
            getattr(r, "bias_ih_l0", None),
            getattr(r, "bias_hh_l0", None),
        )
        h0 = x[:, 0, :1].expand(-1, 9) * 0.3 if self.initial else None
        xs = x if self.batch_first else x.transpose(0, 1)
        if self.kind == "lstm":
            c0 = h0 * 2 if h0 is not None else None
            out, h, c = torch.ops.opswap.lstm_seq(xs, h0, c0, *w, self.batch_first)
            h = h + c
        else:
            out, h = torch.ops.opswap.gru_seq(xs, h0, *w, self.batch_first)
        out = out if self.batch_first else out.transpose(0, 1)
        return out.sum(1) + h


def _handoff(conv: nn.Conv2d, qp: QParams) -> nn.Sequential:
    """Two int8 convolutions, the first handing uint8 to the second (its epilogue
    requantises with the second's input scale)."""
    first = Int8StaticConv2d(
        conv.weight.data, conv.bias.data, qp, True, (1, 1), (1, 1), (1, 1), 1, True
    )
    second = Int8StaticConv2d(
        torch.randn(6, 8, 3, 3) * 0.2, None, QParams(0.02, 5), True, (2, 2), (0, 0), (1, 1), 1,
        False,
    )  # fmt: skip
    first.out_scale, first.out_zp = second.x_scale, second.x_zp
    return nn.Sequential(first, second)


def _cases():
    lin = _linear()
    w, b = lin.weight.data, lin.bias.data
    torch.manual_seed(1)
    conv = nn.Conv2d(3, 8, 3, padding=1, stride=2)
    qp = QParams(0.03, 120)
    linears = _Each(
        wo4=WeightOnlyLinear(w, b, 4),  # groups of 128: MatMulNBits
        wo4_row=WeightOnlyLinear(w, None, 4, K),  # one group of 200: dequantised
        wo8=WeightOnlyLinear(w, b, 8),
        int8=_Int8Op(),
        static=Int8StaticLinear(w, b, qp, True),
        fp8=FP8Linear(w, b),
        gemm=_Gemm(w, b, "gelu", True),
        gemm_kn=_Gemm(w, None, "silu", False),
    )
    convs = _Each(
        static=Int8StaticConv2d(
            conv.weight.data, conv.bias.data, qp, True, (2, 2), (1, 1), (1, 1), 1, True
        ),
        static_tensor=Int8StaticConv2d(
            conv.weight.data, None, qp, False, (2, 2), (1, 1), (1, 1), 1, False
        ),
        handoff=_handoff(conv, qp),
        group_norm=_GroupNorm(3, 3, affine=True),  # InstanceNorm's form: G = C
        group_norm_one=_GroupNorm(1, 3, affine=False),
        im2col=_ConvOp(fft=False),
        fft=_ConvOp(fft=True),
    )
    rows = _Each(
        rms=_Row(lambda x, w: torch.ops.opswap.rms_norm(x, w, 1e-6, 0.0, True)),
        rms_gemma=_Row(lambda x, w: torch.ops.opswap.rms_norm(x, w, 1e-5, 1.0, False)),
        rms_plain=_Row(lambda x, w: torch.ops.opswap.rms_norm(x, None, 1e-6, 0.0, True)),
        add_rms=_Row(
            lambda x, w: sum(torch.ops.opswap.add_rms_norm(x, x * 0.5, w, 1e-6, 0.0, True))
        ),
        ln=_Row(lambda x, w: torch.ops.opswap.layer_norm(x, w, w * 0.1, 1e-5)),
        ln_plain=_Row(lambda x, w: torch.ops.opswap.layer_norm(x, None, None, 1e-5)),
        gn_rows=_Row(lambda x, w: torch.ops.opswap.group_norm(x, 5, None, None, 1e-5)),
        silu=_Row(lambda x, w: torch.ops.opswap.glu(x, x * w, "silu")),
        gelu=_Row(lambda x, w: torch.ops.opswap.glu(x, x * w, "gelu")),
        packed=_Row(lambda x, w: torch.ops.opswap.glu_packed(x, "gelu_tanh")),
        **{  # every activation of bias_act, every other one without its bias
            f"act_{a}": _Row(
                lambda x, w, a=a, i=i: torch.ops.opswap.bias_act(
                    x * 3, w - 1 if i % 2 == 0 else None, a, 0.2
                )
            )
            for i, a in enumerate(ACTIVATIONS)
        },
    )
    seqs = _Each(
        lstm=_Seq("lstm", True),
        lstm_tm=_Seq("lstm", False, bias=False),
        gru=_Seq("gru", True),
        gru_tm=_Seq("gru", False, initial=False),
        lstm_zero=_Seq("lstm", True, initial=False),
    )
    return {
        "kernel ops": (
            _Kernels(),
            (3, 4, 6, 8),
            {"Softmax", "LogSoftmax", "ReduceLogSumExp", "TopK", "Gather"},
        ),
        "rnn ops": (seqs, (3, 5, 6), {"LSTM", "GRU"}),
        "row kernel ops": (
            rows,
            (3, 5, 2 * 37),
            {"ReduceMean", "Sqrt", "Gelu", "Split", "HardSwish", "HardSigmoid", "LeakyRelu"},
        ),
        "linear ops": (linears, (3, K), {"MatMulNBits", "MatMulInteger", "QuantizeLinear"}),
        "conv ops": (
            convs,
            (3, 3, 9, 11),
            {"Conv", "DequantizeLinear", "QuantizeLinear", "ReduceMean"},
        ),
    }


@pytest.mark.parametrize("case", list(_cases()))
def test_lowering_matches_the_op(case, tmp_path):
    module, shape, onnx_ops = _cases()[case]
    module.eval()
    x = torch.randn(*shape)
    art = ort_artifact(module, (x,), BATCH, tmp_path)
    assert art.module is not None, art.error
    graph = onnx.load(str(art.path)).graph
    assert onnx_ops <= {n.op_type for n in graph.node}
    assert not any(n.domain == "opswap" for n in graph.node)
    for batch in (1, 3, 6):
        xb = torch.randn(batch, *shape[1:])
        with torch.no_grad():
            want = module(xb)
        got = art.module(xb)
        assert set(got) == set(want)
        for k in want:
            # the same math: float32 rounding (static int8: a rare half step apart)
            scale = want[k].abs().max().item()
            if k == "handoff":
                # ONNX Runtime rounds x / s where the kernels round x * (1 / s): a value
                # near a half step of the uint8 map between the two convolutions may go the
                # other way (one step of 256, spread by the second's weights); a wrong scale
                # or zero point would be tens of steps off
                assert float((got[k] - want[k]).abs().max()) < 0.01 * scale, k
                continue
            torch.testing.assert_close(got[k], want[k], atol=1e-5 * scale, rtol=1e-4, msg=k)


def test_int_mm_lowered_where_int8_linear_traces_to_it(tmp_path, monkeypatch):
    # on a VNNI CPU Int8Linear's forward is torch._int_mm: forced here, it must lower too
    monkeypatch.setattr(k8, "cpu_int_mm_fast", lambda: True)
    lin = _linear()
    module = Int8Linear(lin.weight.data, lin.bias.data).eval()
    x = torch.randn(3, 5, K)
    art = ort_artifact(module, (x,), BATCH, tmp_path)
    assert art.module is not None, art.error
    assert "MatMulInteger" in {n.op_type for n in onnx.load(str(art.path)).graph.node}
    xb = torch.randn(2, 5, K)
    with torch.no_grad():
        want = module(xb)
    torch.testing.assert_close(art.module(xb), want, atol=1e-5, rtol=1e-5)


def _opswap_ops() -> list[str]:
    """Every op under torch.ops.opswap once each public module of opswap.kernels is
    imported: walked, not read from kernels/__init__, so a new kernel file counts too."""
    import opswap.kernels

    for m in pkgutil.iter_modules(opswap.kernels.__path__):
        if not m.name.startswith("_"):
            importlib.import_module(f"opswap.kernels.{m.name}")
    return sorted(
        f"opswap::{name}"
        for name in dir(torch.ops.opswap)
        if isinstance(getattr(torch.ops.opswap, name), torch._ops.OpOverloadPacket)
    )


def _contract(ops: list[str]) -> str:
    """The contract's failure message for `ops` ("" when every one is covered)."""
    missing = uncovered(ops)
    if not missing:
        return ""
    return (
        f"{', '.join(missing)} has neither a lowering nor a reason for none: add "
        "@lowering(...) (or no_lowering(op, why, __name__)) in the module of "
        "src/opswap/backends/lowerings/ named as its kernel's"
    )


def test_every_opswap_op_has_a_lowering_or_says_why_not():
    ops = _opswap_ops()
    assert {o for o in LOWERED if o.startswith("opswap::")} <= set(ops)
    problem = _contract(ops)
    assert not problem, problem
    # and the lists a reader sees are the registrations, each naming an op torch knows
    assert set(LOWERED) | set(NOT_LOWERED) == {e.op for e in registered()}
    assert not set(LOWERED) & set(NOT_LOWERED)
    for e in registered():
        assert isinstance(e.overload(), torch._ops.OpOverload), e.op
    assert {o.name().replace(".default", "") for o in table()} == set(LOWERED)


def test_an_op_added_without_a_lowering_fails_the_contract_by_name():
    problem = _contract([*_opswap_ops(), "opswap::brand_new_op"])
    assert problem.startswith("opswap::brand_new_op has neither a lowering nor a reason")
    assert "opswap::rms_norm" not in problem


def test_each_lowering_module_is_named_as_the_kernel_whose_ops_it_lowers():
    import opswap.kernels

    root = Path(opswap.kernels.__file__).parent
    for name in lowering_modules():
        stem = name.rpartition(".")[2]
        entries = [e for e in registered() if e.module == name]
        assert entries, f"{name} registers nothing"
        for e in entries:
            if e.op.startswith("aten::"):  # left by a rule: beside its kernel, or its rule's name
                continue
            kernel = root / f"{stem}.py"
            assert kernel.is_file(), f"{name} lowers {e.op}, but there is no kernels/{stem}.py"
            assert f'"{e.op}"' in kernel.read_text(), f"kernels/{stem}.py does not define {e.op}"


def test_a_lowering_registered_twice_or_misnamed_is_refused(monkeypatch):
    monkeypatch.setattr(_registry, "_LOWERINGS", dict(_registry._LOWERINGS))
    with pytest.raises(TypeError, match="opswap::rms_norm is registered twice: by "):
        lowering("opswap::rms_norm", "Relu")(lambda x: x)
    with pytest.raises(TypeError, match="'namespace::name'"):
        no_lowering("rms_norm_backward", "training only", "mine")
    no_lowering("opswap::not_yet", "no op of that name", "mine")
    with pytest.raises(LookupError, match="opswap::not_yet has no lowering"):
        _registry._LOWERINGS["opswap::not_yet"].translation(Options())
    with pytest.raises(LookupError, match="which torch does not know"):
        _registry._LOWERINGS["opswap::not_yet"].overload()


def test_each_lowering_is_annotated_as_torch_onnx_reads_it():
    # torch.onnx evaluates a translation's annotations (typing.get_type_hints) to tell its
    # inputs (an onnxscript value: Any) from its attributes (int, float, str, bool, ints)
    seen = 0
    for e in registered():
        if not e.lowered:
            continue
        for form in INT8_FORMS if e.takes_options else ("qdq",):
            fn = e.translation(Options(int8=form))
            hints = typing.get_type_hints(fn)  # NameError: a name bound only for mypy
            bare = set(inspect.signature(fn).parameters) - set(hints)
            assert not bare, f"{e.op}'s lowering leaves {', '.join(sorted(bare))} unannotated"
            assert "return" in hints, f"{e.op}'s lowering does not annotate its return"
            seen += 1
    assert seen >= len(LOWERED)


@pytest.mark.parametrize("form", ["qdq", "integer"])
def test_static_int8_linear_in_both_onnx_forms(form, tmp_path):
    """The static int8 Linear written as QDQ (for OpenVINO and other readers) and as
    MatMulInteger (for ONNX Runtime): the same numbers in ONNX Runtime, with and without
    a handed-over uint8 input, a GELU and a uint8 output in the epilogue."""
    import onnxruntime as ort

    from opswap.backends.onnx import export_onnx

    torch.manual_seed(5)
    first = Int8StaticLinear(torch.randn(40, K) * 0.1, torch.randn(40), QParams(0.03, 120), True)
    second = Int8StaticLinear(torch.randn(N, 40) * 0.1, None, QParams(0.02, 4), False)
    first.post, first.out_scale, first.out_zp = "gelu", second.x_scale, second.x_zp
    model = nn.Sequential(first, second).eval()
    x = torch.randn(3, K)
    art = export_onnx(model, (x,), BATCH, tmp_path, int8=form)
    assert art.path is not None, art.error
    ops = {n.op_type for n in onnx.load(str(art.path)).graph.node}
    assert ("MatMulInteger" in ops) == (form == "integer"), ops
    assert "Gelu" in ops and "QuantizeLinear" in ops
    sess = ort.InferenceSession(str(art.path), providers=["CPUExecutionProvider"])
    for batch in (1, 5):
        xb = torch.randn(batch, K)
        (got,) = sess.run(None, {sess.get_inputs()[0].name: xb.numpy()})
        with torch.no_grad():
            want = model(xb)
        # a value on a half step of the uint8 tensor between the two may round the other way
        assert float((torch.from_numpy(got) - want).abs().max()) < 0.01 * float(want.abs().max())
    with pytest.raises(ValueError, match="int8 must be one of"):
        table("int4")
