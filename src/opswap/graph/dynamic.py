"""Which input dimensions stay symbolic, and inputs at other sizes along them.

A model is optimised once and then called at many shapes: other batch sizes, other
sequence lengths. opswap marks the dimensions that may vary (the *axes*) from the
example inputs, checks that the model really runs at another size along each, and
from then on never lets a rewrite depend on an example size:

- shape propagation runs the graph at the example and at one *probe* per axis
  (`graph.shapes.propagate`), so a rule sees which sizes of a node move with the
  input (`dynamic_dims`) and whether a property (contiguity, "this squeeze is a
  no-op") holds at every size, not only at the example's;
- verification draws samples at batch 1, at a larger batch and at another sequence
  length besides the example's shape (`variants`);
- torch.export captures and saved `model.pt2` files mark the axes dynamic.

Detection (`detect`, overridable with `dynamic=`): dim 0 of every input tensor that has
the first input's leading size is the batch axis (unless the only input is a vector); dim 1 of 2-D integer or bool
inputs (token ids, attention masks) and of 2-D float inputs of the same length is
the sequence axis. Every other dimension of every input (of size 2 or more) is probed
too, as torch.export's `Dim.AUTO` would infer it: dims of one size across the inputs
are tried together (a [B, T, F] input and its [B, T] mask move together), then one by
one, and a dim stays static only where the model refuses another size (a Linear over
the features, a channel count). A size is probed at +1 (-1 for a sequence) and, where
the model refuses that, at a step of the size's largest power-of-two factor (a U-Net
that needs multiples of 16 keeps 64 x 64 symbolic through 128). Write
`dynamic="none"` to keep every size static, `"batch"` or `"seq"` for one of them, or
`"I:D=name"` items to name input leaf I's dim D (`"I:D=name%16"`: probed at a step of
16).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.utils import _pytree as pytree

from opswap.errors import CaptureError, InputError
from opswap.graph.guards import SizeGuard, Sizes, checker, leaf_labels


@dataclass(frozen=True)
class Axis:
    """One dynamic size: its name, the (input leaf, dim) pairs that carry it, its example
    size and the other size the model was probed at."""

    name: str
    dims: tuple[tuple[int, int], ...]
    size: int
    probe: int
    step: int = 1  # the probe's distance from the example's size (a model's multiple)
    #: the largest size verification checks the axis at (the model's own limit, or
    #: LARGE_FACTOR times the example's size where the model runs that far); None for batch
    largest: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "size": self.size,
            "probed_at": self.probe,
            "step": self.step,
            "largest_verified": self.largest,
            "inputs": [f"input {i} dim {d}" for i, d in self.dims],
        }


@dataclass
class Dynamic:
    """The dynamic axes of a captured model, why others were kept static, and the size
    guards the captured graph holds under (graph.guards.SizeGuard: a branch on a size
    traced one way)."""

    axes: list[Axis] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    guards: list[SizeGuard] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "axes": [a.to_json() for a in self.axes],
            "notes": list(self.notes),
            "guards": [g.to_json() for g in self.guards],
        }

    def describe(self) -> str:
        if not self.axes:
            return "every size is static (the model is only claimed at the example's shapes)"
        text = ", ".join(
            f"{a.name} (example {a.size}; {', '.join(f'input {i} dim {d}' for i, d in a.dims)})"
            for a in self.axes
        )
        if self.guards:
            text += "; only where " + " and ".join(g.describe() for g in self.guards)
        return text

    def axis(self, name: str) -> Axis | None:
        return next((a for a in self.axes if a.name == name), None)

    def guarded_axes(self) -> list[Axis]:
        """The axes a branch guard reads: the model computes something else at sizes the
        guard excludes, where the captured graph would answer wrongly."""
        dims = {d for g in self.guards if g.branch for d in g.dims}
        return [a for a in self.axes if dims & set(a.dims)]

    def for_files(self, what: str = "the file") -> Dynamic:
        """The axes a file that cannot refuse a size (an .onnx file, OpenVINO's IR, a .pte
        file, a TVM library) may keep dynamic: these axes less the ones a branch guard
        reads, which stay static at the example's size, with a note naming the guard; the
        guards of the axes kept are the model's own limits, which such a file meets by
        failing as the model does."""
        fixed = self.guarded_axes()
        if not fixed:
            return self
        axes = [a for a in self.axes if a not in fixed]
        dims = {d for a in fixed for d in a.dims}
        guards = [g for g in self.guards if not dims & set(g.dims)]
        why = " and ".join(g.describe() for g in self.guards if g.branch and dims & set(g.dims))
        note = (
            f"{what} keeps {', '.join(a.name for a in fixed)} static at the example's size: "
            f"the model's graph holds only where {why} (it computes something else outside), "
            "and such a file cannot refuse a size"
        )
        return Dynamic(axes, [*self.notes, note], guards)


def _leaves(inputs: tuple) -> list:
    return pytree.tree_leaves(list(inputs))


def _tensors(inputs: tuple) -> list[tuple[int, torch.Tensor]]:
    return [
        (i, x)
        for i, x in enumerate(_leaves(inputs))
        if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.layout == torch.strided
    ]


def _auto(inputs: tuple, which: set[str]) -> list[tuple[str, tuple[tuple[int, int], ...]]]:
    tensors = _tensors(inputs)
    found = []
    if "batch" in which and tensors:
        b = tensors[0][1].shape[0]
        dims = tuple((i, 0) for i, x in tensors if x.shape[0] == b)
        if tensors[0][1].dim() >= 2 or len(dims) >= 2:  # a lone vector has no batch
            found.append(("batch", dims))
    if "seq" in which:
        ids = [
            (i, x)
            for i, x in tensors
            if x.dim() == 2 and not x.is_floating_point() and not x.is_complex()
        ]
        if ids:
            s = ids[0][1].shape[1]
            dims = tuple((i, 1) for i, x in tensors if x.dim() == 2 and x.shape[1] == s)
            found.append(("seq", dims))
    return found


_ITEM = re.compile(r"^(\d+):(\d+)(?:=([A-Za-z_][A-Za-z0-9_]*))?(?:%(\d+))?$")


@dataclass(frozen=True)
class _Request:
    """An axis a setting asks for, before probing: `step` fixed by the setting (None: try
    1, then the size's largest power-of-two factor); `rest` for the dims "auto" adds
    beyond batch and sequence, which are tried one by one where they fail together."""

    name: str
    dims: tuple[tuple[int, int], ...]
    step: int | None = None
    rest: bool = False


def _rest(inputs: tuple, taken: set[tuple[int, int]]) -> list[_Request]:
    """Every dim of size 2 or more not in `taken`, grouped by size across the inputs."""
    groups: dict[int, list[tuple[int, int]]] = {}
    for i, x in _tensors(inputs):
        for d, n in enumerate(x.shape):
            if n >= 2 and (i, d) not in taken:
                groups.setdefault(int(n), []).append((i, d))
    return [
        _Request(f"dim{dims[0][0]}_{dims[0][1]}", tuple(dims), rest=True)
        for dims in groups.values()
    ]


def _requests(spec: str | None, inputs: tuple) -> list[_Request]:
    spec = "auto" if spec is None else str(spec).strip().lower()
    if spec in ("auto", ""):
        named = [_Request(n, dims) for n, dims in _auto(inputs, {"batch", "seq"})]
        return named + _rest(inputs, {d for r in named for d in r.dims})
    if spec == "none":
        return []
    names: set[str] = set()
    explicit: dict[str, list[tuple[int, int]]] = {}
    steps: dict[str, int] = {}
    leaves = _leaves(inputs)
    for item in (p.strip() for p in spec.split(",") if p.strip()):
        if item in ("batch", "seq"):
            names.add(item)
            continue
        m = _ITEM.match(item)
        if not m or (m[4] is not None and int(m[4]) < 1):
            raise CaptureError(
                f"Cannot read {item!r} in the dynamic-shape setting; write auto, none, batch, "
                "seq, or INPUT:DIM[=NAME][%STEP] items such as 0:0=batch,0:1=seq,0:2=h%16."
            )
        i, d, name = int(m[1]), int(m[2]), m[3] or f"dim{m[1]}_{m[2]}"
        if i >= len(leaves) or not isinstance(leaves[i], torch.Tensor) or d >= leaves[i].dim():
            raise CaptureError(
                f"The dynamic-shape setting names input {i} dim {d}, which the "
                "example inputs do not have."
            )
        explicit.setdefault(name, []).append((i, d))
        if m[4] is not None:
            steps[name] = int(m[4])
    return [_Request(n, dims) for n, dims in _auto(inputs, names)] + [
        _Request(n, tuple(dims), steps.get(n)) for n, dims in explicit.items()
    ]


def parse(spec: str | None, inputs: tuple) -> list[tuple[str, tuple[tuple[int, int], ...]]]:
    """The named axes a `dynamic=` setting asks for, before probing (batch, seq and the
    INPUT:DIM items; "auto" probes every other dim as well, see `detect`). Raises
    CaptureError on a setting it cannot read."""
    return [(r.name, r.dims) for r in _requests(spec, inputs) if not r.rest]


def _probe_size(name: str, size: int, step: int = 1) -> int:
    if name == "seq" and size - step >= 2:
        return size - step  # shorter stays inside position tables and caches
    return size + step


def _steps(request: _Request, size: int) -> list[int]:
    """The probe steps to try: the setting's, or 1 and then the largest power of two that
    divides the size (a model that needs multiples of it)."""
    if request.step is not None:
        return [request.step]
    if request.name == "batch":
        return [1]
    factor = size & -size
    return [1, factor] if factor > 1 else [1]


def step_rows(x: torch.Tensor) -> str | None:
    """How the rows (last dim) of a two-valued tensor run, when each is one run of its
    high value and one of its low: "head" (high first: a right-padded 0/1 attention mask,
    0/-inf alike), "tail" (high last: a left-padded mask, token_type_ids 0..0 1..1), else
    None. Rows of one value fit both and read as "head"."""
    if (
        x.dim() < 2
        or x.shape[-1] < 2
        or x.numel() == 0
        or x.is_complex()
        or x.layout != torch.strided
    ):
        return None
    lo, hi = x.min(), x.max()
    if bool(lo == hi) or not bool(((x == lo) | (x == hi)).all()):
        return None
    rows = (x == hi).reshape(-1, x.shape[-1]).to(torch.int8)
    step = rows[:, 1:] - rows[:, :-1]
    if bool((step <= 0).all()):
        return "head"
    if bool((step >= 0).all()):
        return "tail"
    return None


def _resize(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """`x` with size `n` along `dim`: cut, or extended by repeating its last slice (a
    padding mask stays a padding mask); memory format kept. A mask whose rows end in its
    high value (left padding) is cut from the front along its rows, so that every row
    keeps the run of ones it had at its end."""
    cur = x.shape[dim]
    if n <= cur:
        last_dim = dim in (-1, x.dim() - 1)
        start = cur - n if n < cur and last_dim and step_rows(x) == "tail" else 0
        y = x.narrow(dim, start, n)
    else:
        last = x.narrow(dim, cur - 1, 1)
        shape = list(x.shape)
        shape[dim] = n - cur
        y = torch.cat([x, last.expand(shape)], dim)
    fmt = (
        torch.channels_last
        if x.dim() == 4
        and not x.is_contiguous()
        and x.is_contiguous(memory_format=torch.channels_last)
        else torch.contiguous_format
    )
    return y.contiguous(memory_format=fmt)


def resized(inputs: tuple, sizes: dict[tuple[int, int], int]) -> tuple:
    """`inputs` with the (leaf, dim) sizes in `sizes` changed; other leaves as they are."""
    leaves, spec = pytree.tree_flatten(list(inputs))
    out = []
    for i, x in enumerate(leaves):
        for (li, d), n in sizes.items():
            if li == i:
                x = _resize(x, d, n)
        out.append(x)
    return tuple(pytree.tree_unflatten(out, spec))


def at(inputs: tuple, axis: Axis, n: int) -> tuple:
    """`inputs` with `axis` at size `n`."""
    return resized(inputs, {d: n for d in axis.dims})


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0][:160] if str(e).strip() else ""


#: verification checks each non-batch axis up to this many times the example's size, or
#: up to the largest size the model takes where that is smaller (a position table's length,
#: a buffer cropped to the length): far enough that a rewrite judged at two nearby sizes (a
#: mask read as causal at the example's length) is checked where it may stop holding
LARGE_FACTOR = 4
_LARGE_STEPS = 6  # bisection steps towards the model's own limit


def _try(
    run, inputs: tuple, request: _Request, batch: Axis | None = None
) -> tuple[Axis | None, str]:
    """The axis when `run` takes every size verification will use along it, at the first
    step that works, with the largest size it takes up to LARGE_FACTOR times the example's
    (tried at batch 1 when `batch` is dynamic); else None and what the model raised."""
    leaves = _leaves(inputs)
    size = int(leaves[request.dims[0][0]].shape[request.dims[0][1]])
    why = ""
    for step in _steps(request, size):
        axis = Axis(request.name, request.dims, size, _probe_size(request.name, size, step), step)
        for label, xs in variants(inputs, Dynamic([axis])):  # every size verification uses
            try:
                run(xs)
            except Exception as e:
                why = why or f"the model raised {type(e).__name__} at {label} ({_first_line(e)})"
                break
        else:
            return replace(axis, largest=_largest(run, inputs, axis, batch)), ""
    return None, why


def _largest(run, inputs: tuple, axis: Axis, batch: Axis | None) -> int | None:
    """The largest size, up to LARGE_FACTOR times the example's and on the axis's step, that
    `run` takes along `axis` (bisected towards the model's limit where it refuses the
    far end); None for the batch axis, or where nothing beyond the probe runs."""
    if axis.name == "batch":
        return None
    top = max(axis.size, axis.probe)
    far = top + (axis.size * LARGE_FACTOR - top) // axis.step * axis.step
    good, size = top, far
    for _ in range(_LARGE_STEPS):
        if size <= good:
            break
        xs = at(inputs, axis, size)
        if batch is not None and batch.size != 1:
            xs = at(xs, batch, 1)
        try:
            run(xs)
        except Exception:
            far = size
        else:
            good = size
            if size == far:
                break
        size = good + (far - good) // 2 // axis.step * axis.step
    return good if good > top else None


def detect(run, inputs: tuple, spec: str | None = "auto") -> Dynamic:
    """The axes `spec` asks for that the model really runs at another size along: `run`
    (a callable on inputs) is called at each axis's probe sizes; an axis along which it
    raises is kept static, with a note saying so (one note for all the dims "auto" found
    static beyond batch and sequence: feature and channel sizes, mostly)."""
    dyn = Dynamic()
    static: list[str] = []
    leaves = _leaves(inputs)
    for request in _requests(spec, inputs):
        if not request.dims:
            continue
        size = leaves[request.dims[0][0]].shape[request.dims[0][1]]
        if any(leaves[i].shape[d] != size for i, d in request.dims):
            raise CaptureError(
                f"The dynamic axis {request.name!r} names dimensions of "
                "different sizes in the example inputs; give dims that share "
                "one size."
            )
        axis, why = _try(run, inputs, request, dyn.axis("batch"))
        if axis is not None:
            dyn.axes.append(axis)
        elif not request.rest:
            dyn.notes.append(f"{request.name} kept static: {why}")
        else:  # dims of one size that fail together may each move alone
            for dim in request.dims:
                one = None
                if len(request.dims) > 1:
                    one, _ = _try(
                        run,
                        inputs,
                        _Request(f"dim{dim[0]}_{dim[1]}", (dim,), rest=True),
                        dyn.axis("batch"),
                    )
                if one is not None:
                    dyn.axes.append(one)
                else:
                    static.append(f"input {dim[0]} dim {dim[1]} ({size})")
    if static:
        dyn.notes.append(
            "kept static, since the model refuses other sizes there: " + ", ".join(static)
        )
    return dyn


def probes(inputs: tuple, dyn: Dynamic) -> list[tuple]:
    """One input tuple per axis, that axis at its probe size: what shape propagation runs
    besides the example, to tell the sizes that move from the ones that stay."""
    return [at(inputs, a, a.probe) for a in dyn.axes]


def variants(inputs: tuple, dyn: Dynamic) -> list[tuple[str, tuple]]:
    """(label, inputs) at the shapes verification checks besides the example's: batch 1,
    a larger batch, and each other axis at its probe size and at its large end (`largest`,
    at batch 1 where batch is dynamic: a rewrite that holds at two nearby sizes may still
    fail at a far one, a mask judged at the example's length). Each is the example cut or
    extended along the axis, so integer inputs (ids, offsets, masks) keep their structure;
    verification draws fresh floating values for them."""
    holds = within(dyn)
    out = []
    batch = dyn.axis("batch")
    for a in dyn.axes:
        if a.name == "batch" and a.size != 1:
            out.append(("batch 1", at(inputs, a, 1)))
        out.append((f"{a.name} {a.probe}", at(inputs, a, a.probe)))
        far_size = a.largest
        while far_size is not None and far_size > a.probe and not holds(at(inputs, a, far_size)):
            far_size = (far_size + max(a.size, a.probe)) // 2  # back inside the guards
        if far_size is not None and far_size not in (a.size, a.probe):
            far = at(inputs, a, far_size)
            label = f"{a.name} {far_size} (largest verified)"
            if batch is not None and batch is not a and batch.size != 1:
                far, label = at(far, batch, 1), label + ", batch 1"
            out.append((label, far))
    return [(label, xs) for label, xs in out if holds(xs)]


def within(dyn: Dynamic):
    """A predicate on input tuples: whether their sizes meet every guard of `dyn` (always
    True without guards)."""
    if not dyn.guards:
        return lambda xs: True
    compiled: dict[int, Any] = {}

    def holds(xs: tuple) -> bool:
        leaves = _leaves(xs)
        if len(leaves) not in compiled:
            compiled[len(leaves)] = checker(dyn.guards, len(leaves))
        found = compiled[len(leaves)]
        return found is None or bool(found[0](*(_sizes(x) for x in leaves)))

    return holds


def _sizes(x: Any) -> Any:
    return Sizes(x.shape) if isinstance(x, torch.Tensor) else x


def export_shapes(inputs: tuple, dyn: Dynamic):
    """`dynamic_shapes` for torch.export: Dim.AUTO on every axis dim, per argument."""
    if not dyn.axes:
        return None
    marks = {d for a in dyn.axes for d in a.dims}
    leaves, spec = pytree.tree_flatten(list(inputs))
    per_leaf = []
    for i, x in enumerate(leaves):
        dims = {d: torch.export.Dim.AUTO for li, d in marks if li == i}
        per_leaf.append(dims if isinstance(x, torch.Tensor) and dims else None)
    return tuple(pytree.tree_unflatten(per_leaf, spec))


@dataclass(frozen=True)
class Expected:
    """What one input must be: a tensor of `rank` and `dtype` whose sizes in `fixed`
    ((dim, size) pairs) are those; with `rank` None, anything (a non-tensor input)."""

    name: str
    rank: int | None
    dtype: torch.dtype | None = None
    fixed: tuple[tuple[int, int], ...] = ()


def bind_by_name(what: str, names: list[str], args: tuple, kwargs: dict) -> tuple:
    """`args` with the keyword inputs `kwargs` put in their places among `names` (a flat
    list of named inputs: a dict example's ids and mask), as opswap's in-memory result and
    the saved model.pt2 both take them; one sentence for a name it lacks, an input given
    twice, or one missing."""
    listed = ", ".join(names)
    given: list = list(args) + [None] * (len(names) - len(args))
    for k, v in kwargs.items():
        if k not in names:
            raise InputError(f"{what} has no input {k!r}; its inputs are {listed}.")
        if names.index(k) < len(args):
            raise InputError(f"{what} got input {k} twice, by position and by name.")
        given[names.index(k)] = v
    missing = [n for n, v in zip(names, given, strict=True) if v is None]
    if missing:
        raise InputError(f"{what} is missing input(s) {', '.join(missing)} (it takes {listed}).")
    return tuple(given)


def check_inputs(
    what: str,
    got: list[Any] | tuple[Any, ...],
    want: list[Expected],
    why_fixed: str,
    advice: str = "",
) -> None:
    """Refuse in one sentence (InputError) the first of `got`, a call's inputs one for one
    with `want`, that is not what `want` says: another rank or dtype, or another size in a
    fixed dim. `why_fixed` says in a few words why a size is fixed; `advice` ends the
    sentence on a fixed size. The one input check of opswap's results: the in-memory
    result (`guard`) and the saved model.pt2 (backends.pt2) both call it."""
    for x, e in zip(got, want, strict=True):
        if e.rank is None:
            continue
        if not isinstance(x, torch.Tensor) or x.dim() != e.rank or x.dtype != e.dtype:
            kind = (
                f"a {x.dim()}-D {x.dtype} tensor"
                if isinstance(x, torch.Tensor)
                else f"a {type(x).__name__}"
            )
            raise InputError(
                f"{what}: input {e.name} must be a {e.rank}-D {e.dtype} tensor, got {kind}."
            )
        for d, n in e.fixed:
            if x.shape[d] != n:
                raise InputError(
                    f"{what}: input {e.name} must have size {n} in dim {d} "
                    f"({why_fixed}), got {tuple(x.shape)}" + (f"; {advice}" if advice else "") + "."
                )


def guard(
    module: torch.nn.Module,
    inputs: tuple,
    dyn: Dynamic,
    what: str = "the optimized model",
    hint: str = "",
    params: list[str] | None = None,
) -> torch.nn.Module:
    """`module` (opswap's in-memory result) with a check before each call that refuses, in
    one sentence, inputs it was never claimed at: another number of inputs, another rank
    or dtype, another size in a dim the capture kept static (`check_inputs`, which the
    saved model.pt2 runs too), or sizes the capture's guards exclude (`dyn.guards`: where
    the model takes another path than the one traced); `params`, forward's parameters,
    name the leaves of a tuple or dict input (`pair[0]`). The check stands aside while
    torch.compile or torch.export traces the module, so that it never specialises a
    symbolic size."""
    leaves, spec = pytree.tree_flatten(list(inputs))
    moving = {d for a in dyn.axes for d in a.dims}
    names = [
        n.name
        for n in getattr(getattr(module, "graph", None), "nodes", ())
        if n.op == "placeholder"
    ]
    # a tuple or dict input: its leaves named by the parameter (`params`) and the key
    nested = len(inputs) != len(leaves)
    names = names if len(names) == len(leaves) and not nested else leaf_labels(inputs, params)
    want = [
        Expected(
            names[i],
            x.dim(),
            x.dtype,
            tuple((d, int(n)) for d, n in enumerate(x.shape) if (i, d) not in moving),
        )
        if isinstance(x, torch.Tensor)
        else Expected(names[i], None)
        for i, x in enumerate(leaves)
    ]

    flat = len(inputs) == len(leaves) and len(set(names)) == len(names)

    def check(_mod, args, kwargs):
        if torch.compiler.is_compiling():
            return None
        bound = None
        if kwargs:
            if not flat or len(args) > len(names):
                raise InputError(
                    f"{what} takes its inputs positionally, in this order: {', '.join(names)}."
                )
            args = bind_by_name(what, names, args, kwargs)
            bound = (args, {})
        got, got_spec = pytree.tree_flatten(list(args))
        if got_spec != spec:
            raise InputError(
                f"{what} takes {len(want)} input(s) ({', '.join(names)}) as it "
                f"was optimized, got {len(args)} argument(s) of another form"
                + (f"; it {hint}" if hint else "")
                + "."
            )
        check_inputs(
            what,
            got,
            want,
            "the model was optimized with that size static",
            "optimize it again with an example of that size, or name the dim in --dynamic",
        )
        if guards is not None and not guards[0](*(_sizes(x) for x in got)):
            raise InputError(outside_guards(what, got, dyn.guards, names))
        return bound

    guards = checker(dyn.guards, len(leaves))
    # before torch.export's own input check (ExportedProgram.module() hooks one), so the
    # caller reads this sentence rather than its RuntimeError
    module.register_forward_pre_hook(check, prepend=True, with_kwargs=True)
    return module


def outside_guards(what: str, got: list, guards: list[SizeGuard], names: list[str]) -> str:
    """The sentence that refuses inputs `got` (the leaves) breaking one of `guards`."""
    for g in guards:
        found = checker([g], len(got))
        if found is None or found[0](*(_sizes(x) for x in got)):
            continue
        sizes = " and ".join(
            f"input {names[i]} has size {got[i].shape[d]} in dim {d}"
            for i, d in g.dims
            if i < len(got) and isinstance(got[i], torch.Tensor) and d < got[i].dim()
        )
        return (
            f"{what}: {sizes or 'the inputs sizes'}, but the model's graph was captured where "
            f"{g.describe(names)} and the model takes another path outside that; optimize it "
            "again with an example of that size"
        ) + "."
    return f"{what}: the inputs break one of the size guards it was captured under."
