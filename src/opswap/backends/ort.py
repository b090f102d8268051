"""ONNX Runtime as a place to run the model: a session over an .onnx file, wrapped as a
module that takes and returns torch tensors, so that verification and the race treat
it like any other variant.

    from opswap.backends.ort import ort_artifact
    art = ort_artifact(model, inputs, captured.dynamic)   # exported, then loaded in ORT
    y = art.module(x)                                     # runs in onnxruntime

The session runs on the CPU execution provider with every graph optimisation on
(ORT_ENABLE_ALL: constant folding, Conv + BatchNorm / Relu fusion, GELU, LayerNorm and
attention fusions where ORT finds them) and as many intra-op threads as torch uses
here (the machine's cores, unless the user set fewer), so that it races the PyTorch
variants on the same cores. Inputs go in as NumPy views of the tensors (no copy for a
contiguous CPU tensor) and outputs come back the same way; IO binding would only save
these views on the CPU. Outputs are put back into the structure the model returns (a
tuple, a dict, a ModelOutput) from the exported program's output spec.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from opswap.backends.onnx import holds
from opswap.backends.pt2 import Artifact
from opswap.backends.registry import Deploy, Runtime, register
from opswap.backends.runtime_module import (
    RuntimeModule,
    exported_program,
    first_line,
    numpy_feed,
)
from opswap.errors import ExportError, InputError

if TYPE_CHECKING:
    import onnxruntime as ort

    from opswap.backends.pt2 import Exported
    from opswap.graph.dynamic import Dynamic


def session(
    path: str | Path, threads: int | None = None, spinning: bool = False
) -> ort.InferenceSession:
    """An onnxruntime.InferenceSession over `path` on the CPU, ORT_ENABLE_ALL, with
    `threads` intra-op threads (default: torch's thread count).

    `spinning`: whether ORT's intra-op threads spin-wait for work after a run (ORT's
    default, and what a process that runs only this model wants). Off by default, for the
    race: timed between PyTorch variants in one process, the spinning threads take the
    cores from whatever runs next, and from ORT itself. Measured on the 2-core VNNI VM
    (ResNet-50-size int8 model, 2026-12-05): with spinning, the torch int8 model took
    47.6 ms right after an ORT call against 22.9 on its own, and ORT's int8 file 40.3 ms
    right after a torch call against 26.5 on its own; without spinning, 22.1 and 30.2
    against 23.8 and 30.2. So the race times ORT without spinning (at most that run's
    14% slower than ORT alone with it) and every variant without the other's threads in
    its way; a saved file loaded for use (`opswap.load_optimized`) spins."""
    try:
        import onnxruntime as ort
    except ImportError as e:
        raise ExportError(
            "Running in ONNX Runtime needs onnxruntime; install it with pip install 'opswap[onnx]'."
        ) from e
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = threads or torch.get_num_threads()
    # fatal only: ORT warns about every unused initializer, and logs a failed run as an
    # error line besides raising it, which opswap says in its own words where it matters
    opts.log_severity_level = 4
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    try:
        return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise ExportError(f"ONNX Runtime could not load {Path(path).name}: {first_line(e)}.") from e


class OrtModule(RuntimeModule):
    """An ONNX Runtime session called like the module it was exported from: positional
    tensors in (the program's inputs, in order), the model's output structure out."""

    def __init__(
        self,
        path: str | Path,
        out_spec: Any = None,
        threads: int | None = None,
        names: list[str] | None = None,
        spinning: bool = False,
    ):
        super().__init__(path, out_spec, threads)
        self.spinning = spinning
        self.session = session(self.path, threads, spinning)
        # the program's inputs in order (an input the graph never reads is not in the file)
        self.input_names = list(names or [i.name for i in self.session.get_inputs()])
        self._fed = {i.name for i in self.session.get_inputs()}
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.reopen = {"names": self.input_names, "spinning": spinning}

    def run(self, args: tuple) -> list[torch.Tensor]:
        name = self.path.name
        feed = numpy_feed(name, "on ONNX Runtime's CPU provider", self.input_names, self._fed, args)
        try:
            outs = self.session.run(self.output_names, feed)
        except Exception as e:  # ORT names the input, its rank or its size
            raise InputError(f"{name} refused the inputs: {first_line(e, 240)}.") from e
        return [torch.from_numpy(o) for o in outs]


def ort_artifact(
    model: nn.Module | None,
    inputs: tuple,
    dynamic: Dynamic | None = None,
    directory: str | Path | None = None,
    *,
    exported: Any = None,
    fusions: bool = False,
    name: str = "model.onnx",
) -> Artifact:
    """`model` (or `exported`, backends.pt2's (program, note, kept) of it) exported to
    ONNX and loaded in an ONNX Runtime session: an Artifact whose `module` is the
    OrtModule, the file that is timed; never raises (its `error` says why)."""
    from opswap.backends.onnx import export_onnx
    from opswap.backends.pt2 import _first_line

    exported, why = exported_program(
        model, inputs, dynamic, exported, reason=_first_line, needs="export_onnx"
    )
    if why is not None:
        return Artifact(None, None, error=why)
    # static int8 Linears as MatMulInteger: the form ONNX Runtime runs as an int8 GEMM
    art = export_onnx(
        None, inputs, dynamic, directory, name, exported=exported, fusions=fusions, int8="ort"
    )
    if art.path is None:
        return art
    try:
        art.module = OrtModule.of_program(art.path, exported[0])
    except ExportError as e:
        if not fusions:
            art.error = str(e)
            return art
        # onnxscript's fusions can leave a graph ORT refuses (a Gemm on a rank-3 input):
        # the file is written again without them, and the note says so
        plain = ort_artifact(None, inputs, dynamic, directory, exported=exported, name=name)
        why = str(e).removesuffix(".")
        plain.note = "; ".join(
            filter(None, [plain.note, f"written without onnxscript's ORT fusions ({why})"])
        )
        return plain
    return art


@register
class OnnxRuntime(Runtime):
    """ONNX Runtime on its CPU provider: `ort` and `opswap+ort` (opswap's file with
    onnxscript's ORT fusions), `--export onnx|ort` saves model.onnx."""

    name = "ort"
    title = "ONNX Runtime"
    rank = 10
    file = "model.onnx"
    beside = ("{name}.data",)  # past 2 GB of weights; the model names it
    needs = ("onnxruntime", "onnxscript")
    extra = "onnx"
    runs = "ONNX Runtime runs on its CPU provider"
    exports = ("onnx", "ort")
    saves = "an .onnx file"
    exported_as = "ONNX"
    # static int8 Linears as MatMulInteger, with onnxscript's fusions where ORT takes them
    layer_forms = (("integer", True), ("integer", False))
    left_out = (
        ("precision.autocast", "precision.bf16", "precision.fp16"),
        "a file for ONNX Runtime's CPU provider, which has no bfloat16 or float16 GEMM",
    )

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
        # onnxscript's fusions write com.microsoft ops: opswap's file for ORT, not a plain one
        fusions = mine and not portable
        return ort_artifact(model, inputs, dynamic, exported=exported, fusions=fusions)

    def load(self, path: Path) -> nn.Module:
        # outputs as a tensor or a tuple (the file has no pytree); a session for use, its
        # threads spinning as ORT's default has them (see `session`)
        return OrtModule(path, spinning=True)

    def deploy(self, mine: bool, file: str) -> Deploy:
        return Deploy(
            holds(mine, self.title),
            f'onnxruntime.InferenceSession("DIR/{file}", providers=["CPUExecutionProvider"]) '
            "with graph_optimization_level ORT_ENABLE_ALL, or opswap.load_optimized(DIR)",
            "onnxruntime (CPU execution provider)",
        )

    def read_values(self, path: Path, names: list[str], feed: dict) -> dict[str, Any]:
        import onnx

        model = onnx.load(str(path))  # external data too: the marked copy is written whole
        have = {o.name for o in model.graph.output}
        for n in names:
            if n not in have:
                model.graph.output.append(onnx.ValueInfoProto(name=n))
        with tempfile.TemporaryDirectory(prefix="opswap-layers-") as tmp:
            marked = Path(tmp) / "marked.onnx"
            # past protobuf's 2 GB the weights go to a data file beside the copy
            onnx.save(model, str(marked), save_as_external_data=model.ByteSize() > 2**31 - 2**26)
            sess = session(marked)
            wanted = [n for n in names if n in {o.name for o in sess.get_outputs()}]
            fed = {i.name for i in sess.get_inputs()}
            try:
                outs = sess.run(wanted, {k: v for k, v in feed.items() if k in fed})
            except Exception as e:
                raise ExportError(
                    f"ONNX Runtime could not run {path.name}'s layers: {first_line(e)}."
                ) from e
        return dict(zip(wanted, outs, strict=True))
