"""backends.onnx: opswap's result as an .onnx file, its ops lowered, dynamic as the
capture claims, checked in ONNX Runtime against the user's module."""

from __future__ import annotations

import onnx
import pytest
import torch
from torch import nn

from opswap import api
from opswap.backends.onnx import export_onnx, to_onnx, unlowered
from opswap.backends.ort import OrtModule
from opswap.backends.pt2 import export
from opswap.errors import ExportError
from opswap.graph.dynamic import variants
from opswap.planner import apply_plan


class _ConvNet(nn.Module):
    """Conv + BN (eval) + ReLU twice, an in-place add, a buffer, a Linear head."""

    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.register_buffer("shift", torch.randn(1, 8, 1, 1))
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        h = torch.relu(self.b1(self.c1(x)))
        h = torch.relu(self.b2(self.c2(h)))
        h.add_(self.shift)
        return self.head(h.mean((2, 3)))


def _trained_bn(m: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    for bn in (m.b1, m.b2):
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
    return m.eval()


def test_opswap_result_exports_with_conv_relu_lowered(tmp_path):
    model = _trained_bn(_ConvNet())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 3, 12, 12)
    captured = api.capture(model, (x,))
    plan = api.plan(model, (x,), rules="fusion.conv_bn,fusion.conv_relu")
    assert {d.rule for d in plan.decisions} == {"fusion.conv_bn", "fusion.conv_relu"}
    gm = apply_plan(captured, plan).gm
    exported = export(gm, captured.example_inputs, captured.dynamic)
    targets = {n.target for n in exported[0].graph.nodes if n.op == "call_function"}
    assert torch.ops.opswap.conv_relu.default in targets  # the custom op, to be lowered
    art = export_onnx(None, captured.example_inputs, captured.dynamic, tmp_path, exported=exported)
    assert art.path == tmp_path / "model.onnx", art.error
    proto = onnx.load(str(art.path))
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count("Conv") == 2 and "Relu" in ops and "BatchNormalization" not in ops
    dims = proto.graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_value for d in dims][1] == 3 and dims[0].dim_param and dims[2].dim_param
    session = OrtModule(art.path)
    shapes = [("example", captured.example_inputs)] + variants(
        captured.example_inputs, captured.dynamic
    )
    shapes.append(("batch 5, 17x17", (torch.randn(5, 3, 17, 17),)))
    for _, xs in shapes:
        with torch.no_grad():
            want = model(*[t.clone() for t in xs])
        torch.testing.assert_close(session(*xs), want, atol=1e-5, rtol=1e-4)
    for k, v in model.state_dict().items():  # the user's module is untouched
        assert torch.equal(v, before[k]), k


@torch.library.custom_op("opswaptest::mystery", mutates_args=())
def _mystery(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_mystery.register_fake
def _(x):
    return torch.empty_like(x)


class _Mystery(nn.Module):
    def forward(self, x):
        return torch.ops.opswaptest.mystery(x).relu()


def test_an_op_without_lowering_fails_in_one_sentence_naming_it(tmp_path):
    x = torch.randn(2, 4)
    program, _, _ = export(_Mystery(), (x,))
    assert unlowered(program) == ["opswaptest::mystery"]
    with pytest.raises(ExportError, match=r"opswaptest::mystery, which has no ONNX lowering"):
        to_onnx(program, tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()
    art = export_onnx(_Mystery(), (x,), None, tmp_path)  # the artifact form never raises
    assert art.path is None and "opswaptest::mystery" in art.error
    assert len(art.error.splitlines()) == 1


class _Heads(nn.Module):
    """A dict, a tuple or a lone tensor out, as `kind` says."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.a, self.b = nn.Linear(6, 5), nn.Linear(5, 3)
        if kind == "named":  # a flat tuple named by the model, as models.hf.HFModule does
            self.opswap_output_names = ("logits", "hidden")

    def forward(self, x):
        h = torch.relu(self.a(x))
        y = self.b(h)
        if self.kind == "dict":
            return {"logits": y, "hidden": h}
        return (y, h) if self.kind in ("tuple", "named") else y


@pytest.mark.parametrize(
    ("kind", "names"),
    [
        ("dict", ["logits", "hidden"]),
        ("tuple", ["output_0", "output_1"]),
        ("named", ["logits", "hidden"]),
        ("tensor", ["output"]),
    ],
)
def test_outputs_keep_the_models_own_names_on_every_plan(tmp_path, kind, names):
    """The exporter names an output after the node that made it (linear_13 on one plan,
    linear_12 on another); the file names it after the model's output structure."""
    from torch.utils._pytree import tree_leaves

    from opswap.backends.onnx import output_names

    torch.manual_seed(0)
    model = _Heads(kind).eval()
    x = torch.randn(4, 6)
    for rules in (None, "fusion.*"):
        captured = api.capture(model, (x,))
        gm = apply_plan(captured, api.plan(model, (x,), rules=rules)).gm
        program = export(gm, captured.example_inputs, captured.dynamic)[0]
        assert output_names(program) == names
        path = to_onnx(program, tmp_path / f"{kind}_{rules}.onnx")
        assert [o.name for o in onnx.load(str(path)).graph.output] == names
        got, want = OrtModule(path)(x[:3]), model(x[:3])  # in the names' order, at batch 3
        torch.testing.assert_close(tree_leaves(got), tree_leaves(want), atol=1e-5, rtol=1e-4)


def test_int8_forms_are_named_by_the_runtime_as_the_cli_names_it(tmp_path):
    # `--export ort` beside `export_onnx(..., int8="qdq"|"integer")`: one vocabulary, the
    # runtime's name, with the forms' own names kept as the earlier spellings
    from opswap.backends.onnx import INT8_ALIASES, int8_form
    from opswap.graph.observers import QParams
    from opswap.rules.precision._int8_static_module import Int8StaticLinear

    assert {k: int8_form(k) for k in ("ort", "onnx", "openvino", "integer", "qdq")} == {
        "ort": "integer",
        "onnx": "qdq",
        "openvino": "qdq",
        "integer": "integer",
        "qdq": "qdq",
    }
    assert all(int8_form(old) == int8_form(new) for old, new in INT8_ALIASES.items())
    torch.manual_seed(3)
    model = Int8StaticLinear(torch.randn(7, 13) * 0.1, torch.randn(7), QParams(0.03, 120), True)
    x = torch.randn(5, 13)
    ops = {}
    for name in ("ort", "openvino"):
        (tmp_path / name).mkdir()
        art = export_onnx(model.eval(), (x,), None, tmp_path / name, int8=name)
        assert art.path is not None, art.error
        ops[name] = {n.op_type for n in onnx.load(str(art.path)).graph.node}
        got = OrtModule(art.path)(x)
        with torch.no_grad():
            torch.testing.assert_close(got, model(x), atol=0.02, rtol=0.02)
    assert "MatMulInteger" in ops["ort"] and "MatMulInteger" not in ops["openvino"]
    assert "DequantizeLinear" in ops["openvino"]
    with pytest.raises(ExportError, match=r"^int8='int4' names no runtime .*'ort'.*'qdq'"):
        export_onnx(model, (x,), None, tmp_path, int8="int4")
