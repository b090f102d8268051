"""Small ONNX graphs built in the tests (onnx.helper), saved and loaded as a user's file."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from opswap.onnx.load import load_onnx
from opswap.onnx.plan import plan_onnx
from opswap.onnx.runtime import verify


class Graphs:
    def __init__(self, tmp_path):
        self.tmp = tmp_path
        self.rng = np.random.default_rng(0)
        self.count = 0

    def const(self, name: str, value) -> onnx.NodeProto:
        return helper.make_node(
            "Constant", [], [name], value=numpy_helper.from_array(np.asarray(value, np.float32))
        )

    def weight(self, *shape: int, scale: float = 0.3) -> np.ndarray:
        return (self.rng.standard_normal(shape) * scale).astype(np.float32)

    def proto(self, nodes, inputs, outputs, inits=None, opset=17, domains=()):
        g = helper.make_graph(
            nodes,
            "g",
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, d) for n, d in inputs],
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
            [numpy_helper.from_array(np.asarray(v), k) for k, v in (inits or {}).items()],
        )
        ops = [helper.make_opsetid("", opset), *(helper.make_opsetid(d, 1) for d in domains)]
        return helper.make_model(g, opset_imports=ops, ir_version=8)

    def save(self, proto, **kw) -> str:
        self.count += 1
        path = self.tmp / f"m{self.count}.onnx"
        onnx.save(proto, str(path), **kw)
        return str(path)

    def load(self, nodes, inputs, outputs, inits=None, opset=17, sizes=None):
        return load_onnx(self.save(self.proto(nodes, inputs, outputs, inits, opset)), sizes)

    def apply(self, loaded, rules):
        """The plan of `rules` on `loaded`, the rewritten model, and its op types."""
        plan, out = plan_onnx(loaded, rules)
        return plan, out, [n.op_type for n in out.graph.node]

    def matches(self, loaded, out, *more: dict[str, int]) -> bool:
        """The rewrite's outputs match the original's in ORT at the example sizes and at `more`."""
        check = verify(loaded, out, [loaded.sizes, *more], "exact", 2)
        assert check.passed, check.reasons
        return check.passed


@pytest.fixture
def graphs(tmp_path) -> Graphs:
    return Graphs(tmp_path)


#: the peer comparison's models: tiny configs (2 layers, hidden 64, 4 heads) with their
#: padding masks, exported with the legacy (TorchScript) exporter, the one ORT's
#: transformer optimizer is written for, and a few times faster than the dynamo one
EXPORTS = {
    "bert": ("hf:bert", {}, "legacy"),
    "gpt2": ("hf:gpt2", {}, "legacy"),
    "vit": ("hf:vit", {}, "legacy"),
}


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """kind -> path of its .onnx export, made once per test session."""
    from opswap.onnx.hf_export import export_spec

    made: dict[str, str] = {}
    root = tmp_path_factory.mktemp("exports")

    def get(kind: str) -> str:
        if kind not in made:
            spec, sets, exporter = EXPORTS[kind]
            made[kind] = str(export_spec(spec, root / f"{kind}.onnx", sets, exporter=exporter))
        return made[kind]

    return get


def detector(path, opset: int = 17, metadata: dict[str, str] | None = None) -> str:
    """A YOLO-style detector in miniature, exported with symbolic batch, height and width:
    five stride-2 convolutions (stride 32), the deepest map upsampled twice and joined to
    the stride-16 one, a 1x1 head. It runs where height and width are multiples of 32 (and
    some others), not at 16x16: the upsampled map and the one it joins differ there."""
    import torch
    from torch import nn

    class Det(nn.Module):
        def __init__(self):
            super().__init__()
            c = 4
            self.stem = nn.Sequential(nn.Conv2d(3, c, 3, 2, 1), nn.SiLU())
            self.down = nn.ModuleList(
                nn.Sequential(nn.Conv2d(c, c, 3, 2, 1), nn.SiLU()) for _ in range(4)
            )
            self.up = nn.Upsample(scale_factor=2.0, mode="nearest")
            self.head = nn.Conv2d(2 * c, 6, 1)

        def forward(self, x):
            x = self.stem(x)
            maps = []
            for m in self.down:
                x = m(x)
                maps.append(x)
            joined = torch.cat([self.up(maps[-1]), maps[-2]], 1)
            return self.head(joined).flatten(2).transpose(1, 2)  # [batch, boxes, 6]

    torch.manual_seed(0)
    torch.onnx.export(
        Det().eval(),
        (torch.randn(1, 3, 64, 64),),
        str(path),
        input_names=["images"],
        output_names=["boxes"],
        dynamic_axes={"images": {0: "batch", 2: "height", 3: "width"}},
        opset_version=opset,
        dynamo=False,
    )
    if metadata:
        proto = onnx.load(str(path))
        helper.set_model_props(proto, metadata)
        onnx.save(proto, str(path))
    return str(path)
