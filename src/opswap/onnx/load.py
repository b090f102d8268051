"""Reading a `.onnx` file made by another tool: checks, external data, shapes, the inputs.

`load_onnx(path)` reads the file (and the external data files beside it), refuses in one
sentence a missing file and a file that is not ONNX, converts a default-domain opset
outside 13..21 to the nearest of the two with onnx's version converter (and says so; the
file as given stays the reference), and runs ONNX's shape inference where the file
carries no value_info, so that the rules can read ranks and sizes. The graph's inputs are
described by `InputSpec`: dtype and dims, a dim that is a name (`batch`, `sequence`) or
missing is symbolic, and its size is given by the user (`sizes`) or chosen where the
model fits in memory and runs (opswap.onnx.sizes).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opswap.errors import SpecError
from opswap.onnx.model import InputSpec, OnnxModel
from opswap.onnx.sizes import example_sizes, fit, other_sizes, runnable

if TYPE_CHECKING:
    pass

#: the default-domain opsets the rules are written and tested for
OPSETS = (13, 21)


def _onnx():
    try:
        import onnx
    except ImportError:  # pragma: no cover - the extra is installed in CI
        raise SpecError("Reading .onnx files needs onnx: pip install 'opswap[onnx]'.") from None
    return onnx


def load_onnx(
    path: str | os.PathLike, sizes: dict[str, Any] | None = None, *, probe: bool = True
) -> OnnxModel:
    """The model at `path`, checked, with external data and inferred shapes; `sizes` names
    the example size of symbolic dims (`{"batch": 1, "sequence": 128}`); the others are
    chosen. Sizes that would not fit in memory are refused before anything is allocated;
    with `probe`, the model is run once at the sizes, and where it does not run there,
    sizes it runs at are picked for the dims not given (and `notes` says which)."""
    onnx = _onnx()
    p = Path(os.path.expanduser(os.fspath(path)))
    if not p.is_file():
        raise SpecError(f"{p} does not exist; give the path of an .onnx file.")
    try:
        proto = onnx.load(str(p), load_external_data=True)
    except FileNotFoundError as e:
        raise SpecError(
            f"{p} names an external data file that is missing ({e.filename}); keep the data "
            "files in the directory of the .onnx file."
        ) from None
    except Exception as e:  # protobuf's DecodeError and friends: not ONNX
        if "external" in str(e).lower() or "data file" in str(e).lower():
            raise SpecError(
                f"{p} names an external data file that is missing or unreadable "
                f"({str(e).splitlines()[0][:160]}); keep the data files beside the .onnx file."
            ) from None
        raise SpecError(
            f"{p} is not an ONNX model ({type(e).__name__}); give a file written by onnx.save "
            "or an exporter."
        ) from None
    if not proto.graph.node:
        raise SpecError(f"{p} holds no graph nodes; it is not an ONNX model opswap can optimize.")
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    given, was = None, opset
    if not OPSETS[0] <= opset <= OPSETS[1]:
        given, opset = proto, OPSETS[0] if opset < OPSETS[0] else OPSETS[1]
        proto = _convert(onnx, proto, p, was, opset)
    inferred = not proto.graph.value_info  # the file carried no shapes of its own
    proto = _infer(onnx, proto, p)  # and where it carried some, the gaps are filled
    inputs = _inputs(onnx, proto)
    model = OnnxModel(proto, p, opset, inputs, inferred=inferred, given=given)
    if given is not None:
        model.notes.append(
            f"{p.name} uses ONNX opset {was}; opswap's ONNX rules take {OPSETS[0]} to "
            f"{OPSETS[1]}, so it was converted to opset {opset} with "
            "onnx.version_converter, and verified against the file as given."
        )
    model.sizes = example_sizes(model, sizes or {})
    fit(model, model.sizes)  # before anything is allocated
    if probe:
        model.sizes = runnable(model, sizes or {})
    return model


def _convert(onnx, proto, p: Path, opset: int, target: int):
    """`proto` at opset `target`, by onnx's version converter; refused in one sentence when
    it cannot convert."""
    from onnx import version_converter

    try:
        out = version_converter.convert_version(proto, target)
    except Exception as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise SpecError(
            f"{p} uses ONNX opset {opset}, and onnx's version converter cannot bring it to "
            f"opset {target} ({first}); opswap's ONNX rules take opsets {OPSETS[0]} to "
            f"{OPSETS[1]}: export it again at one of those."
        ) from None
    return out


def _infer(onnx, proto, p: Path):
    """ONNX's shape inference, then ONNX Runtime's symbolic one where it is installed: it
    carries named dims through Shape/Gather/Concat arithmetic (the legacy exporter's
    reshapes), where ONNX's leaves unknown dims that no rule can prove equal."""
    proto = _onnx_infer(onnx, proto, p)
    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference
    except ImportError:  # pragma: no cover - onnxruntime comes with the extra
        return proto
    try:
        return SymbolicShapeInference.infer_shapes(proto, auto_merge=True) or proto
    except Exception:  # a model it cannot follow keeps ONNX's shapes
        return proto


def _onnx_infer(onnx, proto, p: Path):
    try:
        return onnx.shape_inference.infer_shapes(proto, data_prop=True)
    except ValueError:  # a model past 2 GB cannot be serialised for inference: do it on disk
        out = p.with_name(p.stem + ".opswap-shapes.onnx")
        onnx.shape_inference.infer_shapes_path(str(p), str(out), data_prop=True)
        try:
            return onnx.load(str(out), load_external_data=True)
        finally:
            out.unlink(missing_ok=True)
    except Exception as e:
        raise SpecError(f"{p} fails ONNX shape inference ({str(e).splitlines()[0]}).") from None


def _table_rows(proto) -> dict[str, int]:
    """Graph value -> rows of the constant tables it indexes (Gather's indices), the least."""
    rows = {i.name: int(i.dims[0]) for i in proto.graph.initializer if i.dims}
    out: dict[str, int] = {}
    for n in proto.graph.node:
        if n.op_type == "Gather" and len(n.input) > 1 and n.input[0] in rows:
            out[n.input[1]] = min(out.get(n.input[1], rows[n.input[0]]), rows[n.input[0]])
    return out


def _inputs(onnx, proto) -> list[InputSpec]:
    inits = {i.name for i in proto.graph.initializer}
    tables = _table_rows(proto)
    out = []
    for v in proto.graph.input:
        if v.name in inits:
            continue  # an initializer listed as input (IR version 3): a weight, not an input
        t = v.type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name
        dims: list[int | str] = []
        for j, d in enumerate(t.shape.dim):
            if d.HasField("dim_value"):
                dims.append(int(d.dim_value))
            else:
                dims.append(d.dim_param or f"{v.name}_dim{j}")
        out.append(InputSpec(v.name, dtype, tuple(dims), tables.get(v.name)))
    return out


__all__ = ["InputSpec", "OnnxModel", "example_sizes", "load_onnx", "other_sizes"]
