"""The edge race: opswap's legalised ExecuTorch program against ExecuTorch's default export
and LiteRT, each verified against the model and timed in one interleaved loop on this CPU;
the fastest verified file is copied, byte for byte, to the winner's name.

    from opswap.bench.edge import edge_race
    race = edge_race(model, inputs, "out/", tflite="model.tflite")   # tflite: optional
    race.winner, race.saved, race.markdown()

The variants:

- `executorch`: what a user gets without opswap, ExecuTorch's documented path:
  torch.export of the model at the example's shapes, `to_edge_transform_and_lower` with
  the XnnpackPartitioner, `to_executorch()`.
- `opswap+executorch`: the model planned for the `xnnpack` edge target (the legalisation
  rules of rules/legalize and the exact rules for any target), applied, exported at the
  example's shapes (XNNPACK reshapes take one dynamic dim at most, so a program with a
  dynamic batch and length is made static here; the note says so) and lowered with
  opswap's lowerings (backends.executorch.lower_to_edge).
- `litert`: a .tflite file converted elsewhere (LiteRT's PyTorch converter pins packages
  this environment does not hold; benchmarks/bench_edge.py converts in a venv of its own),
  run by `ai_edge_litert`'s interpreter with its default XNNPACK delegate.

Each is checked on fresh inputs at the example's shapes: cosine of every output against
the model's, top-1 agreement over the last dim, max abs. Each ExecuTorch variant carries
its delegation (targets.edge.delegation) read from the lowered program.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from opswap.errors import ExportError, InputError
from opswap.targets.edge import Delegation, delegation

#: calls per variant in each round of the timing loop, and untimed calls before them
_BLOCK, _SETTLE = 3, 2
#: the least cosine (every output against the model's) a variant must reach to be verified
MIN_COSINE = 0.999


@dataclass
class EdgeEntry:
    """One variant of the race: its file, its checks and its time."""

    name: str
    path: Path | None
    run: Callable[..., Any] | None = field(default=None, repr=False)
    delegation: Delegation | None = None
    cosine: float | None = None
    top1: float | None = None
    max_abs: float | None = None
    ms: float | None = None
    memory: dict[str, Any] | None = None
    error: str = ""

    @property
    def verified(self) -> bool:
        return not self.error and self.cosine is not None and self.cosine >= MIN_COSINE

    def to_dict(self) -> dict[str, Any]:
        d = self.delegation
        return {
            "name": self.name,
            "file": None if self.path is None else self.path.name,
            "verified": self.verified,
            "cosine": self.cosine,
            "top1_agreement": self.top1,
            "max_abs": self.max_abs,
            "median_ms": self.ms,
            "memory": self.memory,
            "error": self.error or None,
            "delegation": None if d is None else d.to_dict(),
        }


@dataclass
class EdgeRace:
    """The race's entries, the fastest verified one and where its file was saved."""

    entries: list[EdgeEntry]
    winner: str | None
    saved: Path | None
    notes: list[str] = field(default_factory=list)

    def entry(self, name: str) -> EdgeEntry:
        return next(e for e in self.entries if e.name == name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "winner": self.winner,
            "saved": None if self.saved is None else str(self.saved),
            "entries": [e.to_dict() for e in self.entries],
            "notes": list(self.notes),
        }

    def markdown(self) -> str:
        """The report's section: one row per variant, then each delegation's ops outside."""
        rows = [
            "| variant | verified | cosine | top-1 | ms (median) | compute ops delegated "
            "| peak RSS over the bare process, MB |",
            "|---|---|---|---|---|---|---|",
        ]
        for e in self.entries:
            share = "-" if e.delegation is None else f"{e.delegation.compute_share:.0%}"
            rows.append(
                f"| {e.name}{' (winner)' if e.name == self.winner else ''} | "
                f"{'yes' if e.verified else 'no: ' + (e.error or 'cosine below ' + str(MIN_COSINE))} | "
                f"{_f(e.cosine, 6)} | {_f(e.top1, 3)} | {_f(e.ms, 3)} | {share} | "
                f"{_f(None if e.memory is None else e.memory.get('peak_mb'), 1)} |"
            )
        out = ["\n".join(rows)]
        for e in self.entries:
            if e.delegation is not None:
                out.append(f"{e.name}: " + e.delegation.markdown())
        out += [f"- {n}" for n in self.notes]
        return "\n\n".join(out)


def _f(v: float | None, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _leaves(out: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _compare(want: Any, got: Any) -> tuple[float, float, float]:
    """(least cosine, least top-1 agreement, max abs) over the floating outputs."""
    w, g = _leaves(want), _leaves(got)
    if len(w) != len(g):
        raise InputError(f"it returned {len(g)} tensors where the model returns {len(w)}.")
    cos, top1, worst = 1.0, 1.0, 0.0
    for a, b in zip(w, g, strict=True):
        if not a.is_floating_point():
            continue
        b = b.reshape(a.shape).to(a.dtype)
        a64, b64 = a.double().flatten(), b.double().flatten()
        c = torch.nn.functional.cosine_similarity(a64, b64, dim=0).item()
        cos, worst = min(cos, c), max(worst, (a64 - b64).abs().max().item())
        if a.dim() >= 1 and a.shape[-1] > 1:
            top1 = min(top1, (a.argmax(-1) == b.argmax(-1)).double().mean().item())
    return cos, top1, worst


def _fresh(inputs: tuple) -> tuple:
    return tuple(
        torch.randn_like(x) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
        for x in inputs
    )


def _write_pte(edge: Any, path: Path) -> Path:
    from opswap.backends.runtime_module import quiet

    with quiet():
        path.write_bytes(edge.to_executorch().buffer)
    return path


def default_executorch(model: nn.Module, inputs: tuple, path: Path) -> tuple[Path, Delegation]:
    """ExecuTorch's documented export of `model` at the example's shapes: (the .pte file,
    the lowered program's delegation)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    from opswap.backends.runtime_module import quiet

    with quiet():
        ep = torch.export.export(model, inputs)
        edge = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()])
    d = delegation(edge, "xnnpack")  # before to_executorch, which plans memory in the graph
    return _write_pte(edge, path), d


def legalised_module(model: nn.Module, inputs: tuple, target: str = "xnnpack") -> nn.Module:
    """`model` planned for the edge `target` (the legalisation rules and the exact rules for
    any target) and applied: a new module; `model` is untouched."""
    from opswap.graph.capture import capture
    from opswap.planner import apply_plan, make_plan

    captured = capture(model, inputs)
    applied = apply_plan(captured, make_plan(captured, target=target))
    if applied.failed:
        raise ExportError(f"the plan for {target} did not apply: {applied.failed[0]}.")
    return applied.gm


def opswap_executorch(model: nn.Module, inputs: tuple, path: Path) -> tuple[Path, Delegation]:
    """opswap's legalised program lowered with its ExecuTorch lowerings, at the example's
    shapes: (the .pte file, the lowered program's delegation)."""
    from opswap.backends.executorch import lower_to_edge
    from opswap.backends.pt2 import export

    legal = legalised_module(model, inputs)
    program, _, _ = export(legal, inputs, None, runtime=True)
    edge = lower_to_edge(program, None, lowerings=True)
    d = delegation(edge, "xnnpack")
    return _write_pte(edge, path), d


class LiteRTRunner:
    """A .tflite file run by LiteRT's interpreter (XNNPACK delegate, `threads` threads):
    torch tensors in, torch tensors out."""

    def __init__(self, path: Path, threads: int | None = None):
        from ai_edge_litert.interpreter import Interpreter

        self.interp = Interpreter(
            model_path=str(path), num_threads=threads or torch.get_num_threads()
        )
        self.interp.allocate_tensors()
        self.ins = self.interp.get_input_details()
        self.outs = self.interp.get_output_details()

    def __call__(self, *args: torch.Tensor) -> list[torch.Tensor]:
        if len(args) != len(self.ins):
            raise InputError(f"the .tflite file takes {len(self.ins)} inputs, not {len(args)}.")
        for d, x in zip(self.ins, args, strict=True):
            self.interp.set_tensor(d["index"], x.detach().numpy().astype(d["dtype"]))
        self.interp.invoke()
        return [torch.from_numpy(self.interp.get_tensor(d["index"]).copy()) for d in self.outs]


#: run in a fresh interpreter by program_memory: argv = file, threads, calls; prints JSON.
#: Resident set read from /proc/self/status (VmRSS) after the runtime is imported (the
#: base), after loading, after the first call and after the rest (the steady state); the
#: high-water mark from VmHWM, set back to the base once the runtime is imported (ru_maxrss
#: would carry the forking parent's); loading passes through peaks the samples miss
_MEMORY_CHILD = r"""
import json, sys
path, threads, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def rss(key="VmRSS:"):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024
    raise SystemExit("no " + key + " in /proc/self/status")
def reset():
    try:  # "5" sets VmHWM back to the current resident set (Linux 4.0+)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return rss()
if path.endswith(".tflite"):
    import numpy as np
    from ai_edge_litert.interpreter import Interpreter
    base = reset()
    it = Interpreter(model_path=path, num_threads=threads)
    it.allocate_tensors()
    feed = [(d["index"], np.zeros(d["shape"], d["dtype"])) for d in it.get_input_details()]
    def call():
        for i, x in feed:
            it.set_tensor(i, x)
        it.invoke()
else:
    import torch
    from executorch.extension.pybindings import portable_lib
    from executorch.runtime import Runtime
    rt = Runtime.get()
    portable_lib._unsafe_reset_threadpool(threads)
    kinds = {0: torch.uint8, 1: torch.int8, 3: torch.int32, 4: torch.int64,
             5: torch.float16, 6: torch.float32, 11: torch.bool, 15: torch.bfloat16}
    base = reset()
    method = rt.load_program(path).load_method("forward")
    meta = method.metadata
    feed = [torch.zeros(meta.input_tensor_meta(i).sizes(),
                        dtype=kinds[meta.input_tensor_meta(i).dtype()])
            for i in range(meta.num_inputs())]
    def call():
        method.execute(feed)
load = rss()
call()
first = rss()
steady = first
for _ in range(calls - 1):
    call()
    steady = max(steady, rss())
print(json.dumps({"base": base, "load": load, "first": first, "steady": steady,
                  "process_peak": rss("VmHWM:")}))
"""


def planned_memory(path: str | Path) -> int:
    """The bytes an ExecuTorch program plans for its activations (the sum of its forward
    method's memory-planned buffers, read from the .pte file)."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    try:
        pte = deserialize_pte_binary(Path(path).read_bytes())
    except Exception as e:
        raise InputError(f"{Path(path).name} is not an ExecuTorch program: {e}") from e
    program = getattr(pte, "program", pte)  # a PTEFile in executorch 1.x, a Program before
    plans = [p for p in program.execution_plan if p.name == "forward"] or program.execution_plan
    return int(sum(plans[0].non_const_buffer_sizes))


def program_memory(path: str | Path, threads: int | None = None, calls: int = 5) -> dict[str, Any]:
    """The memory one .pte or .tflite file takes to run, measured in a fresh Python process so
    that no other program or model shares the figure: resident set (MB) over the bare
    process (the runtime imported) after loading, after the first call and in the steady
    state (`calls` calls, zeros of the input shapes), the peak over the base (the high-water
    mark since the runtime was imported, which catches what loading holds for a moment),
    the process's own peak, and for a .pte the activation memory the program plans."""
    p = Path(path)
    if p.suffix not in (".pte", ".tflite") or not p.is_file():
        raise InputError(f"{p} is not a .pte or .tflite file here.")
    threads = threads or torch.get_num_threads()
    cmd = [sys.executable, "-c", _MEMORY_CHILD, str(p), str(threads), str(max(1, calls))]
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in got.stdout.splitlines() if ln.startswith("{")]
    if got.returncode != 0 or not lines:
        why = (got.stderr.strip().splitlines() or [f"exit {got.returncode}"])[-1]
        raise ExportError(f"measuring the memory of {p.name} failed: {why[:200]}")
    r = json.loads(lines[-1])
    out = {
        "base_mb": round(r["base"], 1),
        "load_mb": round(r["load"] - r["base"], 1),
        "first_run_mb": round(r["first"] - r["base"], 1),
        "steady_mb": round(r["steady"] - r["base"], 1),
        "peak_mb": round(max(r["load"], r["first"], r["steady"], r["process_peak"]) - r["base"], 1),
        "process_peak_mb": round(r["process_peak"], 1),
        "file_mb": round(p.stat().st_size / 2**20, 2),
        "threads": threads,
        "basis": "VmRSS over a fresh process with the runtime imported",
    }
    if p.suffix == ".pte":
        out["planned_mb"] = round(planned_memory(p) / 2**20, 3)
    return out


@contextmanager
def torch_pool_held(threads: int = 1) -> Iterator[None]:
    """torch's own intra-op pool held at `threads` while the runtimes are timed, then put
    back. The runtimes bring their own XNNPACK pools; torch's OpenMP workers, woken during
    an ExecuTorch call (on zoo:gpt; copying its outputs outside torch did not stop it),
    spin-wait after each parallel region and take the cores XNNPACK's pool waits on. On the
    2-core VM under load, zoo:gpt's .pte ran 16-60 ms a call with torch at 2 threads (15 ms
    of CPU a call, a second thread busy) and 0.5 ms at 1."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _executorch_runner(path: Path, threads: int | None = None) -> Callable[..., Any]:
    from opswap.backends.executorch import ExecuTorchModule

    return ExecuTorchModule(path, threads=threads)


def edge_race(
    model: nn.Module,
    inputs: tuple,
    directory: str | Path,
    *,
    tflite: str | Path | None = None,
    rounds: int = 30,
    samples: int = 3,
    memory: bool = True,
) -> EdgeRace:
    """Race the edge variants of `model` (in eval mode, at `inputs`' shapes) on this CPU:
    each built into `directory`, checked on `samples` fresh inputs against the model, timed
    in `rounds` interleaved rounds (a block of calls each, after untimed ones) and, with
    `memory`, its memory read in a fresh process (program_memory); the fastest verified
    file is copied to `directory`/model.<its suffix>. A variant that cannot be built says
    why in its entry."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    model = model.eval()
    inputs = tuple(inputs)
    threads = torch.get_num_threads()  # XNNPACK's pool in each runtime, fixed before timing
    entries: list[EdgeEntry] = []
    builders: list[tuple[str, Callable[[], tuple[Path, Delegation]]]] = [
        ("executorch", lambda: default_executorch(model, inputs, out / "executorch.pte")),
        ("opswap+executorch", lambda: opswap_executorch(model, inputs, out / "opswap.pte")),
    ]
    for name, build in builders:
        try:
            path, d = build()
            entries.append(EdgeEntry(name, path, _executorch_runner(path, threads), d))
        except (ExportError, InputError) as err:
            entries.append(EdgeEntry(name, None, error=str(err)))
        except Exception as err:  # an exporter's own failure, said in one line
            why = f"{type(err).__name__}: {str(err)[:200]}"
            entries.append(EdgeEntry(name, None, error=why))
    notes = ["ExecuTorch programs are built at the example's shapes (static)"]
    if tflite is not None:
        p = Path(tflite)
        try:
            entries.append(EdgeEntry("litert", p, LiteRTRunner(p, threads)))
        except Exception as err:
            entries.append(EdgeEntry("litert", p, error=f"LiteRT could not load {p.name}: {err}"))
    else:
        notes.append("no .tflite file was given: LiteRT is not in this race")
    with torch.no_grad():
        for e in entries:
            if e.run is None:
                continue
            try:
                worst = (1.0, 1.0, 0.0)
                for xs in [inputs] + [_fresh(inputs) for _ in range(samples - 1)]:
                    c, t, m = _compare(model(*xs), e.run(*xs))
                    worst = (min(worst[0], c), min(worst[1], t), max(worst[2], m))
                e.cosine, e.top1, e.max_abs = worst
            except Exception as err:
                e.error = f"it failed on the inputs: {str(err)[:200]}"
        live = [e for e in entries if e.verified and e.run is not None]
        times: dict[str, list[float]] = {e.name: [] for e in live}
        for e in live:  # warm-up
            e.run(*inputs) if e.run else None
    notes.append(
        f"XNNPACK threads: {threads} in every runtime; torch's own pool held at 1 thread "
        "while timing"
    )
    with torch.no_grad(), torch_pool_held(1):
        # in blocks: LiteRT's XNNPACK thread pool spin-waits after each call, and an
        # ExecuTorch call right after one ran 6-12x slower on zoo:gpt (0.7 -> 8 ms on the
        # 2-core VM); the first calls of a block wait that out, untimed
        for _ in range(rounds):
            for e in live:
                assert e.run is not None
                for i in range(_SETTLE + _BLOCK):
                    t0 = time.perf_counter()
                    e.run(*inputs)
                    if i >= _SETTLE:
                        times[e.name].append(time.perf_counter() - t0)
    for e in live:
        e.ms = statistics.median(times[e.name]) * 1e3
        if memory and e.path is not None:
            try:
                e.memory = program_memory(e.path, threads)
            except (ExportError, InputError, subprocess.TimeoutExpired) as err:
                e.memory = {"error": str(err)}
    best = min(live, key=lambda e: e.ms or float("inf"), default=None)
    saved = None
    if best is not None and best.path is not None:
        saved = out / f"model{best.path.suffix}"
        if saved.resolve() != best.path.resolve():
            shutil.copyfile(best.path, saved)
    return EdgeRace(entries, None if best is None else best.name, saved, notes)


def offline_checks(model: nn.Module, inputs: tuple, directory: str | Path) -> dict[str, Any]:
    """The back ends this machine cannot run, checked as far as it can: Core ML (the model
    converted by coremltools to an .mlpackage, which runs on Linux, and its program read
    against the ANE's op set) and QNN (the program read against the Hexagon HTP's op set
    only: no QNN SDK here). Each says what it did not do."""
    model = model.eval()
    program = torch.export.export(model, tuple(inputs)).run_decompositions({})
    out: dict[str, Any] = {}
    coreml: dict[str, Any] = {"runs": "not here: running a Core ML model needs Apple hardware"}
    try:
        import coremltools as ct

        from opswap.backends.runtime_module import quiet

        path = Path(directory) / "model.mlpackage"
        with quiet():
            ml = ct.convert(
                program, convert_to="mlprogram", minimum_deployment_target=ct.target.iOS17
            )
            ml.save(str(path))
        coreml.update(converted=True, file=path.name, coremltools=ct.__version__)
    except ImportError:
        coreml.update(converted=False, error="coremltools is not installed")
    except Exception as e:  # the converter names the op it lacks
        coreml.update(converted=False, error=f"{type(e).__name__}: {str(e)[:300]}")
    coreml["ane_op_set"] = delegation(program, "coreml-ane").to_dict()
    out["coreml"] = coreml
    qnn = delegation(program, "qnn-htp").to_dict()
    qnn["runs"] = "not here: op-set description only (no QNN SDK to compile or run)"
    out["qnn"] = qnn
    return out
