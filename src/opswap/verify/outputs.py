"""End-to-end check: do reference and candidate give the same outputs on several inputs?

Both are run on the same samples (the example first, then fresh random inputs of
the same shapes, see `samples.py`, then one fresh sample at each other shape the
model is claimed at: batch 1, a larger batch, another sequence length, see
`graph.dynamic`), under no_grad, in the mode (train/eval) each model is in, and from
the same random state (so dropout in training mode draws the same masks). Outputs of any nesting (tuples,
dicts, Hugging Face ModelOutputs) are flattened with pytree and matched leaf by
leaf; a different structure, shape or non-tensor value is a failure with its
reason, not an exception, and so is an output that is contiguous in the reference
but not in the candidate (the caller's `.view()` would raise). Buffers of both
models are put back afterwards, so a stateful model leaves verification as it
came in.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Container
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from opswap.errors import VerificationError
from opswap.graph.capture import as_inputs
from opswap.graph.copies import preserved_state
from opswap.graph.dynamic import Dynamic
from opswap.graph.inputs import fresh  # an in-place op in one model must not feed the other
from opswap.verify.decisions import Judged, graph_heads, read_scores
from opswap.verify.metrics import Metrics, combine, compare
from opswap.verify.rounding import own_rounding
from opswap.verify.samples import clamped, data_ranges, make_samples, refresh_floats, row_samples
from opswap.verify.tolerance import Tolerance, as_tolerance
from opswap.verify.verdict import OutputCheck, Verification

__all__ = ["OutputCheck", "Verification", "capture_check", "verify"]


@contextlib.contextmanager
def eval_mode(*fns):
    """Put the nn.Modules among `fns` in eval mode, restoring each one's mode afterwards.
    For opswap's own copies only: bench times models in eval mode; verification compares
    models in the mode they are in."""
    mods = [f for f in fns if isinstance(f, nn.Module)]
    modes = [[(m, m.training) for m in mod.modules()] for mod in mods]
    try:
        for mod in mods:
            try:
                mod.eval()
            except NotImplementedError:  # torch.export modules: the mode is baked into the graph
                pass
        yield
    finally:
        for saved in modes:
            for m, training in saved:
                m.training = training


@contextlib.contextmanager
def same_random(seed: int):
    """Run the body from a fixed random state, leaving the global one as it was, so that
    two models that draw the same random numbers (dropout in training mode) draw the
    same ones."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


@contextlib.contextmanager
def full_precision():
    """Run float32 as float32: TF32 off for cuBLAS and cuDNN while comparing.

    With TF32 on (cuDNN's default), two float32 convs that differ only in rounding
    (a folded BatchNorm) differ by ~1e-5 relative on GPU, and an exact rewrite would be
    judged by TF32's noise instead of its own error. A replacement that *means* to use
    TF32 must say so inside its module, where this switch does not reach.
    """
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _flatten(out) -> tuple[list[tuple[str, Any]], Any]:
    leaves, spec = pytree.tree_flatten_with_path(out)
    return [("output" + pytree.keystr(path), leaf) for path, leaf in leaves], spec


def _describe(spec) -> str:
    text = str(spec).replace("\n", " ")
    return text if len(text) <= 160 else text[:157] + "..."


def verify(
    reference: Callable,
    candidate: Callable,
    example_inputs,
    *,
    samples: int = 3,
    tolerance: Tolerance | str | None = None,
    seed: int = 0,
    variants=(),
    graph: fx.GraphModule | None = None,
    dynamic: Dynamic | None = None,
    given: list[tuple] | None = None,
) -> Verification:
    """Run `reference` and `candidate` on `samples` inputs like `example_inputs`, plus one
    fresh sample like each of `variants` ((label, inputs) at other shapes), and check
    their outputs against `tolerance` (a Tolerance, an exactness name or a budget string;
    default: exact).

    Outputs that hold class scores (`verify.decisions`: read from the values, and from
    `graph`, the reference's capture, or the reference itself when it is a graph module)
    are also judged centred per row and by how many rows change their top-1 (top-5)
    classes, on more rows where the tolerance allows some to change (`samples.row_samples`:
    at a larger batch where `dynamic`, the capture's dynamic sizes, claims one).

    With `given` (input tuples: the user's own data, such as calibration batches), the
    samples are those, then `samples` - 1 random draws like the first of them, and every
    random input (those draws, the other shapes' values, the rows for class scores) is held
    inside the range the given data takes (samples.data_ranges): a model calibrated for
    that data is judged where it was meant to run.

    Raises VerificationError when the reference itself cannot run, or `samples` < 1.
    """
    tol = as_tolerance(tolerance)
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise VerificationError(
            f"Verification needs at least one sample (the example itself); got {samples!r}."
        )
    inputs, labels, ranges = _inputs(example_inputs, samples, seed, variants, given)
    tally = _Tally(
        reference, candidate, tol, graph_heads(graph if graph is not None else reference)
    )
    with torch.no_grad(), full_precision(), preserved_state(reference, candidate):
        for i, sample in enumerate(inputs):
            if not tally.run(sample, seed + i, f"sample {i} ({labels[i]})"):
                break
        tally.more_rows(inputs[0], seed, dynamic, ranges)
    return tally.verdict(len(inputs), labels)


def _inputs(example_inputs, samples: int, seed: int, variants, given) -> tuple:
    """(input tuples, their labels, the given data's ranges or None) `verify` runs on."""
    ranges = None
    if given is not None:
        if not given:
            raise VerificationError("Verification on given data needs at least one batch.")
        data = [as_inputs(b) for b in given]
        ranges = data_ranges(data)
        inputs = data + [clamped(s, ranges) for s in make_samples(data[0], samples, seed)[1:]]
    else:
        inputs = make_samples(example_inputs, samples, seed)
    labels = [_shape_label(x) for x in inputs]
    for i, (label, variant) in enumerate(variants):
        fresh_values = refresh_floats(variant, seed + 1 + i)
        inputs.append(clamped(fresh_values, ranges) if ranges is not None else fresh_values)
        labels.append(label)
    return inputs, labels, ranges


def _leaf_reason(name: str, r: Any, c: Any, at: str) -> str | None:
    """Why output `name` of the candidate (`c`) cannot be compared with the reference's
    (`r`) by value, or None where it can."""
    if isinstance(r, torch.Tensor) != isinstance(c, torch.Tensor):
        return f"{name} is a {type(c).__name__} in the candidate and a {type(r).__name__} in the reference"
    if isinstance(r, torch.Tensor):
        if r.shape != c.shape:
            return (
                f"{name} has shape {tuple(c.shape)} in the candidate and "
                f"{tuple(r.shape)} in the reference (at {at})"
            )
        if r.is_contiguous() and not c.is_contiguous():
            return (
                f"{name} is contiguous in the reference but has strides "
                f"{tuple(c.stride())} in the candidate, so a caller's .view() of it would raise"
            )
        return None
    if isinstance(r, int | float | bool) or r == c:
        return None
    return f"{name} is {c!r} in the candidate and {r!r} in the reference"


class _Tally:
    """What `verify` has seen so far: each output's metrics over the samples, the reasons
    it cannot pass, and the class-score judgement of the outputs that hold class scores."""

    def __init__(self, reference: Callable, candidate: Callable, tol: Tolerance, heads) -> None:
        self.reference, self.candidate, self.tol, self.heads = reference, candidate, tol, heads
        self.per_output: dict[str, list[Metrics]] = {}
        self.order: list[str] = []
        self.failures: dict[str, list[str]] = {}
        self.general: list[str] = []
        self.judged: dict[str, Judged] = {}
        self.shape: dict[str, tuple[int, int]] = {}  # each class-score output's rows and size

    def _outputs(self, sample: tuple, seed_i: int, at: str) -> tuple | None:
        """Both models' outputs on `sample`, flattened; None (with the reason kept) when
        the candidate raised or returns another structure."""
        try:
            with same_random(seed_i):
                ref_out = self.reference(*fresh(sample))
        except Exception as e:
            raise VerificationError(
                f"The reference model raised {type(e).__name__} on {at} "
                f"({str(e).strip()[:200]}); check the example inputs."
            ) from e
        try:
            with same_random(seed_i):
                cand_out = self.candidate(*fresh(sample))
        except Exception as e:  # a broken candidate is a failed verification
            self.general.append(
                f"the candidate raised {type(e).__name__} on {at}: {str(e).strip()[:200]}"
            )
            return None
        ref_leaves, ref_spec = _flatten(ref_out)
        cand_leaves, cand_spec = _flatten(cand_out)
        if ref_spec != cand_spec:
            self.general.append(
                f"the candidate returns {_describe(cand_spec)} where the "
                f"reference returns {_describe(ref_spec)}"
            )
            return None
        return ref_leaves, cand_leaves

    def run(self, sample: tuple, seed_i: int, at: str, only: Container[str] | None = None) -> bool:
        """Compare both models' outputs on `sample` (only the outputs named in `only`);
        False when nothing more can be compared (the candidate raised, or its output
        structure differs)."""
        found = self._outputs(sample, seed_i, at)
        if found is None:
            return False
        ref_leaves, cand_leaves = found
        heads = (
            self.heads if self.heads is not None and len(self.heads) == len(ref_leaves) else None
        )
        for j, ((name, r), (_, c)) in enumerate(zip(ref_leaves, cand_leaves, strict=True)):
            if only is not None and name not in only:
                continue
            if name not in self.per_output:
                self._first(name, r, heads[j] if heads else None)
            reason = _leaf_reason(name, r, c, at)
            if reason is not None:
                if reason not in self.failures.setdefault(name, []):
                    self.failures[name].append(reason)
            elif isinstance(r, torch.Tensor):
                self.per_output[name].append(compare(r, c))
                if name in self.judged:
                    self.judged[name].add(r, c, self.tol.rounding_rel)
            elif isinstance(r, int | float | bool):
                self.per_output[name].append(compare(torch.tensor(r), torch.tensor(c)))
        return True

    def _first(self, name: str, r: Any, head: Any) -> None:
        """Start output `name`'s tally; judge it as class scores where it holds them."""
        self.per_output[name] = []
        self.order.append(name)
        scores = read_scores(name, r, head)
        if scores is not None:
            self.judged[name] = Judged(scores)
            self.shape[name] = (r.numel() // r.shape[-1], r.numel())

    def reasons_of(self, name: str, agreement: bool = True) -> list[str]:
        m = combine(self.per_output[name])
        why = self.tol.check(m)[1]
        if name in self.judged:
            why += self.judged[name].check(self.tol, m, agreement)
        return self.failures.get(name, []) + [f"{name}: {w}" for w in why]

    def open_to_rows(self, name: str) -> bool:
        """Whether more rows could change `name`'s verdict: it passes but for its top-k
        agreement, which is judged on the rows, and its rows so far do not settle that."""
        return (
            not self.general
            and not self.reasons_of(name, agreement=False)
            and not self.tol.decided(self.judged[name].top1)
        )

    def more_rows(self, first: tuple, seed: int, dynamic: Dynamic | None, ranges) -> None:
        """More rows for the class scores still passing, where the budget lets rows change;
        more again for a rate too close to the budget to tell."""
        tol = self.tol
        for settle in (False, True):
            want = tol.decision_rows(settle)
            open_ = [n for n in self.judged if self.open_to_rows(n)]
            if settle:
                open_ = [n for n in open_ if tol.unsettled(self.judged[n].top1)]
            if not want or not open_:
                return
            needed = want - min(self.judged[n].top1.rows for n in open_)
            rows, numel = min(self.shape[n] for n in open_)  # the output with the fewest rows
            start = seed + (20_011 if settle else 10_007)
            label, _, draws = row_samples(first, rows, numel, needed, start, dynamic)
            at = f"rows drawn for class scores ({label})"
            for j, sample in enumerate(draws):
                if ranges is not None:
                    sample = clamped(sample, ranges)
                try:
                    if not self.run(sample, start + j, at, open_):
                        break
                except VerificationError:  # the reference refuses the larger batch: judge
                    break  # on the rows it gave (OutputCheck.decisions counts them)
                open_ = [n for n in open_ if self.open_to_rows(n)]
                if not open_:
                    break

    def verdict(self, samples: int, labels: list[str]) -> Verification:
        checks: list[OutputCheck] = []
        for name in self.order:
            m = combine(self.per_output[name])
            why = self.reasons_of(name)
            checks.append(OutputCheck(name, m, not why, why, self.judged.get(name)))
        reasons = self.general + [r for c in checks for r in c.reasons]
        total = combine(c.metrics for c in checks)
        if not checks and self.general:  # nothing could be compared: no number to show
            nan = math.nan
            total = Metrics(nan, nan, nan, nan, nan, 0, 0)
        return Verification(
            total, not reasons, reasons, checks, samples, self.tol, list(dict.fromkeys(labels))
        )


def _shape_label(sample: tuple) -> str:
    shapes = [x for x in pytree.tree_leaves(list(sample)) if isinstance(x, torch.Tensor)]
    return (
        "example shape "
        + ", ".join("x".join(map(str, x.shape)) or "scalar" for x in shapes[:3])
        + (", ..." if len(shapes) > 3 else "")
    )


class CaptureCheck:
    """The comparison `graph.capture.capture` checks a graph with: the module's outputs at
    the exact tolerance, loosened to a low-precision model's own rounding."""

    def rounding(self, model: nn.Module, inputs: tuple) -> float | None:
        return own_rounding(model, inputs)

    def differs(
        self,
        model: nn.Module,
        gm: Callable,
        inputs: tuple,
        rounding: float | None,
        variants: list | None = None,
    ) -> str | None:
        tol = Tolerance.for_exactness("exact").at_rounding(rounding)
        # two samples at the example; one is enough beside the other shapes
        v = verify(
            model,
            gm,
            inputs,
            samples=2 if variants is None else 1,
            tolerance=tol,
            variants=variants or (),
        )
        return None if v.passed else v.reasons[0]


#: the check opswap's stages hand to graph.capture.capture
capture_check = CaptureCheck()


def compare_outputs(ref_out: Any, cand_out: Any, tolerance: Tolerance | str | None) -> list[str]:
    """Why `cand_out` does not match `ref_out` (two outputs of one call on the same inputs)
    within `tolerance`, output by output; empty when it does. For outputs computed
    elsewhere (a package run in a child process), where `verify` cannot call the model."""
    tol = as_tolerance(tolerance)
    ref_leaves, ref_spec = _flatten(ref_out)
    cand_leaves, cand_spec = _flatten(cand_out)
    if ref_spec != cand_spec:
        return [
            f"the candidate returns {_describe(cand_spec)} where the reference returns "
            f"{_describe(ref_spec)}"
        ]
    reasons: list[str] = []
    for (name, r), (_, c) in zip(ref_leaves, cand_leaves, strict=True):
        why = _leaf_reason(name, r, c, "the example")  # the same checks as `verify`'s
        if why is not None:
            reasons.append(why)
        elif isinstance(r, torch.Tensor):
            reasons += [f"{name}: {w}" for w in tol.check(compare(r, c.to(r.device)))[1]]
        elif isinstance(r, int | float | bool):
            reasons += [
                f"{name}: {w}" for w in tol.check(compare(torch.tensor(r), torch.tensor(c)))[1]
            ]
    return reasons
