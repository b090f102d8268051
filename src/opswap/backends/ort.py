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

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from opswap.backends.pt2 import Artifact
from opswap.errors import ExportError, InputError


def session(path: str | Path, threads: int | None = None, spinning: bool = False):
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
        text = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ExportError(f"ONNX Runtime could not load {Path(path).name}: {text}.") from e


class OrtModule(nn.Module):
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
        super().__init__()
        self.path = Path(path)
        self.out_spec = out_spec
        self.threads = threads
        self.spinning = spinning
        self.session_threads = threads or torch.get_num_threads()
        self.session = session(self.path, threads, spinning)
        # the program's inputs in order (an input the graph never reads is not in the file)
        self.input_names = list(names or [i.name for i in self.session.get_inputs()])
        self._fed = {i.name for i in self.session.get_inputs()}
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.training = False

    def __deepcopy__(self, memo):  # a session does not pickle: a copy opens its own
        return OrtModule(
            self.path,
            copy.deepcopy(self.out_spec, memo),
            self.threads,
            self.input_names,
            self.spinning,
        )

    def extra_repr(self) -> str:
        return f"{self.path.name}, inputs={', '.join(self.input_names)}"

    def forward(self, *args: Any) -> Any:
        name = self.path.name
        feed = numpy_feed(name, "on ONNX Runtime's CPU provider", self.input_names, self._fed, args)
        try:
            outs = self.session.run(self.output_names, feed)
        except Exception as e:  # ORT names the input, its rank or its size
            text = str(e).strip().splitlines()[0][:240] if str(e).strip() else type(e).__name__
            raise InputError(f"{name} refused the inputs: {text}.") from e
        return structured([torch.from_numpy(o) for o in outs], self.out_spec)


def numpy_feed(
    name: str, where: str, input_names: list[str], fed: set[str], args: tuple
) -> dict[str, Any]:
    """The runtime's input dict for a call with `args`: one CPU tensor per input name, as
    NumPy (inputs the file does not read are left out); a wrong count, device or dtype is
    one sentence. Shared by the ONNX Runtime and OpenVINO modules."""
    leaves = [x for x in pytree.tree_leaves(list(args)) if isinstance(x, torch.Tensor)]
    if len(leaves) != len(input_names):
        raise InputError(
            f"{name} takes {len(input_names)} input tensor(s) "
            f"({', '.join(input_names)}), got {len(leaves)}."
        )
    feed = {}
    for n, x in zip(input_names, leaves, strict=True):
        if x.device.type != "cpu" or x.dtype == torch.bfloat16:
            raise InputError(
                f"{name} runs {where} and takes CPU tensors NumPy can hold; input {n} is "
                f"{x.dtype} on {x.device}."
            )
        if n in fed:
            feed[n] = x.detach().contiguous().numpy()
    return feed


def structured(tensors: list[torch.Tensor], out_spec: Any) -> Any:
    """A runtime's outputs in the model's own structure (its pytree spec), or a tensor / tuple."""
    if out_spec is not None and out_spec.num_leaves == len(tensors):
        return pytree.tree_unflatten(tensors, out_spec)
    return tensors[0] if len(tensors) == 1 else tuple(tensors)


def ort_artifact(
    model: nn.Module | None,
    inputs: tuple,
    dynamic=None,
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
    from opswap.backends.pt2 import export

    if exported is None and model is not None:
        try:
            with torch.no_grad():
                exported = export(model, tuple(inputs), dynamic, runtime=True)
        except Exception as e:
            from opswap.backends.pt2 import _first_line

            return Artifact(None, None, error=f"torch.export failed: {_first_line(e)}")
    # static int8 Linears as MatMulInteger: the form ONNX Runtime runs as an int8 GEMM
    art = export_onnx(
        None, inputs, dynamic, directory, name, exported=exported, fusions=fusions, int8="ort"
    )
    if art.path is None:
        return art
    program = exported[0]
    names = list(program.graph_signature.user_inputs)
    try:
        art.module = OrtModule(art.path, program.call_spec.out_spec, names=names)
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
