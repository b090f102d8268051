"""The sizes an ONNX model is run at: a size for every symbolic dim, checked to fit in memory
and to run before anything is drawn or timed.

`example_sizes` takes the sizes the user gave and picks the rest (2 for a leading batch
dim, 16 for the others). `fit` refuses, in one sentence, sizes whose inputs and largest
intermediate would not fit in the memory that is free, before a byte is allocated.
`runnable` runs the model once at the sizes: when it does not run there and the user did
not give them, it tries the sizes the file implies (an image size in its metadata, the
scales of its constant-size Resizes) and then common image sizes, in turn, and keeps the
first it runs at, saying so. `other_sizes` gives the verification's other size sets
(batch 1; a larger batch at another length), each one the model runs at.
"""

from __future__ import annotations

import math
import os
import re
from typing import TYPE_CHECKING, Any

import numpy as np

from opswap.errors import SpecError

if TYPE_CHECKING:
    from opswap.onnx.model import OnnxModel

#: image sizes tried in turn for the height and width of an image input
IMAGE_SIZES = (224, 256, 320, 384, 416, 448, 512, 640)
#: lengths tried in turn for other symbolic dims
LENGTHS = (32, 64, 128, 256, 512)
#: metadata keys exporters store an image size under (Ultralytics writes imgsz)
_SIZE_KEYS = ("imgsz", "img_size", "image_size", "input_size", "imagesize")
#: at most this many sizes are tried before giving up
_MAX_TRIES = 24


def leading(model: OnnxModel) -> set[str]:
    return {i.dims[0] for i in model.inputs if i.dims and isinstance(i.dims[0], str)}


def example_sizes(model: OnnxModel, given: dict[str, Any]) -> dict[str, int]:
    """A size for every symbolic dim: the one given, else 2 for a leading (batch) dim and 16
    for the others; an unknown name given is refused."""
    symbols = model.symbols
    unknown = [k for k in given if k not in symbols]
    if unknown:
        raise SpecError(
            f"{model.path.name} has no symbolic dim {unknown[0]!r}; its symbolic dims are "
            f"{', '.join(symbols) or 'none'}."
        )
    first = leading(model)
    out = {}
    for s in symbols:
        v = given.get(s, 2 if s in first else 16)
        try:
            out[s] = int(v)
        except (TypeError, ValueError):
            raise SpecError(f"the size of {s} must be a whole number; got {v!r}.") from None
        if out[s] < 1:
            raise SpecError(f"the size of {s} must be at least 1; got {out[s]}.")
    return out


# -- memory -------------------------------------------------------------------------------


def free_bytes() -> int | None:
    """Memory available to a new allocation now (Linux's MemAvailable), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _gib(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}" if unit == "GiB" else f"{n / size:.0f} {unit}"
    return f"{n:.0f} bytes"


def _elements(dims, sizes: dict[str, int]) -> int | None:
    n = 1
    for d in dims:
        if isinstance(d, int):
            n *= d
        elif d in sizes:
            n *= sizes[d]
        else:
            return None
    return n


def _largest_value(model: OnnxModel, sizes: dict[str, int]) -> tuple[int, str]:
    """Bytes and name of the largest intermediate or output whose shape the file gives in
    the inputs' symbols (value_info, outputs); (0, "") when none does."""
    import onnx

    best, name = 0, ""
    graph = model.proto.graph
    for v in (*graph.value_info, *graph.output):
        t = v.type.tensor_type
        if not t.HasField("shape") or not t.elem_type:
            continue
        dims = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in t.shape.dim]
        n = _elements(dims, sizes)
        if n is None:
            continue
        try:
            item = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)).itemsize
        except (KeyError, TypeError, ValueError):  # string and other dtypes numpy lacks
            item = 1
        if n * item > best:
            best, name = n * item, v.name
    return best, name


def need_bytes(model: OnnxModel, sizes: dict[str, int]) -> tuple[int, str]:
    """What running once at `sizes` allocates at least: the inputs (drawn in float64, then
    cast) and twice the largest value the shapes give (an op's input and output); the
    figure and what it is made of."""
    inputs = 0
    for i in model.inputs:
        n = math.prod(i.shape(sizes))
        inputs += n * (np.dtype(i.dtype).itemsize + 8)
    value, name = _largest_value(model, sizes)
    what = f"{_gib(inputs)} of inputs"
    if value:
        what += f" and 2 x {_gib(value)} for {name}"
    return inputs + 2 * value, what


def fit(model: OnnxModel, sizes: dict[str, int], free: int | None = None) -> None:
    """Refuse sizes whose run would not fit in the free memory, in one sentence."""
    free = free_bytes() if free is None else free
    if free is None:
        return
    need, what = need_bytes(model, sizes)
    if need > free:
        raise SpecError(
            f"{model.path.name} at sizes {sizes} needs about {_gib(need)} ({what}), more "
            f"than the {_gib(free)} of memory free; give smaller sizes with --set NAME=SIZE."
        )


# -- sizes the model runs at --------------------------------------------------------------


def _first_line(e: BaseException) -> str:
    """ORT's message without its status prefix and source locations, on one line."""
    text = str(e).strip()
    text = re.sub(r"\[ONNXRuntimeError\] : \d+ : \w+ : ", "", text)
    text = re.sub(r"\S+\.(?:cc|h|cpp):\d+ (?:virtual \S+ \S+\(.*?\) )?", "", text)
    text = " ".join(text.split())
    return (text or type(e).__name__)[:240]


def fails_at(model: OnnxModel, sizes: dict[str, int]) -> str | None:
    """Why the model (as given, ORT optimizations off) does not run at `sizes`, or None
    when it does; one run on fresh inputs."""
    import onnxruntime as ort

    from opswap.onnx.runtime import random_inputs, reference

    fit(model, sizes)
    ref = reference(model)
    quiet = ort.RunOptions()
    quiet.log_severity_level = 4  # the failure is reported here, not logged by ORT too
    try:
        ref.run(None, random_inputs(model.inputs, sizes, seed=0), quiet)
    except Exception as e:  # ORT's shape errors: the model does not run at these sizes
        return _first_line(e)
    return None


def spatial(model: OnnxModel) -> list[tuple[str, str]]:
    """(height symbol, width symbol) of each image input: a 4-D floating input whose two
    spatial dims are symbolic (NCHW, or NHWC when the last dim is a small channel count)."""
    out = []
    for i in model.inputs:
        if len(i.dims) != 4 or not np.issubdtype(np.dtype(i.dtype), np.floating):
            continue
        last = i.dims[3]
        hw = i.dims[1:3] if isinstance(last, int) and last <= 4 else i.dims[2:4]
        if all(isinstance(d, str) for d in hw):
            out.append((str(hw[0]), str(hw[1])))
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


def implied(model: OnnxModel) -> list[tuple[int, int]]:
    """Image sizes (height, width) the file implies: the size its metadata names, then each
    constant-size Resize's output scaled by 1, 2, 4, ... 32 (the stride it sits at is not
    known), smallest first."""
    import onnx

    out: list[tuple[int, int]] = []
    for p in model.proto.metadata_props:
        if p.key.lower() in _SIZE_KEYS:
            v = _ints(p.value)
            if len(v) in (1, 2):
                out.append((v[0], v[-1]))
    consts = {t.name: t for t in model.proto.graph.initializer}
    scaled: set[tuple[int, int]] = set()
    for node in model.proto.graph.node:
        if node.op_type != "Resize" or len(node.input) < 4 or node.input[3] not in consts:
            continue
        sz = onnx.numpy_helper.to_array(consts[node.input[3]]).reshape(-1)
        if sz.size == 4 and sz[2] > 0 and sz[3] > 0:
            scaled |= {(int(sz[2]) << k, int(sz[3]) << k) for k in range(6)}
    return out + sorted(scaled)


def _tries(model: OnnxModel, base: dict[str, int], given: set[str]):
    """The size sets to try after `base`, in turn: the image sizes the file implies, then
    common image sizes (for image inputs), or common lengths (for the other dims)."""
    free = [s for s in model.symbols if s not in given and s not in leading(model)]
    images = [hw for hw in spatial(model) if hw[0] in free or hw[1] in free]
    if images:
        seen = set()
        for h, w in [*implied(model), *((s, s) for s in IMAGE_SIZES)]:
            if (h, w) in seen:
                continue
            seen.add((h, w))
            out = dict(base)
            for hs, ws in images:
                out.update({k: v for k, v in ((hs, h), (ws, w)) if k in free})
            yield out, f"{h}x{w}"
    else:
        for n in LENGTHS:
            yield {**base, **{s: n for s in free}}, str(n)


def runnable(model: OnnxModel, given: dict[str, Any]) -> dict[str, int]:
    """`model.sizes` if the model runs there; else, for the dims the user did not give,
    the first sizes it runs at (`_tries`), with a note on `model`; refused in one sentence
    when it runs at none."""
    base = dict(model.sizes)
    why = fails_at(model, base) if model.symbols else None
    if why is None:
        return base
    picked = {s for s in model.symbols if s not in given and s not in leading(model)}
    if not picked:
        raise SpecError(
            f"{model.path.name} does not run at sizes {base} ({why}); give sizes it "
            "accepts with --set NAME=SIZE."
        )
    tried = [f"{', '.join(f'{s}={base[s]}' for s in sorted(picked))}"]
    for k, (sizes, label) in enumerate(_tries(model, base, set(given))):
        if k >= _MAX_TRIES:
            break
        try:
            if fails_at(model, sizes) is None:
                model.notes.append(
                    f"{model.path.name} does not run at {tried[0]} ({why}); it runs at "
                    f"{label}, so {', '.join(f'{s}={sizes[s]}' for s in sorted(picked))} "
                    "is used (--set NAME=SIZE picks another)."
                )
                return sizes
        except SpecError:  # too large for the free memory
            pass
        tried.append(label)
    raise SpecError(
        f"{model.path.name} runs at none of the sizes tried ({'; '.join(tried)}); the first "
        f"failed with: {why}. Give sizes it accepts with --set NAME=SIZE."
    )


def other_sizes(model: OnnxModel) -> list[dict[str, int]]:
    """Sizes besides the example's to verify at, each one the model runs at: batch 1, and
    a larger batch with another length of every other symbolic dim (3 less, else 32 or 64
    more, else the same). Empty when every dim is fixed."""
    if not model.symbols:
        return []
    first = leading(model)
    ex = model.sizes
    one = {s: (1 if s in first else ex[s]) for s in ex}
    more = [
        {s: (ex[s] + 1 if s in first else max(1, ex[s] + step)) for s in ex}
        for step in (-3, 32, 64, 0)
    ]
    out = []
    for cand in [[one], more]:
        for sizes in cand:
            if sizes == ex or sizes in out:
                continue
            try:
                if fails_at(model, sizes) is None:
                    out.append(sizes)
                    break
            except SpecError:  # past the free memory: not verified there
                continue
    return out
