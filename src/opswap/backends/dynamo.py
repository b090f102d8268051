"""The `opswap` torch.compile backend: opswap's rules on each Dynamo graph, then Inductor.

    model = torch.compile(model, backend="opswap")            # registered by the install
    be = opswap.backends.dynamo.backend(rules="fusion.*", exactness="exact")
    model = torch.compile(model, backend=be)
    model(x)
    print(be.summary())                                        # what fired, per graph

Dynamo cuts the forward into graphs (one more at each graph break, one more at each
recompile); each is planned and rewritten with the same planner and rules as
`opswap plan` (planner.make_plan and apply_plan on a Captured of the graph), then
handed to Inductor (`compile_fx`), so the user gets opswap's replacements and
Inductor's code generation. opswap's own ops (`torch.ops.opswap.*`) are registered
through torch.library with fake implementations, so Inductor keeps them as calls.

Which graphs are rewritten:

- inference graphs (grad mode off, or nothing requires grad): the module's weights
  are read as constants (backends._dynamo_graph.freeze) and every rule of the
  selection may fire; the compiled graph checks on each call that the weights are
  the tensors it was planned on, at the same version, and plans again when not;
- graphs that record autograd (training, or inference without torch.no_grad() on a
  model whose parameters require grad) go to Inductor untouched: folded and
  repacked weights are new tensors the optimizer would never update. The report
  says so; wrap inference in torch.no_grad() or torch.inference_mode();
- a graph whose planning raises is compiled as it is, with the reason reported.

Nothing is printed: `Backend.reports` holds a `GraphReport` per graph, and the
`report` option is called with each one as it is made.
"""

from __future__ import annotations

import copy
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from opswap.backends._dynamo_graph import (
    Frozen,
    freeze,
    is_dynamic,
    outside_dynamo,
    placeholders,
    probes,
    real_inputs,
    records_autograd,
    thaw,
    weight_positions,
)
from opswap.errors import BackendError
from opswap.rules.base import EXACTNESS_ORDER, Failure, Miss, Skipped

__all__ = ["Backend", "GraphReport", "Options", "backend", "compile_failure", "opswap_backend"]

#: how often one graph is planned again for changed weights before it stops freezing them
_MAX_REPLANS = 3
_OPTIONS = ("rules", "exactness", "target", "freeze", "report")


@dataclass(frozen=True)
class Options:
    """What the backend plans with: rule globs (empty: every rule), the loosest exactness
    allowed, the target (None: the device the graph runs on), whether module weights are
    read as constants, and a callable given each GraphReport."""

    rules: tuple[str, ...] = ()
    exactness: str = "exact"
    target: str | None = None
    freeze: bool = True
    report: Callable[[GraphReport], None] | None = None

    @classmethod
    def make(cls, **given: Any) -> Options:
        """Options from keyword arguments (or torch.compile's `options=` dict), checked now:
        an unknown name, rule glob, exactness or target is a one-sentence OpswapError."""
        from opswap.rules import registry
        from opswap.targets import get_target

        unknown = sorted(set(given) - set(_OPTIONS))
        if unknown:
            raise BackendError(
                f"The opswap backend has no option {unknown[0]!r}; it takes {', '.join(_OPTIONS)}."
            )
        exactness = given.get("exactness", "exact")
        if exactness not in EXACTNESS_ORDER:
            raise BackendError(
                f"exactness must be one of {', '.join(EXACTNESS_ORDER)}, not {exactness!r}."
            )
        rules = registry.parse_patterns(given.get("rules"))
        registry.select(rules or None, exactness)  # raises RuleError for a glob that selects none
        target = given.get("target")
        if target is not None:
            get_target(target)  # raises TargetError naming the known ones
        if not isinstance(given.get("freeze", True), bool):
            raise BackendError(f"freeze must be True or False, not {given['freeze']!r}.")
        report = given.get("report")
        if report is not None and not callable(report):
            raise BackendError(
                f"report must be a callable taking a GraphReport, not {type(report).__name__}."
            )
        return cls(rules, exactness, target, given.get("freeze", True), report)


@dataclass
class GraphReport:
    """What the backend did with one Dynamo graph. `compile_id` is Dynamo's ("0/1": frame
    0, its second compile), `applied` counts the sites per rule, `untouched` says why a
    graph went to Inductor as Dynamo gave it ("" when it was planned)."""

    compile_id: str
    index: int
    ops: int = 0
    applied: dict[str, int] = field(default_factory=dict)
    misses: list[Miss] = field(default_factory=list)
    failed: list[Failure] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    frozen: int = 0
    dynamic: bool = False
    untouched: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def fired(self) -> list[str]:
        """The rules that rewrote this graph, in plan order."""
        return list(self.applied)

    def to_json(self) -> dict[str, Any]:
        return {
            "compile_id": self.compile_id,
            "index": self.index,
            "ops": self.ops,
            "applied": dict(self.applied),
            "misses": [m.to_json() for m in self.misses],
            "failed": [f.to_json() for f in self.failed],
            "skipped": [s.to_json() for s in self.skipped],
            "frozen": self.frozen,
            "dynamic": self.dynamic,
            "untouched": self.untouched,
            "notes": list(self.notes),
        }

    def summary(self) -> str:
        head = f"graph {self.compile_id} ({self.ops} ops{', dynamic' if self.dynamic else ''})"
        if self.untouched:
            return f"{head}: untouched, {self.untouched}"
        fired = ", ".join(f"{r} x{n}" for r, n in self.applied.items()) or "no rule fired"
        return f"{head}: {fired}; {len(self.misses)} misses"


def _compile_id() -> str:
    from torch._guards import CompileContext

    cid = CompileContext.current_compile_id()
    return str(cid) if cid is not None else "?"


def _target(options: Options, example_inputs: Sequence[Any]) -> str:
    if options.target is not None:
        return options.target
    device = next((x.device for x in example_inputs if isinstance(x, torch.Tensor)), None)
    return "cuda" if device is not None and device.type == "cuda" else "cpu"


def _inductor(gm: fx.GraphModule, inputs: list[Any], config: dict | None) -> Callable:
    """Inductor's compiled callable for `gm` (compile_fx, the `inductor` backend's own), its
    cache entries keyed on opswap's kernels too (kernels._cache_key)."""
    from torch._inductor.compile_fx import compile_fx

    from opswap.kernels._cache_key import inductor_options

    compiled = compile_fx(gm, inputs, config_patches=inductor_options(config))
    assert callable(compiled)  # compile_fx returns other things only for AOT-compile modes
    return compiled


#: lines of torch's compile errors that say how to debug, not what went wrong
_ADVICE = (
    "Set TORCHDYNAMO_VERBOSE",
    "For even more developer context",
    "This error most often comes from",
    "Use torch.library.opcheck",
    "See https://",
    "Hint:",
    "Developer debug context",
    "For more details about this graph break",
    "You can suppress this exception",
    "import torch._dynamo",
    "torch._dynamo.config.suppress_errors",
)
#: a line that names the op (or node) an error is about
_NAMES_OP = re.compile(r"Error in op:|target:|call_function|torch\.ops\.|\b\w+::\w+")


def compile_failure(e: BaseException, limit: int = 300) -> str:
    """What a torch.compile error says, in one line: `Type: message` of the error torch's
    wrappers carry (BackendCompilerFailed's, InductorError's), its first line that is not
    advice, and after it the line naming the op when that is another, e.g. "AssertionError:
    expected size 32==32, stride 64==1 at dim=1; ... (Error in op: torch.ops.opswap.
    conv_relu.default)"."""
    seen = {id(e)}
    while isinstance(getattr(e, "inner_exception", None), BaseException):
        e = e.inner_exception  # type: ignore[attr-defined]
        if id(e) in seen:
            break
        seen.add(id(e))
    lines = []
    for raw in str(e).splitlines():
        line = raw.strip()
        if line.startswith("from user code:"):  # the user's stack follows
            break
        if line and not line.startswith(_ADVICE):
            lines.append(line)
    if not lines:
        return type(e).__name__
    text = lines[0][:limit]
    if not _NAMES_OP.search(lines[0]):
        op = next((line for line in lines[1:] if _NAMES_OP.search(line)), None)
        if op is not None:
            text += f" ({op[: limit + 100]})"
    return f"{type(e).__name__}: {text}"


def rewrite(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    weights: list[int],
    options: Options,
    report: GraphReport,
) -> tuple[fx.GraphModule | None, Frozen]:
    """Plan and apply opswap's rules on a copy of one Dynamo graph, whose inputs at
    `weights` are module weights; (the rewritten graph, the weights it holds as
    constants), or (None, ...) when it is to be compiled as it is, with the reason in
    `report.untouched`. `gm` itself is not changed."""
    from opswap.graph.capture import Captured
    from opswap.graph.ops import compute_nodes
    from opswap.planner import apply_plan, make_plan

    report.ops = sum(1 for _ in compute_nodes(gm))
    if records_autograd(list(example_inputs)):
        report.untouched = (
            "it records autograd (grad mode is on and an input requires grad), and opswap "
            "rewrites inference graphs only; run inference under torch.no_grad()"
        )
        return None, Frozen()
    with outside_dynamo():
        work = fx.GraphModule(gm, copy.deepcopy(gm.graph))
        work.meta.update(gm.meta)
        frozen = freeze(work, list(example_inputs), weights) if options.freeze else Frozen()
        report.frozen = len(frozen.weights)
        report.notes += [f"kept as an input: {why}" for why in frozen.kept]
        if not options.freeze:
            report.notes.append(
                "freeze=False: module weights stay graph inputs, so rules that fold or "
                "repack weights refuse them (their misses say which)"
            )
        inputs = real_inputs(work, list(example_inputs), frozen)
        if inputs is None:
            report.untouched = "a size depends on the data (Dynamo gives it no value to plan at)"
            return None, frozen
        captured = Captured(work, "fx", inputs)
        report.dynamic = is_dynamic(work)
        if report.dynamic:
            for scale in (1, 2):  # a probe at a size the graph takes tells rules which dims move
                probe = probes(work, inputs, scale)
                captured.probes = [probe] if probe is not None else []
                if captured.propagate(work) == [None]:
                    break
            else:
                report.untouched = (
                    "its sizes are symbolic and it failed at the other sizes opswap "
                    "probed it at, so no rule could tell which sizes move"
                )
                return None, frozen
        else:
            captured.propagate(work)
        plan = make_plan(
            captured,
            target=_target(options, example_inputs),
            rules=list(options.rules),
            exactness=options.exactness,
            model_name=f"graph {report.compile_id}",
        )
        report.misses, report.skipped = list(plan.misses), list(plan.skipped)
        report.failed = list(plan.failed)
        if not plan.decisions:
            return None, frozen
        applied = apply_plan(captured, plan)
        report.failed += applied.failed
        report.applied = dict(Counter(s.rule for s in applied.applied))
        if not applied.applied:
            return None, frozen
        return applied.gm, thaw(applied.gm, frozen)


class _Guarded:
    """A compiled graph that holds module weights as constants, checking on each call that
    the weights coming in are the ones it was planned on; when not (load_state_dict, an
    optimizer step, a Parameter replaced), it plans and compiles again for the new ones,
    up to _MAX_REPLANS times, then compiles the graph as Dynamo gave it."""

    def __init__(
        self,
        gm: fx.GraphModule,
        weights: list[int],
        options: Options,
        report: GraphReport,
        frozen: Frozen,
        compiled: Callable,
        config: dict | None,
    ) -> None:
        from torch._guards import TracingContext

        self.gm, self.weights, self.options, self.report = gm, weights, options, report
        self.frozen, self.fn, self.config = frozen, compiled, config
        self.context = TracingContext.try_get()  # the shape environment Inductor compiled in
        self.fakes = [n.meta.get("example_value") for n in placeholders(gm)]
        self.replans = 0

    def __call__(self, *args: Any) -> Any:
        if not self.frozen.holds(args):
            self._replan(args)
        return self.fn(*args)

    def _compile(self, gm: fx.GraphModule) -> Callable:
        from torch._guards import tracing

        with tracing(self.context):
            return _inductor(gm, self.fakes, self.config)

    def _replan(self, args: tuple) -> None:
        self.replans += 1
        why = self.frozen.changed(args)
        if self.replans > _MAX_REPLANS:
            self.report.notes.append(
                f"the weights changed again ({why}); compiled without opswap's rules"
            )
            self.frozen, self.fn = Frozen(), self._compile(self.gm)
        else:
            self.report.notes.append(f"the weights changed ({why}); planned again")
            gm, frozen = rewrite(self.gm, list(args), self.weights, self.options, self.report)
            self.frozen = frozen if gm is not None else Frozen()
            self.fn = self._compile(gm if gm is not None else self.gm)
        if self.options.report is not None:
            self.options.report(self.report)


class Backend:
    """A torch.compile backend that applies opswap's rules, then Inductor. One instance
    may serve several torch.compile calls; `reports` lists every graph it compiled."""

    def __init__(self, options: Options | None = None):
        self.options = options or Options()
        self.reports: list[GraphReport] = []

    def __call__(
        self,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        *,
        options: dict[str, Any] | None = None,
        mode: str | None = None,
    ) -> Callable:
        """Dynamo's entry: compile one graph. `options` and `mode` are torch.compile's
        (`torch.compile(m, backend="opswap", options={"rules": "fusion.*"})`)."""
        from torch._inductor import list_mode_options

        opts = self.options if options is None else Options.make(**options)
        config = list_mode_options(mode) if mode else None
        report = GraphReport(_compile_id(), len(self.reports))
        self.reports.append(report)
        weights = weight_positions(gm, list(example_inputs))
        try:
            new, frozen = rewrite(gm, example_inputs, weights, opts, report)
        except Exception as e:  # a rule or a planner bug must not take the compile down
            report.untouched = f"planning it raised {compile_failure(e)}"
            new, frozen = None, Frozen()
        if opts.report is not None:
            opts.report(report)
        if new is None:
            return _inductor(gm, list(example_inputs), config)
        compiled = _inductor(new, list(example_inputs), config)
        if not frozen.weights:
            return compiled
        return _Guarded(gm, weights, opts, report, frozen, compiled, config)

    def summary(self) -> str:
        """One line per graph compiled: what fired, or why it was left alone."""
        return "\n".join(r.summary() for r in self.reports) or "no graph compiled yet"

    def reset(self) -> None:
        """Forget the reports (torch._dynamo.reset() calls this)."""
        self.reports.clear()


def backend(
    rules: str | Sequence[str] | None = None,
    exactness: str = "exact",
    *,
    target: str | None = None,
    freeze: bool = True,
    report: Callable[[GraphReport], None] | None = None,
) -> Backend:
    """A backend for torch.compile planning with these settings; a bad setting raises an
    OpswapError now, before anything is compiled."""
    return Backend(
        Options.make(rules=rules, exactness=exactness, target=target, freeze=freeze, report=report)
    )


#: the backend `torch.compile(model, backend="opswap")` finds through the
#: `torch_dynamo_backends` entry point: every rule at exactness exact
opswap_backend = Backend()
