"""The Python API: the same flow as the CLI, on a module and its example inputs.

    import opswap
    model, inputs = ...                      # any nn.Module and a tuple of inputs
    result = opswap.optimize(model, inputs, target="cpu", budget="cosine>=0.9999")
    result.save("out/")                      # plan.json, result.json, report.md/html, model
    fast = result.candidate                  # the optimized module; `model` is untouched

Example inputs are a tensor or a tuple of forward's positional arguments, a dict of
keyword inputs, or an (args, kwargs) pair. Keyword inputs are taken through a
graph.keywords.KeywordCall: the optimized module (and the saved model) then takes
the tensors positionally, the positional ones first and the keyword ones in the
order given, with the non-tensor values baked in; result.notes says which.
"""

from __future__ import annotations

import torch
from torch import nn

from opswap.graph.capture import Captured, Method, as_inputs
from opswap.graph.capture import capture as _capture
from opswap.graph.copies import preserved_state, private_copy
from opswap.graph.inputs import fresh
from opswap.graph.keywords import KeywordCall, keyword_call, positional
from opswap.models import LoadedModel
from opswap.models import load as _load
from opswap.pipeline import OptimizeConfig, Result, guarded
from opswap.pipeline import optimize as _optimize
from opswap.planner import Plan, apply_plan, make_plan
from opswap.verify.outputs import capture_check


def capture(model: nn.Module, example_inputs, method: Method = "auto", *,
            dynamic: str | None = "auto") -> Captured:
    """Capture `model` as graph.capture.capture does, checking that the graph reproduces
    the module's outputs (the verifier's comparison, which also measures a low-precision
    model's own rounding)."""
    return _capture(model, example_inputs, method, dynamic=dynamic, check=capture_check)


def load(spec: str, weights: str | None = None, **overrides) -> LoadedModel:
    """Load a model spec (zoo:NAME, hf:TYPE, file.py:fn, ...); overrides as keyword args;
    `weights`: a .safetensors or torch.save state dict copied into the model built."""
    return _load(spec, {k: str(v) for k, v in overrides.items()}, weights=weights)


def analyze(model: nn.Module, example_inputs, target: str = "cpu"):
    """Per-op FLOPs, bytes, intensity and bound of `model` on `target` (an Analysis whose
    bottleneck sentences name the rules that would relieve them)."""
    from opswap.cost.analyze import analyze as _analyze
    from opswap.report.advice import advised
    from opswap.targets import get_target

    return advised(_analyze(capture(*keyword_call(model, example_inputs)), get_target(target)))


def plan(model: nn.Module, example_inputs, *, target: str = "cpu",
         rules: list[str] | str | None = None, exactness: str = "exact") -> Plan:
    """Choose replacements for `model`; the Plan can be saved, edited and re-applied."""
    from opswap.bench.timing import with_timer
    from opswap.targets import get_target

    return make_plan(capture(*keyword_call(model, example_inputs)),
                     target=with_timer(get_target(target)), rules=rules, exactness=exactness,
                     model_name=type(model).__name__)


def apply(model: nn.Module, example_inputs, plan: Plan | str, *,
          allow_looser: bool = False) -> nn.Module:
    """Apply a Plan (or a path to plan.json) to a copy of `model`; returns the new module,
    which takes keyword inputs positionally (see the module doc) and refuses inputs outside
    the sizes it was captured at. A decision looser than the plan's exactness is refused
    unless `allow_looser`."""
    if not isinstance(plan, Plan):
        plan = Plan.load(plan)
    model, inputs = keyword_call(model, example_inputs)
    captured = capture(model, inputs)
    return guarded(apply_plan(captured, plan, allow_looser=allow_looser).gm, captured, model)


def verify(reference: nn.Module, candidate: nn.Module, example_inputs, *,
           exactness: str = "exact", budget: str | None = None, samples: int = 3,
           dynamic: str = "auto"):
    """Compare candidate with reference on random samples shaped like `example_inputs`, and
    at the other batch sizes and sequence lengths `dynamic` marks (see graph.dynamic).
    Both run as private copies: neither module is called nor changed. A copy keeps the
    hooks and parametrisations that compute weights (weight_norm, spectral_norm), so it
    computes what its module computes when called, and drops the user's other hooks (as
    `optimize` does, which notes them). With keyword inputs
    the reference is called with keywords, and so is the candidate unless it is a graph
    opswap made (an fx.GraphModule), which takes them positionally."""
    from opswap.graph.dynamic import detect, variants
    from opswap.verify.outputs import verify as _verify
    from opswap.verify.rounding import own_rounding
    from opswap.verify.tolerance import Tolerance, parse_budget

    reference, inputs = keyword_call(reference, example_inputs)
    candidate = positional(candidate, reference)
    reference, candidate = _private(reference), _private(candidate)
    inputs = fresh(as_inputs(inputs))  # the caller's tensors are never run on
    tol = Tolerance.for_exactness(exactness).at_rounding(
        own_rounding(reference, inputs) if isinstance(reference, nn.Module) else None)
    if budget:
        tol = parse_budget(budget, base=tol)

    def run(xs):
        with torch.no_grad(), preserved_state(reference):
            reference(*fresh(xs))

    shapes = variants(inputs, detect(run, inputs, dynamic))
    return _verify(reference, candidate, inputs, samples=samples, tolerance=tol,
                   variants=shapes)


def _private(fn):
    return private_copy(fn) if isinstance(fn, nn.Module) else fn


def bench(reference: nn.Module, candidate: nn.Module, example_inputs, *, device: str = "cpu"):
    """Time reference and candidate side by side, interleaved, after warm-up; keyword inputs
    as for `verify`."""
    from opswap.bench.timing import bench_models

    reference, inputs = keyword_call(reference, example_inputs)
    candidate = positional(candidate, reference)
    return bench_models(_private(reference), _private(candidate), as_inputs(inputs),
                        device=device)


def optimize(model: nn.Module, example_inputs, *, target: str = "cpu",
             rules: list[str] | str | None = None, exactness: str = "exact",
             budget: str | None = None, samples: int = 3, bench: bool = True,
             device: str = "cpu", dynamic: str = "auto", keep_hooks: bool = False,
             compare: str = "compile", name: str | None = None) -> Result:
    """The whole flow: analyze, plan, apply, verify (rolling back what breaks the budget),
    bench, and the race of variants against `compare`'s baselines ("compile" or "none").
    `model` is never called nor changed; `result.candidate` is the optimized module and
    `result.saved_module` the race's winner, which `result.save` writes. The user's hooks
    are left out, with a note; `keep_hooks=True` refuses a model that has any instead."""
    if isinstance(rules, str):
        rules = [r.strip() for r in rules.split(",") if r.strip()]
    config = OptimizeConfig(target=target, rules=list(rules or []), exactness=exactness,
                            budget=budget, samples=samples, bench=bench, device=device,
                            dynamic=dynamic, keep_hooks=keep_hooks, compare=compare)
    name = name or type(model).__name__
    model, example_inputs = keyword_call(model, example_inputs)
    result = _optimize(model, example_inputs, config, name=name)
    note_inputs(result, model)
    return result


def note_inputs(result: Result, model: nn.Module) -> None:
    """Record in result.notes the positional order a KeywordCall model's result takes."""
    if isinstance(model, KeywordCall):
        what = ("takes keyword inputs" if model.keywords else
                "was given inputs that are not tensors")
        result.notes.insert(0, f"The model {what}; the optimized model (and model.pt2) "
                               + model.describe() + ".")
