"""Layer by layer inside a runtime: where does the exported file, run by ONNX Runtime or
OpenVINO, start to differ from PyTorch running the same graph?

    from opswap.backends.runtime_layers import runtime_layers
    report = runtime_layers(program, "ort", inputs)   # a verify.layers.LayerReport
    print(report.table(mark=report.first_divergence("exact")))

The exporter names each ONNX value after the node of the exported program that made
it (`linear_3`, `softmax`, `add_7`), so the two sides pair by name without guessing:
the program runs once in PyTorch (float32, as the file does) keeping every node's
output, and the file runs once in the runtime with every value it has under such a
name added to its outputs. Rows come in the program's order; nodes the exporter folded
or merged have no value in the file and are listed as only in the reference.

Marking a value as an output keeps the runtime from fusing across it (a fused kernel
never writes its intermediates), as with any tool that reads a runtime's intermediates:
the file runs here with fewer fusions than it runs with for the user. A difference that
comes from a fusion therefore shows at the outputs (verification) and not in these rows,
and the note says so. ExecuTorch keeps what its XNNPACK delegate computes inside the
delegate, so it has no rows here.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from opswap.backends import registry
from opswap.backends.runtime_module import numpy_feed
from opswap.errors import ExportError
from opswap.graph.copies import preserved_state
from opswap.graph.inputs import fresh
from opswap.graph.ops import op_kind
from opswap.verify.layers import (
    LayerReport,
    LayerRow,
    Recorder,
    compute_nodes,
    flat_args,
    module_path,
)
from opswap.verify.metrics import compare
from opswap.verify.outputs import full_precision, same_random

if TYPE_CHECKING:
    from torch.export import ExportedProgram

#: the runtimes whose intermediate values opswap reads (those with a layer reader)
RUNTIMES = tuple(r.name for r in registry.runtimes() if r.layer_forms)

#: what the rows mean, for whoever prints them
NOTE = (
    "each value the file keeps, run in the runtime with that value marked as an output "
    "(which keeps the runtime from fusing across it), against the same node of the "
    "exported program run in PyTorch"
)


def _file_values(path: Path) -> list[str]:
    """Every value an .onnx file's nodes produce, in the file's order (the graph's own
    outputs among them)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return [o for node in model.graph.node for o in node.output if o]


def runtime_layers(
    program: ExportedProgram,
    runtime: str,
    inputs: tuple,
    *,
    int8: str | None = None,
    fusions: bool = False,
) -> LayerReport:
    """Translate `program` (an ExportedProgram) to ONNX as the `runtime` ("ort" or
    "openvino") file is written (static int8 Linears in the form for that runtime, or for
    the runtime `int8` names: backends.onnx.int8_form; onnxscript's ORT fusions when
    `fusions`), run it there on `inputs`, and compare every value the file
    keeps with the same node of the translated program run in PyTorch. Raises ExportError
    for another runtime, or a program the exporter or the runtime refuses."""
    from opswap.backends.onnx import translate

    if runtime not in RUNTIMES:
        raise ExportError(
            f"Layer-by-layer comparison reads intermediate values from {' or '.join(RUNTIMES)}; "
            f"{runtime} keeps them inside its delegate."
        )
    onnx_program = translate(program, fusions=fusions, int8=int8 or runtime)
    # the decomposed program the exporter translated: its node names are the file's names
    translated = onnx_program.exported_program
    gm = translated.module()
    nodes = compute_nodes(gm)
    inputs = tuple(inputs)
    with tempfile.TemporaryDirectory(prefix="opswap-layers-") as tmp:
        path = Path(tmp) / "model.onnx"
        onnx_program.save(str(path))
        in_file = set(_file_values(path))
        names = [n.name for n in nodes if n.name in in_file]

        ref: dict[str, torch.Tensor] = {}

        def keep(name: str, ts: list[torch.Tensor]) -> None:
            if len(ts) == 1:  # a node of several outputs is compared through its getitems
                ref[name] = ts[0].detach().clone()

        with torch.no_grad(), full_precision(), preserved_state(gm), same_random(0):
            Recorder(gm, set(names), keep).run(*flat_args(gm, fresh(inputs)))
        user = list(translated.graph_signature.user_inputs)
        leaves = [x for x in flat_args(gm, inputs) if isinstance(x, torch.Tensor)]
        feed = numpy_feed(path.name, "in the runtime", user, set(user), tuple(leaves))
        wanted = [n for n in names if n in ref]
        got = registry.get(runtime).read_values(path, wanted, feed)

    rows: list[LayerRow] = []
    only_ref: list[str] = []
    for n in nodes:
        kind, where = op_kind(n), module_path(n)
        if n.name not in ref:
            note = "not in the file (folded or merged by the exporter)"
            if n.name in in_file:
                note = "several outputs, compared through the nodes that take them apart"
            else:
                only_ref.append(n.name)
            rows.append(LayerRow(n.name, where, kind, None, note=note))
            continue
        if n.name not in got:
            rows.append(LayerRow(n.name, where, kind, None, note="folded by the runtime"))
            only_ref.append(n.name)
            continue
        value = torch.from_numpy(np.ascontiguousarray(got[n.name]))
        r = ref[n.name]
        if tuple(value.shape) != tuple(r.shape):
            note = f"shapes differ: {tuple(value.shape)} in the runtime, {tuple(r.shape)} here"
            rows.append(LayerRow(n.name, where, kind, None, n.name, "name", note))
            continue
        rows.append(LayerRow(n.name, where, kind, compare(r, value), n.name, "name"))
    return LayerReport(rows, only_ref, [])
