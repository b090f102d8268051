"""opswap::wo_linear -> com.microsoft MatMulNBits for INT4 in groups of a power of two
>= 16 (with offsets); otherwise the weight dequantised in the graph, then MatMul.

MatMulNBits has no schema in the onnx package; `_contrib_schemas` registers the one
this module calls (inputs, attributes and types as ONNX Runtime's contrib_defs declare
them), once, when the translation table is made, so that onnxscript can build the node.
"""

from __future__ import annotations

from typing import Any  # onnxscript values: see _onnx

from opswap.backends.lowerings._onnx import as_float, back, ints, op, u8
from opswap.backends.lowerings._registry import Options, lowering

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


def dequantized(qweight: Any, scale: Any, offset: Any, bits: int, in_features: int, n: int) -> Any:
    """The weight [N, K] in float32: codes [N, Kp] (INT4: low nibble first), times the
    group's scale, plus its offset."""
    from onnx_ir import DataType

    codes = qweight
    if bits == 4:
        low = op.BitwiseAnd(qweight, op.Constant(value=u8(15)))
        high = op.BitShift(qweight, op.Constant(value=u8(4)), direction="RIGHT")
        codes = op.Concat(op.Unsqueeze(low, ints([-1])), op.Unsqueeze(high, ints([-1])), axis=-1)
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


@lowering(
    "opswap::wo_linear",
    "com.microsoft MatMulNBits (INT4) or dequantise + MatMul",
    takes_options=True,
)
def wo_linear_for(options: Options) -> Any:
    """The lowering, with MatMulNBits's schema registered first."""
    import onnxscript

    _contrib_schemas()
    ms = onnxscript.values.Opset("com.microsoft", 1)

    def wo_linear(
        x: Any, qweight: Any, scale: Any, offset: Any, bias: Any, bits: int, in_features: int
    ) -> Any:
        n, ng = qweight.shape[0], scale.shape[1]
        group = qweight.shape[1] * (2 if bits == 4 else 1) // ng
        if bits == 4 and group >= 16 and group & (group - 1) == 0 and offset is not None:
            # MatMulNBits computes (q - zp) * s; opswap's INT4 is q * s + m: zp = -m / s
            xf = as_float(x)
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
            xf = as_float(x)
            w = dequantized(qweight, scale, offset, int(bits), int(in_features), int(n))
            y = op.MatMul(xf, op.Transpose(w, perm=[1, 0]))
        if bias is not None:
            y = op.Add(y, as_float(bias))
        return back(y, x)

    return wo_linear
