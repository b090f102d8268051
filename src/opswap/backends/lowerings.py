"""ONNX lowerings of opswap's own ops (`torch.ops.opswap.*`), for torch.onnx's exporter.

A rewrite leaves a registered op in the graph (`opswap::conv_relu`, `opswap::wo_linear`,
...), which torch.export keeps as one node and torch.onnx knows nothing of. Each op gets
here an onnxscript function that the exporter calls through its
`custom_translation_table`: a decomposition into standard ONNX ops with the op's own
math, or an ONNX Runtime contrib op where one computes exactly that and runs on the CPU
execution provider:

| op                          | lowered to                                                  |
|-----------------------------|-------------------------------------------------------------|
| opswap::conv_relu           | Conv + Relu (ORT fuses the pair into its FusedConv)         |
| opswap::int8_linear         | per-row int8 quantisation, MatMulInteger, rescale           |
| aten::_int_mm               | MatMulInteger (what Int8Linear traces to on VNNI CPUs)      |
| opswap::int8_linear_fbgemm  | per-tensor 7-bit uint8 quantisation, MatMulInteger, rescale |
| opswap::wo_linear, INT4     | com.microsoft MatMulNBits (groups of a power of two >= 16)  |
| opswap::wo_linear, other    | the weight dequantised in the graph, then MatMul            |
| opswap::int8_static_linear  | QDQ around MatMul (+ Relu, Gelu); uint8 in or out as is     |
| opswap::int8_static_conv2d  | QDQ around Conv (+ Relu); a uint8 input or output as is     |
| opswap::fp8_linear          | Cast to FLOAT8E4M3FN and back (the op's CPU math)           |
| opswap::rms_norm            | ReduceMean of squares, Sqrt, Div, the weight (fp32 inside)  |
| opswap::add_rms_norm        | Add, then the same; both the normed row and the sum         |
| opswap::layer_norm          | ReduceMean, Sub, Sqrt, Div, the weight and bias (fp32)     |
| opswap::group_norm          | Reshape to [N, G, -1], the same, the channels' weight, bias |
| opswap::glu, glu_packed     | Sigmoid * g, or Gelu (erf or tanh), times u (Split if packed)|
| opswap::softmax, log_softmax| Softmax, LogSoftmax on the last axis (fp32 inside)          |
| opswap::masked_softmax      | x * scale, Where (bool mask) or Add (additive), Softmax     |
| opswap::row_reduce, row_dot | ReduceSum / ReduceMean / ReduceMax; var written out (fp32)  |
| opswap::rope                | x cos + rot(x) sin, rot by Split/Concat (half or pairs)     |
| opswap::flash_attention     | q kᵀ scale, the hidden keys at -inf (Where), Softmax, · v; lse |
| opswap::bias_gelu_cuda      | Add, Gelu (erf) in fp32                                     |
| opswap::bias_act            | Add, then Relu, Clip, LeakyRelu, HardSwish, HardSigmoid,    |
|                             | Sigmoid * s, Gelu (erf or tanh) or s * Sigmoid(1.702 s)     |
| aten::_addmm_activation     | MatMul, Add (fp32), Relu or Gelu(approximate="tanh")        |

`aten._addmm_activation` (what activation.linear_epilogue leaves) has a decomposition the
exporter would use, traced on the CPU, where the op's GELU is the erf form; on CUDA, the
device the rule targets, it is the tanh form (Blas.cpp and the decomposition itself
branch on the device). The rule folds only a tanh-GELU, so the lowering writes the tanh
form: the ONNX file computes the user's function on every execution provider.

The kernels' backward ops (`*_backward`) appear only in training graphs, which are
not exported to a runtime, and have no lowering; nor has `opswap::decode_attention`,
the decode step of opswap.llm's static-cache loop, which runs in-process.

Why not com.microsoft DynamicQuantizeMatMul for int8_linear: it quantises the input
per tensor and asymmetrically, opswap's op per row and symmetrically; the lowering
keeps the op's numbers (MatMulInteger multiplies the same int8 codes). The static QDQ
pairs round halves to even where the op rounds them up: the two differ only on an
input that lands exactly on a half step.

MatMulNBits has no schema in the onnx package; `_contrib_schemas` registers the one
this module calls (inputs, attributes and types as ONNX Runtime's contrib_defs declare
them), once, so that onnxscript can build the node.
"""

from __future__ import annotations

from typing import Any

import torch

OPSET = 20  # the exporter's default in torch 2.13; Cast to float8 needs >= 19

#: the op each lowering handles, with the ONNX it becomes (docs and error messages)
LOWERED = {
    "opswap::conv_relu": "Conv + Relu",
    "opswap::int8_linear": "MatMulInteger with per-row int8 quantisation",
    "aten::_int_mm": "MatMulInteger",
    "opswap::int8_linear_fbgemm": "MatMulInteger with per-tensor 7-bit uint8 quantisation",
    "opswap::wo_linear": "com.microsoft MatMulNBits (INT4) or dequantise + MatMul",
    "opswap::int8_static_linear": "QuantizeLinear/DequantizeLinear + MatMul (+ Relu, Gelu)",
    "opswap::int8_static_conv2d": "QuantizeLinear/DequantizeLinear + Conv (+ Relu)",
    "opswap::fp8_linear": "Cast to FLOAT8E4M3FN and back + MatMul",
    "opswap::rms_norm": "ReduceMean + Sqrt + Div + Mul (float32 inside)",
    "opswap::add_rms_norm": "Add + the rms_norm lowering",
    "opswap::layer_norm": "ReduceMean + Sub + Sqrt + Div + Mul + Add (float32 inside)",
    "opswap::group_norm": "Reshape + ReduceMean + Sub + Sqrt + Div + Mul + Add (float32 inside)",
    "opswap::glu": "Sigmoid or Gelu + Mul",
    "opswap::glu_packed": "Split + Sigmoid or Gelu + Mul",
    "opswap::softmax": "Softmax (float32 inside)",
    "opswap::log_softmax": "LogSoftmax (float32 inside)",
    "opswap::masked_softmax": "Mul + Where or Add + Softmax (float32 inside)",
    "opswap::row_reduce": "ReduceSum, ReduceMean or ReduceMax (float32 inside)",
    "opswap::row_dot": "Mul + ReduceSum (float32 inside)",
    "opswap::rope": "Mul + Split/Concat (the rotation) + Add, for q and k",
    "opswap::flash_attention": "MatMul + Where (causal, lengths, mask) + Softmax + MatMul",
    "opswap::bias_gelu_cuda": "Add + Gelu (float32 inside)",
    "opswap::bias_act": "Add + the activation's ONNX op (float32 inside)",
    "aten::_addmm_activation": "MatMul + Add + Relu or Gelu(tanh) (float32 inside)",
}

#: ops with no lowering, and why (training-only ops never reach an exported inference graph;
#: serving ops run in opswap.llm's decode loop, which is not exported)
NOT_LOWERED = {
    "opswap::rms_norm_backward": "training only",
    "opswap::layer_norm_backward": "training only",
    "opswap::group_norm_backward": "training only",
    "opswap::bias_act_backward": "training only",
    "opswap::glu_backward": "training only",
    "opswap::glu_packed_backward": "training only",
    "opswap::softmax_backward": "training only",
    "opswap::row_sumsq_backward": "training only",
    "opswap::rope_backward": "training only",
    "opswap::bias_gelu_cuda_backward": "training only",
    "opswap::flash_attention_backward": "training only",
    "opswap::decode_attention": "a serving op: one decode step over a static KV cache, "
    "run in-process (CUDA graphs), not exported",
}

_registered = False


def _contrib_schemas() -> None:
    """Register com.microsoft MatMulNBits's schema with onnx, if nothing has yet."""
    global _registered
    from onnx import defs

    if _registered:
        return
    try:
        defs.get_schema("MatMulNBits", 1, "com.microsoft")
    except Exception:
        fp, opt = defs.OpSchema.FormalParameter, defs.OpSchema.FormalParameterOption
        attr, kind = defs.OpSchema.Attribute, defs.OpSchema.AttrType
        floats = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
        defs.register_schema(
            defs.OpSchema(
                "MatMulNBits",
                "com.microsoft",
                1,
                inputs=[
                    fp("A", "T1"),
                    fp("B", "T2"),
                    fp("scales", "T1"),
                    fp("zero_points", "T3", param_option=opt.Optional),
                    fp("g_idx", "T4", param_option=opt.Optional),
                    fp("bias", "T1", param_option=opt.Optional),
                ],
                outputs=[fp("Y", "T1")],
                type_constraints=[
                    ("T1", floats, "activations and scales"),
                    ("T2", ["tensor(uint8)", "tensor(int32)"], "packed weight"),
                    ("T3", ["tensor(uint8)", "tensor(int32)", *floats], "zero points"),
                    ("T4", ["tensor(int32)"], "group index"),
                ],
                attributes=[
                    attr("K", kind.INT, "input features", required=True),
                    attr("N", kind.INT, "output features", required=True),
                    attr("bits", kind.INT, "bits per weight", required=True),
                    attr("block_size", kind.INT, "weights per scale", required=True),
                    attr("accuracy_level", kind.INT, "0: as the activations", required=False),
                ],
            )
        )
    _registered = True


def _float(x, op):
    """x as float32 (the ops compute in float32, as their CPU kernels do)."""
    from onnx_ir import DataType

    return x if x.dtype == DataType.FLOAT else op.Cast(x, to=DataType.FLOAT)


def _back(y, x, op):
    """y in x's dtype."""
    from onnx_ir import DataType

    return y if x.dtype == DataType.FLOAT else op.Cast(y, to=x.dtype)


def _to(y, dtype, like, op):
    """y in `dtype` (an ONNX data type; None: like's dtype)."""
    if dtype is None:
        return _back(y, like, op)
    from onnx_ir import DataType

    return y if dtype == DataType.FLOAT else op.Cast(y, to=dtype)


def _promoted(y, a, b, op):
    """y in torch's promotion of a's and b's float dtypes."""
    from onnx_ir import DataType

    if a.dtype == b.dtype:
        return _back(y, a, op)
    if DataType.DOUBLE in (a.dtype, b.dtype):
        return op.Cast(y, to=DataType.DOUBLE)
    if DataType.FLOAT in (a.dtype, b.dtype):
        return y
    return y  # float16 with bfloat16 promotes to float32


#: how a static int8 Linear is written: "qdq" (QuantizeLinear / DequantizeLinear around a
#: float MatMul, the interchange form OpenVINO runs as an int8 GEMM) or "integer"
#: (MatMulInteger, then the rescale: what ONNX Runtime's CPU provider runs as an int8
#: GEMM; it turned the QDQ form with a bias into a float32 Gemm on the dequantised weight,
#: 7.2 ms against 0.82 for a 128 x 768 -> 3072 layer on the VNNI VM)
INT8_FORMS = ("qdq", "integer")


def table(int8: str = "qdq") -> dict[Any, Any]:
    """The exporter's `custom_translation_table`: torch op overload -> onnxscript function.
    `int8`: the form of the static int8 Linear (INT8_FORMS)."""
    if int8 not in INT8_FORMS:
        raise ValueError(f"int8 must be one of {', '.join(INT8_FORMS)}, not {int8!r}")
    import onnxscript
    from onnx_ir import DataType

    import opswap.kernels  # noqa: F401  (registers torch.ops.opswap.*)
    from opswap.kernels.int8_linear import _MAX_STEP, _QMAX

    _contrib_schemas()
    op = getattr(onnxscript, f"opset{OPSET}")
    ms = onnxscript.values.Opset("com.microsoft", 1)

    def ints(v) -> Any:
        return op.Constant(value_ints=[int(i) for i in v])

    def conv_relu(x, weight, bias, stride, padding, dilation, groups):
        # zero padding, the same on both sides of each spatial dim (the op's contract)
        y = op.Conv(
            x,
            weight,
            *([bias] if bias is not None else []),
            strides=list(stride),
            pads=list(padding) * 2,
            dilations=list(dilation),
            group=groups,
        )
        return op.Relu(y)

    def int8_linear(x, wq, w_scale, bias):
        # x [..., K] quantised per row: s = max|x| / 127, q = round(x / s) in [-127, 127]
        xf = _float(x, op)
        amax = op.ReduceMax(op.Abs(xf), ints([-1]), keepdims=1)
        scale = op.Div(op.Max(amax, op.Constant(value_float=1e-12)), op.Constant(value_float=_QMAX))
        step = op.Min(scale, op.Constant(value_float=float(_MAX_STEP)))
        q = op.Clip(
            op.Round(op.Div(xf, step)),
            op.Constant(value_float=-_QMAX),
            op.Constant(value_float=_QMAX),
        )
        acc = op.MatMulInteger(op.Cast(q, to=DataType.INT8), wq)  # [..., N] int32
        y = op.Mul(op.Mul(op.Cast(acc, to=DataType.FLOAT), scale), w_scale)
        if bias is not None:
            y = op.Add(y, bias)
        return _back(y, x, op)

    def int_mm(a, b):
        return op.MatMulInteger(a, b)

    def int8_linear_fbgemm(x, wq, w_scale, bias):
        # x quantised per tensor to [0, 127]: s = (max(x, 0) - min(x, 0)) / 127,
        # zp = clamp(round(-lo / s), 0, 127), q = clamp(round(x / s) + zp, 0, 127);
        # DynamicQuantizeLinear would use all 8 bits, which is not the op's math
        xf = _float(x, op)
        zero = op.Constant(value_float=0.0)
        top = op.Constant(value_float=127.0)
        lo = op.Min(op.ReduceMin(xf, keepdims=0), zero)
        hi = op.Max(op.ReduceMax(xf, keepdims=0), zero)
        scale = op.Max(op.Div(op.Sub(hi, lo), top), op.Constant(value_float=1e-12))
        zp = op.Clip(op.Round(op.Div(op.Neg(lo), scale)), zero, top)
        q = op.Clip(op.Add(op.Round(op.Div(xf, scale)), zp), zero, top)
        acc = op.MatMulInteger(
            op.Cast(q, to=DataType.UINT8), wq, op.Cast(zp, to=DataType.UINT8)
        )  # [..., N] int32, the zero point taken off by MatMulInteger
        y = op.Mul(op.Mul(op.Cast(acc, to=DataType.FLOAT), scale), w_scale)
        if bias is not None:
            y = op.Add(y, bias)
        return _back(y, x, op)

    def dequantized(qweight, scale, offset, bits: int, in_features: int, n: int):
        # codes [N, Kp] (INT4: low nibble first), times the group's scale, plus its offset
        codes = qweight
        if bits == 4:
            low = op.BitwiseAnd(qweight, op.Constant(value=_u8(15)))
            high = op.BitShift(qweight, op.Constant(value=_u8(4)), direction="RIGHT")
            codes = op.Concat(
                op.Unsqueeze(low, ints([-1])), op.Unsqueeze(high, ints([-1])), axis=-1
            )
        ng = scale.shape[1]
        kp = qweight.shape[1] * (2 if bits == 4 else 1)
        w = op.Mul(
            op.Reshape(op.Cast(codes, to=DataType.FLOAT), ints([n, ng, kp // ng])),
            op.Unsqueeze(scale, ints([-1])),
        )
        if offset is not None:
            w = op.Add(w, op.Unsqueeze(offset, ints([-1])))
        w = op.Reshape(w, ints([n, kp]))
        return op.Slice(w, ints([0]), ints([in_features]), ints([1]))  # [N, K]

    def wo_linear(x, qweight, scale, offset, bias, bits, in_features):
        n, ng = qweight.shape[0], scale.shape[1]
        group = qweight.shape[1] * (2 if bits == 4 else 1) // ng
        if bits == 4 and group >= 16 and group & (group - 1) == 0 and offset is not None:
            # MatMulNBits computes (q - zp) * s; opswap's INT4 is q * s + m: zp = -m / s
            xf = _float(x, op)
            zp = op.Div(op.Neg(offset), scale)
            y = ms.MatMulNBits(
                xf,
                op.Reshape(qweight, ints([n, ng, group // 2])),
                op.Reshape(scale, ints([-1])),
                op.Reshape(zp, ints([-1])),
                K=int(in_features),
                N=int(n),
                bits=4,
                block_size=int(group),
            )
        else:
            xf = _float(x, op)
            w = dequantized(qweight, scale, offset, int(bits), int(in_features), int(n))
            y = op.MatMul(xf, op.Transpose(w, perm=[1, 0]))
        if bias is not None:
            y = op.Add(y, _float(bias, op))
        return _back(y, x, op)

    def qdq_input(x, x_scale: float, x_zp: int):
        s = op.Constant(value_float=float(x_scale))
        z = op.Constant(value=_u8(int(x_zp), scalar=True))
        return op.DequantizeLinear(op.QuantizeLinear(_float(x, op), s, z), s, z)

    def qdq_weight(wq, w_scale):
        if len(w_scale.shape) == 0 or w_scale.shape[0] == 1:
            return op.DequantizeLinear(wq, op.Reshape(w_scale, ints([])))
        return op.DequantizeLinear(wq, w_scale, axis=0)

    def static_input(x, x_scale: float, x_zp: int):
        """The layer's float input: a uint8 one (handed over already quantised with
        (x_scale, x_zp)) dequantised, a float one through its quantise-dequantise pair."""
        if x.dtype != DataType.UINT8:
            return qdq_input(x, x_scale, x_zp)
        s = op.Constant(value_float=float(x_scale))
        return op.DequantizeLinear(x, s, op.Constant(value=_u8(int(x_zp), scalar=True)))

    def static_output(y, x, post: str, out_scale: float, out_zp: int):
        """The epilogue: the activation, then uint8 by (out_scale, out_zp) when out_scale > 0,
        else x's float dtype (float32 for a uint8 x)."""
        if post == "relu":
            y = op.Relu(y)
        elif post in ("gelu", "gelu_tanh"):
            y = op.Gelu(y, approximate="tanh" if post == "gelu_tanh" else "none")
        if out_scale > 0:
            s = op.Constant(value_float=float(out_scale))
            return op.QuantizeLinear(y, s, op.Constant(value=_u8(int(out_zp), scalar=True)))
        return y if x.dtype == DataType.UINT8 else _back(y, x, op)

    def int8_static_linear(
        x, wq, w_scale, x_scale, x_zp, bias, post="none", out_scale=0.0, out_zp=0
    ):
        # the int8 weight transposed to [K, N]: an initializer's transpose, folded at export
        wt = op.Transpose(wq, perm=[1, 0])
        if int8 == "integer":
            if x.dtype == DataType.UINT8:
                xq = x
            else:
                s = op.Constant(value_float=float(x_scale))
                xq = op.QuantizeLinear(
                    _float(x, op), s, op.Constant(value=_u8(int(x_zp), scalar=True))
                )
            acc = op.MatMulInteger(xq, wt, op.Constant(value=_u8(int(x_zp), scalar=True)))
            scale = op.Mul(w_scale, op.Constant(value_float=float(x_scale)))  # folded
            y = op.Mul(op.Cast(acc, to=DataType.FLOAT), scale)
        else:
            # DequantizeLinear feeding MatMul directly on both sides, per column
            if len(w_scale.shape) == 0 or w_scale.shape[0] == 1:
                w = op.DequantizeLinear(wt, op.Reshape(w_scale, ints([])))
            else:
                w = op.DequantizeLinear(wt, w_scale, axis=1)
            y = op.MatMul(static_input(x, x_scale, x_zp), w)
        if bias is not None:
            y = op.Add(y, bias)
        return static_output(y, x, post, out_scale, out_zp)

    def int8_static_conv2d(
        x, wq, w_scale, x_scale, x_zp, bias, stride, padding, dilation, groups, post,
        out_scale=0.0, out_zp=0,
    ):  # fmt: skip
        y = op.Conv(
            static_input(x, x_scale, x_zp),
            qdq_weight(wq, w_scale),
            *([bias] if bias is not None else []),
            strides=list(stride),
            pads=list(padding) * 2,
            dilations=list(dilation),
            group=groups,
        )
        return static_output(y, x, post, out_scale, out_zp)

    def fp8_linear(x, wq, w_scale, bias, rowwise):
        # x / s in e4m3 (saturating at 448), s = max|x| / 448 per row or per tensor
        xf = _float(x, op)
        axes = ints([-1]) if rowwise else None
        amax = op.ReduceMax(op.Abs(xf), *([axes] if axes is not None else []), keepdims=1)
        sx = op.Div(op.Max(amax, op.Constant(value_float=1e-12)), op.Constant(value_float=448.0))
        xq = op.Cast(op.Cast(op.Div(xf, sx), to=DataType.FLOAT8E4M3FN), to=DataType.FLOAT)
        w = op.Transpose(op.Cast(wq, to=DataType.FLOAT), perm=[1, 0])
        y = op.Mul(op.MatMul(xq, w), sx)
        y = op.Mul(y, op.Unsqueeze(w_scale, ints([0])) if rowwise else w_scale)
        if bias is not None:
            y = op.Add(y, _float(bias, op))
        return _back(y, x, op)

    def rms(s, like, weight, eps: float, offset: float, cast_first: bool):
        # the kernels' math: h = s / sqrt(mean(s^2) + eps) in float32, then the weight
        # (+ offset); the output's dtype as the op's (promoted when cast_first)
        sf = _float(s, op)
        ms_ = op.ReduceMean(op.Mul(sf, sf), ints([-1]), keepdims=1)
        h = op.Div(sf, op.Sqrt(op.Add(ms_, op.Constant(value_float=float(eps)))))
        if weight is None:
            return _back(h, like, op)
        w = _float(weight, op)
        if offset:
            w = op.Add(w, op.Constant(value_float=float(offset)))
        y = op.Mul(h, w)
        wide = cast_first and weight.dtype == DataType.FLOAT
        return y if wide else _back(y, like, op)

    def rms_norm(x, weight, eps: float, offset: float, cast_first: bool):
        return rms(x, x, weight, eps, offset, cast_first)

    def add_rms_norm(x, residual, weight, eps: float, offset: float, cast_first: bool):
        s = op.Add(x, residual)
        return rms(s, x, weight, eps, offset, cast_first), s

    def layer_norm(x, weight, bias, eps: float):
        # written out (LayerNormalization would also hand back its mean and 1/std)
        xf = _float(x, op)
        mu = op.ReduceMean(xf, ints([-1]), keepdims=1)
        d = op.Sub(xf, mu)
        var = op.ReduceMean(op.Mul(d, d), ints([-1]), keepdims=1)
        y = op.Div(d, op.Sqrt(op.Add(var, op.Constant(value_float=float(eps)))))
        if weight is not None:
            y = op.Mul(y, _float(weight, op))
        if bias is not None:
            y = op.Add(y, _float(bias, op))
        return _back(y, x, op)

    def group_norm(x, num_groups: int, weight, bias, eps: float):
        # [N, C, *spatial] -> [N, G, rest]: the statistics; back to [N, C, rest] for the
        # channels' affine (whatever the rank, no spatial dims included), then x's shape
        xf = _float(x, op)
        shape = op.Shape(xf)
        g = op.Reshape(xf, ints([0, num_groups, -1]))
        mu = op.ReduceMean(g, ints([-1]), keepdims=1)
        d = op.Sub(g, mu)
        var = op.ReduceMean(op.Mul(d, d), ints([-1]), keepdims=1)
        y = op.Div(d, op.Sqrt(op.Add(var, op.Constant(value_float=float(eps)))))
        if weight is not None or bias is not None:
            y = op.Reshape(op.Reshape(y, shape), ints([0, 0, -1]))
            if weight is not None:
                y = op.Mul(y, op.Reshape(_float(weight, op), ints([-1, 1])))
            if bias is not None:
                y = op.Add(y, op.Reshape(_float(bias, op), ints([-1, 1])))
        return _back(op.Reshape(y, shape), x, op)

    def act_mul(g, u, like, activation: str):
        # `like`: a graph input of the op's dtype (Split's outputs carry none while traced)
        gf, uf = _float(g, op), _float(u, op)
        if activation == "silu":
            a = op.Mul(gf, op.Sigmoid(gf))
        else:
            a = op.Gelu(gf, approximate="tanh" if activation == "gelu_tanh" else "none")
        return _back(op.Mul(a, uf), like, op)

    def glu(g, u, activation: str):
        return act_mul(g, u, g, activation)

    def glu_packed(x, activation: str):
        g, u = op.Split(x, axis=-1, num_outputs=2)
        return act_mul(g, u, x, activation)

    def softmax(x, dtype=None):
        return _to(op.Softmax(_float(x, op), axis=-1), dtype, x, op)

    def log_softmax(x, dtype=None):
        return _to(op.LogSoftmax(_float(x, op), axis=-1), dtype, x, op)

    def masked_softmax(x, mask, scale: float, dtype=None):
        z = _float(x, op)
        if scale != 1.0:
            z = op.Mul(z, op.Constant(value_float=float(scale)))
        if mask is not None and mask.dtype == DataType.BOOL:
            z = op.Where(mask, z, op.Constant(value_float=float("-inf")))
        elif mask is not None:
            z = op.Add(z, _float(mask, op))
        return _to(op.Softmax(z, axis=-1), dtype, x, op)

    def row_reduce(x, op, unbiased: bool, keepdim: bool):  # `op`: the schema names it so
        return reduce_rows(x, op, unbiased, keepdim)

    def reduce_rows(x, kind: str, unbiased: bool, keepdim: bool):
        xf, axes, keep = _float(x, op), ints([-1]), int(bool(keepdim))
        if kind == "sum":
            r = op.ReduceSum(xf, axes, keepdims=keep)
        elif kind == "mean":
            r = op.ReduceMean(xf, axes, keepdims=keep)
        elif kind == "max":
            r = op.ReduceMax(xf, axes, keepdims=keep)
        elif kind in ("sumsq", "meansq"):
            sq = op.Mul(xf, xf)
            r = (op.ReduceSum if kind == "sumsq" else op.ReduceMean)(sq, axes, keepdims=keep)
        else:  # var: the mean of squared deviations, times n / (n - 1) when unbiased
            d = op.Sub(xf, op.ReduceMean(xf, axes, keepdims=1))
            ss = op.ReduceSum(op.Mul(d, d), axes, keepdims=keep)
            n = op.Cast(op.Shape(x, start=-1), to=DataType.FLOAT)
            den = op.Sub(n, op.Constant(value_float=1.0)) if unbiased else n
            r = op.Div(ss, op.Squeeze(den))
        return _back(r, x, op)

    def row_dot(x, y, keepdim: bool):
        xy = op.Mul(_float(x, op), _float(y, op))
        return _back(op.ReduceSum(xy, ints([-1]), keepdims=int(bool(keepdim))), x, op)

    def rotate(x, interleaved: bool):
        # HF's rotate_half (-x2, x1), or GPT-J's pairs (-x_odd, x_even); x is [B, H, S, D]
        if not interleaved:
            a, b = op.Split(x, axis=-1, num_outputs=2)
            return op.Concat(op.Neg(b), a, axis=-1)
        pairs = op.Reshape(x, ints([0, 0, 0, -1, 2]))
        a, b = op.Split(pairs, axis=-1, num_outputs=2)
        return op.Reshape(op.Concat(op.Neg(b), a, axis=-1), ints([0, 0, 0, -1]))

    def rope(q, k, cos, sin, positions, interleaved: bool):
        c, s = _float(cos, op), _float(sin, op)
        if positions is not None:  # the tables' rows at the positions: [S, D] or [B, S, D]
            c, s = op.Gather(c, positions, axis=0), op.Gather(s, positions, axis=0)
        rank = len(cos.shape) if positions is None else len(positions.shape) + 1
        if rank == 2:  # [S, D] -> [1, 1, S, D]; [B, S, D] -> [B, 1, S, D]
            c, s = op.Unsqueeze(c, ints([0, 1])), op.Unsqueeze(s, ints([0, 1]))
        elif rank == 3:
            c, s = op.Unsqueeze(c, ints([1])), op.Unsqueeze(s, ints([1]))
        out = []
        for x in (q, k):
            xf = _float(x, op)
            y = op.Add(op.Mul(xf, c), op.Mul(rotate(xf, interleaved), s))
            out.append(_promoted(y, x, cos, op))
        return out[0], out[1]

    def flash_attention(q, k, v, causal: bool, scale: float, lengths, mask):
        h, hk, d = q.shape[1], k.shape[1], k.shape[3]
        qf, kf, vf = _float(q, op), _float(k, op), _float(v, op)
        if hk != h:  # GQA: each kv head repeated for its h / hk query heads
            rep = ints([1, 1, h // hk, 1, 1])
            kf, vf = (
                op.Reshape(op.Expand(op.Unsqueeze(t, ints([2])), rep), ints([0, h, -1, d]))
                for t in (kf, vf)
            )
        s = op.Mul(
            op.MatMul(qf, op.Transpose(kf, perm=[0, 1, 3, 2])),
            op.Constant(value_float=float(scale)),
        )
        keep = None
        zero, one = op.Constant(value_int=0), op.Constant(value_int=1)
        keys = op.Range(zero, op.Squeeze(op.Shape(k, start=2, end=3)), one)  # [S_k]
        if causal:  # top-left aligned: query i sees keys j <= i
            rows = op.Range(zero, op.Squeeze(op.Shape(q, start=2, end=3)), one)
            keep = op.LessOrEqual(op.Unsqueeze(keys, ints([0])), op.Unsqueeze(rows, ints([1])))
        if lengths is not None:  # [B] -> [B, 1, 1, S_k]
            seen = op.Less(
                op.Unsqueeze(keys, ints([0])),
                op.Unsqueeze(op.Cast(lengths, to=DataType.INT64), ints([1])),
            )
            seen = op.Unsqueeze(seen, ints([1, 2]))
            keep = seen if keep is None else op.And(keep, seen)
        if mask is not None and mask.dtype == DataType.BOOL:
            keep = mask if keep is None else op.And(keep, mask)
        elif mask is not None:
            s = op.Add(s, _float(mask, op))
        ninf = op.Constant(value_float=float("-inf"))
        if keep is not None:
            s = op.Where(keep, s, ninf)
        p = op.Softmax(s, axis=-1)
        zf = op.Constant(value_float=0.0)
        p = op.Where(op.IsNaN(p), zf, p)  # a row that sees no key: 0, as the op
        o = _back(op.MatMul(p, vf), q, op)
        lse = op.ReduceLogSumExp(s, ints([-1]), keepdims=0)
        lse = op.Where(op.Or(op.IsNaN(lse), op.IsInf(lse)), zf, lse)
        return o, lse

    def bias_gelu_cuda(x, b):
        return _back(op.Gelu(op.Add(_float(x, op), _float(b, op))), x, op)

    def bias_act(x, bias, activation: str, negative_slope: float):
        s = _float(x, op)
        if bias is not None:
            s = op.Add(s, _float(bias, op))
        if activation == "relu":
            y = op.Relu(s)
        elif activation == "relu6":
            y = op.Clip(s, op.Constant(value_float=0.0), op.Constant(value_float=6.0))
        elif activation == "leaky_relu":
            y = op.LeakyRelu(s, alpha=float(negative_slope))
        elif activation == "hardswish":
            y = op.HardSwish(s)
        elif activation == "hardsigmoid":  # relu6(s + 3) / 6 = clip(s / 6 + 1/2, 0, 1)
            y = op.HardSigmoid(s, alpha=1.0 / 6.0, beta=0.5)
        elif activation == "silu":
            y = op.Mul(s, op.Sigmoid(s))
        elif activation == "quick_gelu":
            y = op.Mul(s, op.Sigmoid(op.Mul(s, op.Constant(value_float=1.702))))
        else:
            y = op.Gelu(s, approximate="tanh" if activation == "gelu_tanh" else "none")
        return _back(y, x, op)

    def addmm_activation(bias, mat1, mat2, beta: float = 1.0, alpha: float = 1.0, use_gelu=False):
        # bias [N], mat1 [M, K], mat2 [K, N]; the epilogue's math on the fp32 accumulator
        y = _float(op.MatMul(mat1, mat2), op)
        b = _float(bias, op)
        if alpha != 1.0:
            y = op.Mul(y, op.Constant(value_float=float(alpha)))
        if beta != 1.0:
            b = op.Mul(b, op.Constant(value_float=float(beta)))
        y = op.Add(y, b)
        y = op.Gelu(y, approximate="tanh") if use_gelu else op.Relu(y)
        return _back(y, mat1, op)

    ops = torch.ops.opswap
    return {
        torch.ops.aten._addmm_activation.default: addmm_activation,
        ops.softmax.default: softmax,
        ops.log_softmax.default: log_softmax,
        ops.masked_softmax.default: masked_softmax,
        ops.row_reduce.default: row_reduce,
        ops.row_dot.default: row_dot,
        ops.rope.default: rope,
        ops.flash_attention.default: flash_attention,
        ops.bias_gelu_cuda.default: bias_gelu_cuda,
        ops.bias_act.default: bias_act,
        ops.rms_norm.default: rms_norm,
        ops.add_rms_norm.default: add_rms_norm,
        ops.layer_norm.default: layer_norm,
        ops.group_norm.default: group_norm,
        ops.glu.default: glu,
        ops.glu_packed.default: glu_packed,
        ops.conv_relu.default: conv_relu,
        ops.int8_linear.default: int8_linear,
        torch.ops.aten._int_mm.default: int_mm,
        ops.int8_linear_fbgemm.default: int8_linear_fbgemm,
        ops.wo_linear.default: wo_linear,
        ops.int8_static_linear.default: int8_static_linear,
        ops.int8_static_conv2d.default: int8_static_conv2d,
        ops.fp8_linear.default: fp8_linear,
    }


def _u8(v: int, scalar: bool = False):
    """A uint8 constant tensor (0-d when `scalar`, else one element)."""
    import numpy as np
    import onnx_ir as ir

    return ir.tensor(np.array(v if scalar else [v], dtype=np.uint8))
