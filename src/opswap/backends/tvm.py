"""Apache TVM as a place to run the model: the program model.pt2 holds, imported into
Relax, compiled for this CPU, run by Relax's virtual machine and wrapped as a module that
takes and returns torch tensors, so that verification and the race treat it like any
other variant (`--compare tvm`).

    from opswap.backends.tvm import tvm_artifact
    art = tvm_artifact(model, inputs, captured.dynamic)   # model.so, loaded
    y = art.module(x)                                     # runs in TVM's VM

What the build does, in order:

1. backends.aten.to_aten exports the program again with opswap's own ops traced into
   the ATen ops of their definitions (as for ExecuTorch: TVM's importer knows only ATen
   ops) and contiguous weights; the axes the file keeps stay dynamic.
2. `tvm.relax.frontend.torch.from_exported_program` imports it into Relax, the weights as
   constants. One op is imported by opswap: a slice whose end is a symbolic size that the
   program's range constraints keep inside the tensor (a position table cut to the
   sequence length) is marked in bounds, so its size stays the symbol; the importer's
   own translation gives `min(s, 128)`, which TVM cannot prove equal to the other
   operand's `s` and then fails to lower the add of the two.
3. `relax.build` compiles it for the host CPU with LLVM (`{"kind": "llvm", "mcpu":` the
   CPU LLVM detects here`}`: the wheel's LLVM takes no `-mcpu=native` under its own
   target triple) and writes it as a shared library, model.so, which is the file timed
   and saved. With `tune_trials` > 0 MetaSchedule first searches schedules for each
   kernel (static shapes only); without, TVM's default schedules are used, which on a
   CPU are plain loops: this is TVM untuned, not TVM at its best.

When the importer or the build cannot keep a size symbolic, the program is built again
at the example's shapes; the note says so and the module refuses other sizes in one
sentence. The module also refuses a size above the upper bound the program's range
constraints give (BERT's sequence length up to its position table).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from opswap.backends.aten import to_aten
from opswap.backends.pt2 import Artifact
from opswap.backends.registry import Deploy, Runtime, holds, register
from opswap.backends.runtime_module import RuntimeModule, failed, program_file, require
from opswap.backends.runtime_module import quiet as _quiet
from opswap.errors import ExportError, InputError

if TYPE_CHECKING:
    import tvm
    from torch.export import ExportedProgram

    from opswap.backends.pt2 import Exported
    from opswap.graph.dynamic import Dynamic

#: how long MetaSchedule may take to build one candidate kernel (its default is 30 s)
BUILD_TIMEOUT_S = 180


def _first(e: BaseException, limit: int = 200) -> str:
    while e.__cause__ is not None:
        e = e.__cause__
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    # TVM's errors start with a traceback of C++ frames; the reason is the last line
    return lines[-1][:limit] if lines else type(e).__name__


def _require() -> None:
    require("TVM", "apache-tvm", "tvm", "tvm", "tvm.relax.frontend.torch")


def host_target(threads: int | None = None) -> tvm.target.Target:
    """The LLVM target of this CPU, with `threads` cores (default: torch's thread count)."""
    import tvm
    from tvm.target import codegen

    return tvm.target.Target(
        {
            "kind": "llvm",
            "mcpu": codegen.llvm_get_system_cpu(),
            "num-cores": int(threads or torch.get_num_threads()),
        }
    )


def _upper_bounds(program: ExportedProgram) -> dict[str, int]:
    """{symbol name: its largest value} from the program's range constraints (finite ones)."""
    out = {}
    for sym, vr in program.range_constraints.items():
        if not getattr(vr.upper, "is_finite", True):  # int_oo: no bound
            continue
        try:
            out[str(sym)] = int(vr.upper)
        except Exception:  # a bound sympy cannot make an int of
            continue
    return out


def _slice_in_bounds(program: ExportedProgram) -> Callable[[fx.Node, Any], Any]:
    """The importer's `slice.Tensor`, marking in bounds a slice [0:s] of a static axis of
    size n when the program's range constraints give s <= n (see the module's docstring)."""
    from tvm import relax, tirx

    bounds = _upper_bounds(program)

    def convert(node: fx.Node, importer: Any) -> Any:  # TVM's ExportedProgramImporter
        x = importer.env[node.args[0]]
        dim = node.args[1] if len(node.args) > 1 else 0
        start = node.args[2] if len(node.args) > 2 else None
        end = node.args[3] if len(node.args) > 3 else None
        step = node.args[4] if len(node.args) > 4 else 1
        end_expr = importer.env[end] if isinstance(end, fx.Node) else None
        shape = importer.shape_of(x)
        size = shape[dim] if shape is not None else None
        if (
            start in (None, 0)
            and step == 1
            and isinstance(end_expr, tirx.Var)
            and isinstance(size, tirx.IntImm)
            and bounds.get(end_expr.name, size.value + 1) <= size.value
        ):
            return importer.block_builder.emit(
                relax.op.strided_slice(x, [dim], [0], [end_expr], [1], assume_inbound=True)
            )
        return importer._slice(node)

    return convert


def _tuned(
    mod: tvm.IRModule, target: tvm.target.Target, trials: int, work_dir: Path
) -> tvm.IRModule:
    """`mod` with the kernels MetaSchedule found in `trials` measured trials (evolutionary
    search with a random cost model: TVM's default, XGBoost, is one more package), the
    records kept in `work_dir`; the steps of relax.pipeline.static_shape_tuning_pipeline."""
    import tvm
    from tvm import relax
    from tvm.s_tir import meta_schedule as ms

    with target:
        mod = tvm.transform.Sequential(
            [
                relax.transform.DecomposeOpsForInference(),
                relax.transform.CanonicalizeBindings(),
                relax.get_pipeline("zero"),
            ]
        )(mod)
        database = ms.relax_integration.tune_relax(
            mod,
            params={},
            target=target,
            work_dir=str(work_dir),
            max_trials_global=trials,
            num_trials_per_iter=min(64, trials),
            cost_model="random",
            database="memory",  # applied right here: nothing to read back from disk
            # each candidate is built in a fresh worker process that imports TVM first:
            # the default 30 s timed every build out on the 2-core VM
            builder=ms.builder.LocalBuilder(timeout_sec=BUILD_TIMEOUT_S),
        )
        with database:
            return relax.transform.MetaScheduleApplyDatabase()(mod)


def _build(
    program: ExportedProgram, target: tvm.target.Target, tune_trials: int, work_dir: Path
) -> tvm.relax.VMExecutable:
    """`program` imported into Relax and compiled for `target`: a relax Executable."""
    import tvm
    from tvm import relax
    from tvm.relax.frontend.torch import from_exported_program

    mod = from_exported_program(
        program, custom_convert_map={"slice.Tensor": _slice_in_bounds(program)}
    )
    if tune_trials > 0:
        mod = _tuned(mod, target, tune_trials, work_dir / "tuning")
    with tvm.transform.PassContext(opt_level=3):
        return relax.build(mod, target=target)


def _limits(program: ExportedProgram) -> list[dict[int, tuple[str | None, int | None]]]:
    """Per user input, {dim: (symbol or None for a static dim, its size or upper bound)}."""
    bounds = _upper_bounds(program)
    users = set(program.graph_signature.user_inputs)
    out: list[dict[int, tuple[str | None, int | None]]] = []
    for node in program.graph.nodes:
        if node.op != "placeholder" or node.name not in users:
            continue
        val = node.meta.get("val")
        dims: dict[int, tuple[str | None, int | None]] = {}
        for d, n in enumerate(getattr(val, "shape", ())):
            if isinstance(n, int):
                dims[d] = (None, n)
            else:
                name = str(n)
                dims[d] = (name, bounds.get(name))
        out.append(dims)
    return out


def _static(program: ExportedProgram) -> ExportedProgram:
    """`program` with opswap's ops traced to ATen ops, exported at its example's shapes."""
    program = to_aten(program, None, runtime="TVM")
    args, kwargs = program.example_inputs
    return torch.export.export(program.module(), tuple(args), kwargs, strict=False)


def to_library(
    program: ExportedProgram,
    path: str | Path,
    kept: Dynamic | None = None,
    *,
    tune_trials: int = 0,
    threads: int | None = None,
) -> tuple[ExportedProgram, str | None]:
    """Build `program` (an ExportedProgram, dynamic along `kept`'s axes) with TVM for this
    CPU and write it to `path` (a shared library). Returns (the program built, a note or
    None): the program at the example's shapes, with the note saying why, when TVM could
    not build it with dynamic sizes. Raises ExportError with the reason."""
    _require()
    path = Path(path)
    target = host_target(threads)
    note = None
    dynamic = kept is not None and bool(kept.axes)
    try:
        with _quiet():
            try:
                if tune_trials > 0 and dynamic:
                    raise ExportError("MetaSchedule tunes kernels of static shapes")
                program = to_aten(program, kept, runtime="TVM")
                ex = _build(program, target, tune_trials, path.parent)
            except Exception as e:
                if not dynamic:
                    raise
                why = _first(e).removesuffix(".")
                program = _static(program)
                ex = _build(program, target, tune_trials, path.parent)
                note = (
                    f"{path.name} accepts the example's shapes only (TVM could not build it "
                    f"with dynamic sizes: {why})"
                    if tune_trials <= 0
                    else f"{path.name} accepts the example's shapes only ({why})"
                )
            ex.export_library(str(path))
    except ExportError:
        raise
    except Exception as e:
        raise ExportError(f"TVM could not compile the model: {_first(e)}.") from e
    return program, note


def _set_threads(threads: int) -> None:
    """TVM's runtime thread pool in this process, to `threads` threads, whose workers do not
    spin between calls (TVM_THREAD_POOL_SPIN_COUNT=0 unless the user set it): spinning
    workers would take the cores from the variants timed after it in the same loop."""
    import os

    os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "0")
    import tvm

    config = tvm.get_global_func("runtime.config_threadpool", allow_missing=True)
    if config is not None:
        config(0, threads)  # 0: no core affinity, as torch's own pool runs


class TvmModule(RuntimeModule):
    """A TVM shared library's `main`, run by Relax's virtual machine, called like the module
    it was built from: positional tensors in (the program's inputs, in order, handed to TVM
    through DLPack without a copy), the model's output structure out."""

    def __init__(
        self,
        path: str | Path,
        out_spec: Any = None,
        threads: int | None = None,
        names: list[str] | None = None,
        limits: list[dict[int, tuple[str | None, int | None]]] | None = None,
        axes: dict[str, str] | None = None,
    ):
        super().__init__(path, out_spec, threads)
        _require()
        import tvm
        from tvm import relax

        self.limits = list(limits or [])  # per input: {dim: (symbol or None, size / bound)}
        self.axes = dict(axes or {})  # symbol -> the axis's name, for the refusals
        _set_threads(self.session_threads)
        try:
            lib = tvm.runtime.load_module(str(self.path))
            self.vm = relax.VirtualMachine(lib, tvm.cpu())
            self.main = self.vm["main"]
        except Exception as e:
            raise ExportError(f"TVM could not load {self.path.name}: {_first(e)}.") from e
        self.input_names = list(names or [f"arg{i}" for i in range(len(self.limits))])
        self.reopen = {"names": self.input_names, "limits": self.limits, "axes": self.axes}

    def _check(self, leaves: list[torch.Tensor]) -> None:
        name = self.path.name
        if self.limits and len(leaves) != len(self.limits):
            raise InputError(
                f"{name} takes {len(self.limits)} input tensor(s) "
                f"({', '.join(self.input_names)}), got {len(leaves)}."
            )
        for i, x in enumerate(leaves):
            arg = self.input_names[i] if i < len(self.input_names) else f"arg{i}"
            if x.device.type != "cpu":
                raise InputError(f"{name} runs in TVM on the CPU; input {arg} is on {x.device}.")
            lim = self.limits[i] if i < len(self.limits) else {}
            if lim and x.dim() != len(lim):
                raise InputError(f"{name} takes input {arg} with {len(lim)} dims, got {x.dim()}.")
            for d, (sym, top) in lim.items():
                if sym is None and x.shape[d] != top:
                    raise InputError(
                        f"{name} takes input {arg} with size {top} in dim {d} only; "
                        f"it has {x.shape[d]}."
                    )
                if sym is not None and top is not None and x.shape[d] > top:
                    axis = self.axes.get(sym, f"dim {d}")
                    raise InputError(
                        f"{name} accepts {axis} up to {top} (the model's own limit); "
                        f"input {arg} has {x.shape[d]}."
                    )

    def run(self, args: tuple) -> list[torch.Tensor]:
        leaves = [x for x in pytree.tree_leaves(list(args)) if isinstance(x, torch.Tensor)]
        self._check(leaves)
        feed = [x.detach().contiguous() for x in leaves]
        try:
            outs = self.main(*feed)
        except Exception as e:
            raise InputError(f"{self.path.name} refused the inputs: {_first(e, 240)}.") from e
        if not isinstance(outs, tuple | list) and not hasattr(outs, "__len__"):
            outs = [outs]
        # the VM's outputs are its own buffers: copied out, as the other runtimes' are
        return [torch.from_dlpack(o).clone() for o in outs]


def tvm_artifact(
    model: nn.Module | None,
    inputs: tuple,
    dynamic: Dynamic | None = None,
    directory: str | Path | None = None,
    *,
    exported: Any = None,
    name: str = "model.so",
    tune_trials: int = 0,
) -> Artifact:
    """`model` (or `exported`, backends.pt2's (program, note, kept) of it) built by TVM for
    this CPU and loaded in Relax's VM: an Artifact whose `module` is the TvmModule over the
    library that is timed; never raises (its `error` says why). `tune_trials` > 0 runs
    MetaSchedule with that many trials first (minutes; see the module's docstring)."""
    from opswap.graph.dynamic import Dynamic

    got = program_file(
        model, inputs, dynamic, exported, directory, name, reason=_first, needs="tvm_artifact"
    )
    if isinstance(got, Artifact):
        return got
    program, note, kept, path = got
    how = (
        f"MetaSchedule-tuned ({tune_trials} trials)"
        if tune_trials > 0
        else "TVM's default schedules, not tuned"
    )
    note = "; ".join(filter(None, [note, how]))
    try:
        built, static = to_library(program, path, kept, tune_trials=tune_trials)
        if static is not None:
            note = "; ".join(filter(None, [note, static]))
            kept = Dynamic(notes=[static])
        limits = _limits(built)
        axes = {}
        for a in kept.axes if kept is not None else []:
            for i, d in a.dims:
                if i < len(limits) and d in limits[i] and limits[i][d][0] is not None:
                    axes[str(limits[i][d][0])] = a.name
        module = TvmModule.of_program(path, program, limits=limits, axes=axes)
    except ExportError as e:
        return failed(path, e, note, kept)
    return Artifact(path, module, note=note, kept=kept)


@register
class Tvm(Runtime):
    """Apache TVM (Relax) built for this CPU, untuned: `tvm` and `opswap+tvm` (--compare
    tvm) save model.so. Not an --export format, nor a --backend of verify and bench."""

    name = "tvm"
    title = "TVM"
    rank = 40
    file = "model.so"
    needs = ("tvm",)
    extra = "tvm"
    runs = "TVM runs (built for this CPU)"
    backend = False

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
        return tvm_artifact(model, inputs, dynamic, exported=exported)

    def load(self, path: Path) -> nn.Module:
        return TvmModule(path)  # a tensor or a tuple, as for ONNX Runtime and ExecuTorch

    def deploy(self, mine: bool, file: str) -> Deploy:
        return Deploy(
            holds(mine, "compiled by Apache TVM for this CPU"),
            f'tvm.relax.VirtualMachine(tvm.runtime.load_module("DIR/{file}"), tvm.cpu())'
            '["main"](*inputs) on a machine with this CPU and the same apache-tvm, or '
            "opswap.load_optimized(DIR)",
            "tvm (Relax VM, CPU)",
        )
