"""OpenVINO as a place to run the model: the .onnx file the ONNX Runtime path writes,
compiled by OpenVINO for the CPU and wrapped as a module that takes and returns torch
tensors, so that verification and the race treat it like any other variant.

    from opswap.backends.openvino import openvino_artifact
    art = openvino_artifact(model, inputs, captured.dynamic)   # exported, then compiled
    y = art.module(x)                                          # runs in OpenVINO

The file is backends.onnx's export without onnxscript's ORT fusions (their
com.microsoft contrib ops are ONNX Runtime's own, which OpenVINO does not read), so
the axes the capture keeps dynamic stay dynamic in the compiled model. It is compiled
with `openvino.Core().compile_model(model, "CPU")` under the latency hint, float32
inference precision (OpenVINO would otherwise run float32 models in bfloat16 on CPUs
that have it, and fail verification for a reason that is not the model's) and as many
threads as torch uses here, so that it races the PyTorch variants on the same cores.
Inputs go in as NumPy views of the tensors, outputs come back copied out of the
request's buffers and are put back into the structure the model returns (a tuple, a
dict, a ModelOutput) from the exported program's output spec, as backends.ort does.

With `ir=True` (what `--export openvino` races) the .onnx file is converted to
OpenVINO's own format, the IR: model.xml (the graph) and model.bin (the weights, kept
in float32: `openvino.save_model` would halve them to float16 by default), and the IR is
what is compiled and timed, so the file saved is the one timed. The IR carries the
model's output structure and input names in its runtime info (`opswap/out_spec`,
`opswap/inputs`), so an OpenVinoModule loaded from model.xml alone
(`opswap.load_optimized`) returns what the model returns.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from torch.utils import _pytree as pytree

from opswap.backends import registry
from opswap.backends.onnx import holds
from opswap.backends.pt2 import Artifact
from opswap.backends.registry import Deploy, Runtime, register
from opswap.backends.runtime_module import (
    RuntimeModule,
    exported_program,
    first_line,
    numpy_feed,
    require,
)
from opswap.errors import ExportError, InputError

if TYPE_CHECKING:
    import openvino as ov

    from opswap.backends.pt2 import Exported
    from opswap.graph.dynamic import Dynamic

#: where the IR keeps what opswap needs to call it like the model (its runtime info)
_SPEC, _INPUTS = ["opswap", "out_spec"], ["opswap", "inputs"]


def _openvino() -> ModuleType:
    require("OpenVINO", "openvino", "openvino", "openvino")
    import openvino as ov

    return ov


def read_model(path: str | Path) -> ov.Model:
    """An openvino.Model of the .onnx or .xml file `path`."""
    ov = _openvino()
    try:
        return ov.Core().read_model(str(path))
    except Exception as e:
        raise ExportError(f"OpenVINO could not compile {Path(path).name}: {first_line(e)}.") from e


def compile_model(model: ov.Model, name: str, threads: int | None = None) -> ov.CompiledModel:
    ov = _openvino()
    config = {
        "PERFORMANCE_HINT": "LATENCY",
        "INFERENCE_PRECISION_HINT": "f32",
        "INFERENCE_NUM_THREADS": int(threads or torch.get_num_threads()),
    }
    try:
        return ov.Core().compile_model(model, "CPU", config)
    except Exception as e:
        raise ExportError(f"OpenVINO could not compile {name}: {first_line(e)}.") from e


def compile_file(path: str | Path, threads: int | None = None) -> ov.CompiledModel:
    """An openvino.CompiledModel of the .onnx or .xml file `path` on the CPU: latency hint,
    float32 inference precision, `threads` threads (default: torch's thread count)."""
    return compile_model(read_model(path), Path(path).name, threads)


def save_ir(
    onnx_path: str | Path,
    xml_path: str | Path,
    out_spec: Any = None,
    names: list[str] | None = None,
) -> Path:
    """The .onnx file `onnx_path` converted to OpenVINO's IR at `xml_path` (the weights in
    the .bin file beside it, float32 as they are), with the model's output structure and
    input names in its runtime info. Raises ExportError with the reason."""
    ov = _openvino()
    model = read_model(onnx_path)
    xml = Path(xml_path)
    if out_spec is not None:
        try:
            model.set_rt_info(pytree.treespec_dumps(out_spec), _SPEC)
        except Exception:  # a type pytree cannot name: the loaded IR returns a tuple
            pass
    if names:
        model.set_rt_info(",".join(names), _INPUTS)
    try:
        ov.save_model(model, str(xml), compress_to_fp16=False)
    except Exception as e:
        for p in (xml, xml.with_suffix(".bin")):
            p.unlink(missing_ok=True)
        raise ExportError(f"OpenVINO could not write {xml.name}: {first_line(e)}.") from e
    return xml


def _stored(model: ov.Model) -> tuple[Any, list[str] | None]:
    """The output spec and input names an IR opswap wrote keeps in its runtime info."""
    spec = names = None
    try:
        if model.has_rt_info(_SPEC):
            spec = pytree.treespec_loads(model.get_rt_info(_SPEC).astype(str))
    except Exception:  # a type not registered in this process: outputs come as a tuple
        spec = None
    if model.has_rt_info(_INPUTS):
        names = model.get_rt_info(_INPUTS).astype(str).split(",")
    return spec, names


class OpenVinoModule(RuntimeModule):
    """An OpenVINO compiled model called like the module it was exported from: positional
    tensors in (the program's inputs, in order), the model's output structure out. `path`
    is an .onnx file or an IR's model.xml; an IR opswap wrote gives its output structure
    and input names back when `out_spec` and `names` are not passed."""

    def __init__(
        self,
        path: str | Path,
        out_spec: Any = None,
        threads: int | None = None,
        names: list[str] | None = None,
    ):
        super().__init__(path, out_spec, threads)
        model = read_model(self.path)
        spec, stored = _stored(model)
        self.out_spec = out_spec if out_spec is not None else spec
        self.compiled = compile_model(model, self.path.name, threads)
        self.request = self.compiled.create_infer_request()
        fed = [p.get_any_name() for p in self.compiled.inputs]
        # the program's inputs in order (an input the graph never reads is not in the file)
        self.input_names = list(names or stored or fed)
        self._fed = set(fed)
        self.reopen = {"names": self.input_names}

    def run(self, args: tuple) -> list[torch.Tensor]:
        name = self.path.name
        feed = numpy_feed(name, "in OpenVINO on the CPU", self.input_names, self._fed, args)
        try:
            res = self.request.infer(feed, share_inputs=True, share_outputs=False)
        except Exception as e:  # OpenVINO names the input and the shape it refused
            raise InputError(f"{name} refused the inputs: {first_line(e, 240)}.") from e
        return [torch.from_numpy(res[p]) for p in self.compiled.outputs]


def openvino_artifact(
    model: nn.Module | None,
    inputs: tuple,
    dynamic: Dynamic | None = None,
    directory: str | Path | None = None,
    *,
    exported: Any = None,
    ir: bool = False,
    name: str = "model.onnx",
) -> Artifact:
    """`model` (or `exported`, backends.pt2's (program, note, kept) of it) exported to
    ONNX without ORT's fusions and compiled by OpenVINO: an Artifact whose `module` is the
    OpenVinoModule over the file that is timed (with `ir`, the IR model.xml the .onnx file
    is converted to, which replaces it); never raises (its `error` says why)."""
    from opswap.backends.onnx import export_onnx

    exported, why = exported_program(model, inputs, dynamic, exported, needs="export_onnx")
    if why is not None:
        return Artifact(None, None, error=why)
    art = export_onnx(None, inputs, dynamic, directory, name, exported=exported)
    if art.path is None:
        return art
    program = exported[0]
    names = list(program.graph_signature.user_inputs)
    try:
        if ir:
            onnx = art.path
            art.path = save_ir(onnx, onnx.with_suffix(".xml"), program.call_spec.out_spec, names)
            for p in (onnx, onnx.with_name(onnx.name + ".data")):
                p.unlink(missing_ok=True)
            if art.note:
                art.note = art.note.replace(onnx.name, art.path.name)
        art.module = OpenVinoModule.of_program(art.path, program)
    except ExportError as e:
        art.error = str(e)
        art.module = None
    return art


@register
class OpenVino(Runtime):
    """OpenVINO on the CPU: `openvino` and `opswap+openvino` time the .onnx files (without
    ORT's contrib ops); `--export openvino` races and saves OpenVINO's IR, model.xml."""

    name = "openvino"
    title = "OpenVINO"
    rank = 20
    file = "model.xml"
    race_file = "model.onnx"
    beside = ("{stem}.bin",)  # the IR's weights: OpenVINO reads NAME.bin beside NAME.xml
    needs = ("openvino", "onnxscript")
    extra = "openvino"
    runs = "OpenVINO runs"
    exports = ("openvino",)
    saves = "an OpenVINO IR (model.xml)"
    exported_as = "OpenVINO IR"
    reload = True  # loaded back in a fresh Core from DIR, as a user opens it
    layer_forms = (("qdq", False),)

    def build(
        self,
        model: nn.Module | None,
        inputs: tuple,
        dynamic: Dynamic | None = None,
        *,
        exported: Exported | None = None,
        mine: bool = True,
        export: bool = False,
        portable: bool = False,
    ) -> Artifact:
        return openvino_artifact(model, inputs, dynamic, exported=exported, ir=export)

    def load(self, path: Path) -> nn.Module:
        return OpenVinoModule(path)  # the model's output structure, kept in the IR

    def deploy(self, mine: bool, file: str) -> Deploy:
        if not file.endswith(".xml"):  # the race's .onnx file, which ONNX Runtime loads back
            return Deploy(
                holds(mine, self.title),
                f'openvino.Core().compile_model("DIR/{file}", "CPU", '
                '{"INFERENCE_PRECISION_HINT": "f32"}) (the settings it was timed and verified '
                "under), or opswap.load_optimized(DIR), which runs the same file in ONNX Runtime",
                "openvino (CPU)",
            )
        return Deploy(
            registry.holds(mine, "as OpenVINO IR (float32)"),
            f'openvino.Core().compile_model("DIR/{file}", "CPU", '
            '{"INFERENCE_PRECISION_HINT": "f32"}) (the settings it was timed and verified under; '
            "model.bin beside it holds the weights), or opswap.load_optimized(DIR), which "
            "compiles it the same way and returns your model's output structure",
            "openvino (CPU)",
        )

    def read_values(self, path: Path, names: list[str], feed: dict) -> dict[str, Any]:
        model = read_model(path)
        for n in names:
            try:
                model.add_outputs([n])
            except Exception:  # folded or renamed while the file was read
                continue
        compiled = compile_model(model, path.name)
        request = compiled.create_infer_request()
        fed = {p.get_any_name() for p in compiled.inputs}
        try:
            request.infer({k: v for k, v in feed.items() if k in fed}, share_inputs=True)
        except Exception as e:
            raise ExportError(
                f"OpenVINO could not run {path.name}'s layers: {first_line(e)}."
            ) from e
        out: dict[str, Any] = {}
        for port in compiled.outputs:
            for n in port.get_names():
                if n in names:
                    out[n] = np.array(request.get_tensor(port).data, copy=True)
        return out
