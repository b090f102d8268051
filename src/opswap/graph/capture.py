"""Turn an nn.Module into an FX graph: symbolic tracing first, torch.export second.

FX symbolic tracing keeps nn.Module leaves (nn.Conv2d stays one `call_module`
node), which is what module-swapping rules and layer-by-layer verification want.
Models with Python control flow on tensor values, in-place writes into proxies or
other untraceable code (most Hugging Face models) fall back to torch.export in
non-strict mode, which produces ATen-level nodes that still carry their
`nn_module_stack`. The capture works on a deep copy: rewriting the graph never
touches the user's module. Whether a graph reproduces its module is for the verifier to
say: the caller hands `capture` that comparison (a `Check`; verify.outputs.capture_check,
which opswap.api.capture passes).
"""

from __future__ import annotations

import linecache
import os
import traceback
from dataclasses import dataclass, field
from typing import Literal, Protocol, TypeVar, cast

import torch
import torch.fx as fx
from torch import nn

from opswap.errors import CaptureError
from opswap.graph.copies import (
    describe_hooks,
    materialise_weights,
    preserved_state,
    private_copy,
    quiet_deepcopy,
    user_hooks,
)
from opswap.graph.dynamic import Dynamic, detect, probes, variants
from opswap.graph.inputs import fresh, writes
from opswap.graph.shapes import propagate

__all__ = ["Captured", "Check", "as_inputs", "capture", "copy_module", "quiet_deepcopy"]

Method = Literal["auto", "fx", "export"]
_M = TypeVar("_M", bound=nn.Module)


class Check(Protocol):
    """How `capture` compares a graph with the module it came from."""

    def rounding(self, model: nn.Module, inputs: tuple) -> float | None:
        """The model's own low-precision rounding on `inputs` (None for a float32 model)."""
        ...

    def differs(
        self,
        model: nn.Module,
        gm: fx.GraphModule,
        inputs: tuple,
        rounding: float | None,
        variants: list | None = None,
    ) -> str | None:
        """Why `gm` does not give `model`'s outputs on samples like `inputs` (and, with
        `variants`, at those other shapes), judged at the model's `rounding`; None when
        it does."""
        ...


@dataclass
class Captured:
    """A captured model: the graph module (a private copy) and how it was obtained.

    `dynamic` names the input sizes that stay symbolic and `probes` holds the inputs at
    another size along each, which shape propagation runs besides the example;
    `rounding` is the model's own low-precision rounding (None for float32 models), the
    yardstick of exact tolerances.
    """

    gm: fx.GraphModule
    method: Literal["fx", "export"]
    example_inputs: tuple
    notes: list[str] = field(default_factory=list)
    dynamic: Dynamic = field(default_factory=Dynamic)
    probes: list[tuple] = field(default_factory=list)
    rounding: float | None = None
    writes_inputs: list[int] = field(default_factory=list)  # input tensors forward writes into

    def recapture_shapes(self) -> None:
        """Re-run shape propagation after the graph changed."""
        self.propagate(self.gm)

    def propagate(self, gm: fx.GraphModule) -> list:
        """Shapes on every node of `gm` (this capture or a rewrite of it), at the example
        and at each probe; returns the per-probe errors (see graph.shapes.propagate)."""
        return propagate(gm, self.example_inputs, self.probes)

    def variants(self) -> list[tuple[str, tuple]]:
        """(label, inputs) at the other shapes the capture claims (batch 1, larger batch,
        another sequence length): verification runs one sample at each."""
        return variants(self.example_inputs, self.dynamic)

    def derived(self, gm: fx.GraphModule) -> Captured:
        """A capture of the same model and inputs holding another graph module."""
        return Captured(
            gm,
            self.method,
            self.example_inputs,
            list(self.notes),
            self.dynamic,
            self.probes,
            self.rounding,
            list(self.writes_inputs),
        )


def copy_module(module: _M) -> _M:
    """A private deep copy of a module (weights included; the user's hooks dropped)."""
    return private_copy(module)


def _where(exc: BaseException) -> str:
    """'file.py:LINE: source' of the deepest frame outside torch and opswap, if any."""
    torch_dir = os.path.dirname(torch.__file__)
    own_dir = os.path.dirname(os.path.dirname(__file__))
    frames = traceback.extract_tb(exc.__traceback__)
    user = [
        f
        for f in frames
        if not f.filename.startswith((torch_dir, own_dir)) and not f.filename.startswith("<")
    ]
    if not user:
        return ""
    f = user[-1]
    src = (f.line or linecache.getline(f.filename, cast(int, f.lineno))).strip()
    return f"{os.path.basename(f.filename)}:{f.lineno}: `{src}`"


def _describe(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    where = _where(exc)
    return (
        f"{type(exc).__name__} at {where} ({msg[:200]})"
        if where
        else f"{type(exc).__name__} ({msg[:200]})"
    )


def as_inputs(example_inputs) -> tuple:
    """Example inputs as the tuple of forward's positional arguments."""
    if isinstance(example_inputs, tuple):
        return example_inputs
    if isinstance(example_inputs, list):
        return tuple(example_inputs)
    return (example_inputs,)


def _fx(model: nn.Module, inputs: tuple, dyn: Dynamic) -> fx.GraphModule:
    return fx.symbolic_trace(model)


def _export(model: nn.Module, inputs: tuple, dyn: Dynamic) -> fx.GraphModule:
    """The exported graph, with the program's size guards (graph.guards.program_guards) in
    `gm.meta["size_guards"]` for the capture to keep."""
    from torch.utils import _pytree as pytree

    from opswap.graph.dynamic import export_shapes
    from opswap.graph.guards import program_guards

    shapes = export_shapes(inputs, dyn)
    try:
        ep = torch.export.export(model, inputs, dynamic_shapes=shapes, strict=False)
    except Exception:
        if shapes is None:
            raise
        ep = torch.export.export(model, inputs, strict=False)  # static; probes will say
    module = ep.module()
    codes = program_guards(ep, module, len(pytree.tree_leaves(list(inputs))))
    gm = _without_guards(module)
    gm.meta["size_guards"] = codes
    return gm


def _guarded(
    model: nn.Module,
    gm: fx.GraphModule,
    inputs: tuple,
    dyn: Dynamic,
    codes: list[str],
    check: Check | None,
    rounding: float | None,
) -> Dynamic:
    """`dyn` with the size guards `codes` of the capture's graph that matter, each marked
    with whether the model itself runs at a size the guard excludes (the nearest such size
    along the axes it reads, or one just past a bound it names). Where it runs, the graph
    (whose own checks are removed) is run there too: when it gives the model's outputs, the
    guard only records a choice torch made while tracing that changes nothing (a pooling
    that is the identity at 1x1) and is dropped; otherwise the model computes something
    else there (branch True), and a file that cannot refuse that size keeps the axis
    static. Where the model fails (branch False), the guard restates its own limit."""
    from opswap.graph.guards import SizeGuard

    guards = []
    for code in codes:
        outside = _outside(inputs, dyn, SizeGuard(code))
        branch = None
        if outside is not None:
            try:
                _run(model, outside)
                branch = True
            except Exception:
                branch = False
            if branch and _same_outputs(model, gm, outside, check, rounding):
                continue
        guards.append(SizeGuard(code, branch))
    return Dynamic(list(dyn.axes), list(dyn.notes), guards) if codes else dyn


def _same_outputs(
    model: nn.Module, gm: fx.GraphModule, xs: tuple, check: Check | None, rounding: float | None
) -> bool:
    """Whether `gm` gives `model`'s outputs at inputs `xs` (the capture's check, or, without
    one, every tensor output within a relative L2 error of 1e-4 with the same shape)."""
    if check is not None:
        try:
            return check.differs(model, gm, xs, rounding) is None
        except Exception:
            return False
    from torch.utils import _pytree as pytree

    try:
        want = pytree.tree_leaves(_run(model, xs))
        with torch.no_grad():
            got = pytree.tree_leaves(gm(*fresh(xs)))
    except Exception:
        return False
    if len(want) != len(got):
        return False
    for w, g in zip(want, got, strict=True):
        if isinstance(w, torch.Tensor) != isinstance(g, torch.Tensor):
            return False
        if not isinstance(w, torch.Tensor):
            continue
        if w.shape != g.shape or w.dtype != g.dtype:
            return False
        if w.is_floating_point():
            w64, g64 = w.double(), g.double()
            if (w64 - g64).norm() > 1e-4 * w64.norm().clamp_min(1e-30):
                return False
        elif not torch.equal(w, g):
            return False
    return True


def _outside(inputs: tuple, dyn: Dynamic, guard) -> tuple | None:
    """Inputs along one axis of `dyn` at the size nearest the example's that `guard`
    excludes (sizes on the axis's step, and just past each number the guard names; at
    batch 1 when the guard does not read the batch); None when none is found."""
    import re

    from torch.utils import _pytree as pytree

    from opswap.graph.dynamic import LARGE_FACTOR, at
    from opswap.graph.guards import Sizes, checker

    leaves = pytree.tree_leaves(list(inputs))
    found = checker([guard], len(leaves))
    if found is None:
        return None
    holds = found[0]
    numbers = {int(n) for n in re.findall(r"(?<![\w.])\d+(?![\w.])", guard.code)}
    batch = dyn.axis("batch")
    for axis in dyn.axes:
        if not set(axis.dims) & set(guard.dims):
            continue
        near = [
            axis.size + k * axis.step
            for j in range(1, LARGE_FACTOR * axis.size // axis.step + 1)
            for k in (-j, j)
        ]
        sizes = [n for n in [*near, *(c + e for c in numbers for e in (-1, 1))] if n >= 1]
        for n in sizes:
            shapes = [
                Sizes([n if (i, d) in axis.dims else s for d, s in enumerate(x.shape)])
                if isinstance(x, torch.Tensor)
                else x
                for i, x in enumerate(leaves)
            ]
            if not holds(*shapes):
                xs = at(inputs, axis, n)
                if batch is not None and batch is not axis and batch.size != 1:
                    if not set(batch.dims) & set(guard.dims):
                        xs = at(xs, batch, 1)
                return xs
    return None


def _without_guards(gm: fx.GraphModule) -> fx.GraphModule:
    """The exported graph without its per-call Python checks: the `_guards_fn` module that
    re-checks every shape guard on every call, and `aten._assert_tensor_metadata` nodes.
    On small models they cost 10-20 % of a call (hf:llama on 2 CPU threads: 3.17 ms with
    them, 2.90 ms without, 2.91 ms for the eager module). opswap checks the shapes a
    capture claims itself (graph.dynamic), and the saved model.pt2 is exported afresh,
    guards included."""
    assert_meta = getattr(torch.ops.aten, "_assert_tensor_metadata", None)
    for n in list(gm.graph.nodes):
        if (n.op == "call_module" and n.target == "_guards_fn") or (
            assert_meta is not None
            and n.op == "call_function"
            and n.target in (assert_meta, getattr(assert_meta, "default", None))
        ):
            if not n.users:
                gm.graph.erase_node(n)
    gm.recompile()
    gm.delete_all_unused_submodules()
    return gm


def _shapes(inputs: tuple) -> str:
    from torch.utils import _pytree as pytree

    parts = []
    for x in pytree.tree_leaves(list(inputs)):
        if isinstance(x, torch.Tensor):
            parts.append(f"{str(x.dtype).removeprefix('torch.')}[{','.join(map(str, x.shape))}]")
        else:
            parts.append(type(x).__name__)
    return ", ".join(parts) or "no inputs"


def _run(model: nn.Module, inputs: tuple, copy: bool = True):
    with torch.no_grad(), preserved_state(model):
        return model(*(fresh(inputs) if copy else inputs))


def _reproduces(
    model: nn.Module,
    gm: fx.GraphModule,
    inputs: tuple,
    dyn: Dynamic,
    rounding: float | None,
    name: str,
    check: Check,
) -> tuple[str | None, Dynamic]:
    """(None, axes kept) when the graph gives the module's outputs at the example and at
    every other shape it still claims; an axis at whose other sizes the graph differs is
    dropped from the claim, with a note. (reason, dyn) when it differs at the example."""
    why = check.differs(model, gm, inputs, rounding)
    if why is not None:
        return why, dyn
    kept = Dynamic([], list(dyn.notes), list(dyn.guards))
    for axis in dyn.axes:
        one = Dynamic([axis], guards=dyn.guards)
        why = check.differs(model, gm, inputs, rounding, variants(inputs, one))
        if why is None:
            kept.axes.append(axis)
        else:
            kept.notes.append(
                f"{axis.name} kept static: the {name} graph differs from the "
                f"model at other {axis.name} sizes ({why})" + _size_one_hint(axis, name)
            )
    return None, kept


def capture(
    model: nn.Module,
    example_inputs,
    method: Method = "auto",
    *,
    dynamic: str | None = "auto",
    check: Check | None = None,
) -> Captured:
    """Capture `model` on `example_inputs` as an FX GraphModule with shapes on every node.

    `method="auto"` tries FX symbolic tracing and falls back to torch.export
    (non-strict). The module is copied first (without the user's hooks; weights that
    weight_norm, spectral_norm or a parametrisation compute made plain parameters, with a
    note), so the result owns its weights and the user's module is never called.
    `dynamic` says which input sizes stay symbolic (see graph.dynamic: "auto", "none",
    "batch,seq", ...).

    With a `check` (the verifier's comparison; opswap.api.capture passes it), a capture
    must reproduce the module's outputs at the example and at the other claimed shapes;
    one that does not (FX turns `y += 1` on a tensor another output views into an
    out-of-place add) falls back to the next method, and when none does the model is
    refused with the reason. The check also measures the model's own rounding
    (`Captured.rounding`); without one, the first method that traces is taken and
    `rounding` is None. Raises CaptureError naming the first untraceable line when no
    method works.
    """
    if not isinstance(model, nn.Module):
        raise CaptureError(f"Expected a torch.nn.Module to capture, got {type(model).__name__}.")
    inputs = fresh(as_inputs(example_inputs))  # the caller's tensors are never run on
    hooks = user_hooks(model)
    model = private_copy(model)
    # the graph holds weights, not the hooks that compute them: FX keeps a parametrised
    # module as a leaf whose weight rules would read as stale, and the old weight_norm's
    # pre-hook is dropped with the module call
    computed = materialise_weights(model)
    errors: list[str] = []
    notes: list[str] = []
    if hooks:
        notes.append(
            f"The model has {describe_hooks(hooks)}; opswap runs and optimizes a copy without them."
        )
    if computed:
        notes.append(
            "Weights the model computes on each call are plain parameters in the "
            "optimized model, holding what they compute now: " + ", ".join(computed) + "."
        )
    if model.training:
        notes.append(
            "The model is in training mode: BatchNorm folds and Dropout removal will not fire; "
            "call .eval() first to optimise for inference."
        )
    try:
        written = writes(lambda xs: _run(model, xs, copy=False), inputs)
    except Exception as e:
        raise CaptureError(
            f"The model failed on the example inputs ({_shapes(inputs)}): {_describe(e)}; "
            "pass inputs its forward accepts (shapes, dtypes, argument order)."
        ) from e
    dyn = detect(lambda xs: _run(model, xs), inputs, dynamic)
    notes.extend(dyn.notes)
    if written:
        notes.append(
            f"The model writes into its input{'s' if len(written) > 1 else ''} "
            f"{', '.join(str(i) for i in written)}; opswap runs it on a fresh copy of "
            "the inputs each time (timings include that copy for every variant)."
        )
    rounding = check.rounding(model, inputs) if check is not None else None
    orders: dict[str, tuple[Literal["fx", "export"], ...]] = {
        "auto": ("fx", "export"),
        "fx": ("fx",),
        "export": ("export",),
    }
    order = orders[method]
    for how in order:
        build = _fx if how == "fx" else _export
        name = "FX symbolic tracing" if how == "fx" else "torch.export"
        try:
            # each method traces a fresh copy: tracing runs the forward's Python, and a
            # side effect there (`self.calls += 1` on a buffer) must not reach the graph's
            # starting state nor the model the graph is checked against
            gm = build(private_copy(model), inputs, dyn)
            if names := output_names_of(model):
                gm.meta[OUTPUT_NAMES] = names
            failed = propagate(gm, inputs, probes(inputs, dyn))
        except Exception as e:  # tracing raises anything from TraceError to TypeError
            errors.append(f"{name} failed: {_describe(e)}")
            continue
        here = _narrowed(dyn, failed, name)
        if here is not dyn:
            propagate(gm, inputs, probes(inputs, here))
        here = _guarded(model, gm, inputs, here, gm.meta.pop("size_guards", []), check, rounding)
        if check is not None:
            why, checked = _reproduces(model, gm, inputs, here, rounding, name, check)
            if why is not None:
                errors.append(f"the {name} graph does not reproduce the model ({why})")
                continue
            if checked.axes != here.axes:
                here = checked
                propagate(gm, inputs, probes(inputs, here))
        notes.extend(f"{e}; fell back to {name}." for e in errors)
        notes.extend(here.notes[len(dyn.notes) :])
        return Captured(gm, how, inputs, notes, here, probes(inputs, here), rounding, written)
    if any("does not reproduce" in e for e in errors):
        raise CaptureError(
            f"Could not capture {type(model).__name__} faithfully: "
            + "; ".join(errors)
            + ". The usual cause is an in-place op on a tensor that another value views or "
            "aliases (z = y.view(-1); y += 1), or state kept outside buffers; write that "
            "line out of place."
        )
    raise CaptureError(
        f"Could not capture {type(model).__name__}: " + "; ".join(errors) + _known_fix(errors)
    )


#: the graph module's meta key holding the model's own output names (exports name the
#: outputs of their files so: backends.onnx.output_names)
OUTPUT_NAMES = "opswap_output_names"


def output_names_of(model: nn.Module) -> tuple[str, ...] | None:
    """The output names a model carries: an fx graph's meta, or the model's
    `opswap_output_names` (models.hf.HFModule names its flat tuple's outputs so)."""
    names = (
        getattr(model, "meta", {}).get(OUTPUT_NAMES) if isinstance(model, fx.GraphModule) else None
    )
    names = names or getattr(model, OUTPUT_NAMES, None)
    return tuple(names) if names else None


def _size_one_hint(axis, name: str) -> str:
    if axis.size == 1 and name == "torch.export":
        return "; torch.export treats size-1 dims as fixed, so give an example of size 2 or more"
    return ""


def _narrowed(dyn: Dynamic, failed: list, name: str) -> Dynamic:
    """`dyn` without the axes whose probe the graph failed at (the capture specialised
    them to the example's size), with a note for each."""
    bad = [(a, e) for a, e in zip(dyn.axes, failed, strict=True) if e is not None]
    if not bad:
        return dyn
    out = Dynamic([a for a in dyn.axes if all(a is not b for b, _ in bad)], list(dyn.notes))
    for a, e in bad:
        out.notes.append(
            f"{a.name} kept static: the {name} graph only runs at {a.name} "
            f"{a.size} ({type(e).__name__}: {str(e).strip().splitlines()[0][:120] if str(e).strip() else ''})"
            + _size_one_hint(a, name)
        )
    return out


def _known_fix(errors: list[str]) -> str:
    """The end of a capture failure's message: what fixes a known cause, else the usual
    advice for untraceable Python."""
    import re

    text = " ".join(errors)
    cache = re.search(r"\b(\w*Cache)'?>? in output", text)
    if cache:  # transformers' cache objects are not pytrees torch.export can flatten
        return (
            f". The model returns a {cache[1]} (a transformers cache): build it with "
            "use_cache=false (--set use_cache=false for an hf: spec) or pass a wrapper "
            "module that returns only tensors."
        )
    other = re.search(r"Found <class '([\w.]+)'> in output", text)
    if other:
        return (
            f". The model returns a {other[1].rsplit('.', 1)[-1]}, which torch.export "
            "cannot flatten: return tensors (or tuples of them), or pass a wrapper module "
            "that does."
        )
    return (
        ". Make that line traceable (no Python branching on tensor values) or pass a "
        "wrapper module that avoids it."
    )
