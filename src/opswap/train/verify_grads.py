"""Outputs, loss and every parameter's gradient of a rewritten model against eager.

`verify_grads(reference, candidate, batch, ...)` runs both on several batches (the
example, and the capture's other sizes where the model takes them: batch 1, a larger
batch, another sequence length; floating inputs drawn afresh, integer ones such as token
ids and labels kept), each from the same random state, so a dropout draws the same mask
in both: a rewrite that drops, moves or re-draws a dropout differs and is refused (the
strict choice: the check cannot tell a legitimately re-drawn mask from a lost one).
BatchNorm runs in train mode in both, from the same running statistics, which are put
back after each run. The reference is eager float32; gradients come from
`torch.autograd.grad`, so no `.grad` of any parameter is touched.

What is compared on each batch: the output (the loss, when the module returns one; else
every output tensor, reduced to a scalar by a fixed random projection for the backward)
and each parameter's gradient, as the largest absolute difference over the largest
absolute reference value (a relative error that a gradient near zero in places does not
inflate), that value taken at least 1e-3 of the batch's largest gradient of any
parameter (a bias before a train-mode BatchNorm has a gradient that is zero but for
rounding). For a bf16 or fp16 candidate, eager in that dtype is run too, and the
candidate may err by the tolerance or by twice eager's own error, whichever is larger
(STYLE.md: a low-precision kernel errs at most a small multiple of PyTorch's own op). The tolerance follows exactness and the candidate's dtype.
A float32 model trained in mixed precision (`precision=`, a prepared module's bf16, fp16
or fp8) is compared the same way, at that precision's tolerance (`tolerance`), with eager
in that precision as the peer whose error, doubled, the candidate may also reach.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from opswap.graph.copies import preserved_state
from opswap.graph.inputs import fresh

__all__ = ["GradCheck", "ParamError", "sample_batches", "tolerance", "verify_grads"]

_BASE = {"exact": 1e-4, "approx": 2e-2, "lossy": 1e-1}
_FLOOR = 1e-3  # a gradient's scale is at least this share of the batch's largest


#: the least tolerance of a mixed-precision training (prepare's `precision`): 4 roundings
#: of the dtype the matmuls run in (bf16 eps 2^-7: 3.1e-2; fp16 eps 2^-10: 3.9e-3), and for
#: fp8 one rounding of e5m2, the gradients' format (eps 2^-2) -- each matmul rounds its
#: inputs once, and a gradient passes through a few of them
_PRECISION = {"float32": 0.0, "bf16": 4 * 2.0**-7, "fp16": 4 * 2.0**-10, "fp8": 2.0**-2}


def tolerance(
    exactness: str, dtype: torch.dtype = torch.float32, precision: str = "float32"
) -> float:
    """The largest relative error (max |diff| / max |reference|) a gradient may show: 1e-4
    for exact rewrites of a float32 model (a sum in another order), 2e-2 approx, 1e-1
    lossy; at least 4 roundings of a lower-precision model's dtype, and at least
    `precision`'s figure when a float32 model trains in mixed precision (bf16 3.1e-2 >
    fp16 3.9e-3 > float32, and fp8 0.25)."""
    base = _BASE[exactness]
    if dtype in (torch.bfloat16, torch.float16):
        base = max(base, 4 * torch.finfo(dtype).eps)
    return max(base, _PRECISION[precision])


@dataclass
class ParamError:
    """A parameter's worst gradient error over the batches."""

    name: str
    error: float  # max |candidate - reference| / max |reference|
    batch: str
    #: the error allowed: the tolerance, or twice eager's own in a low-precision dtype
    allowed: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "error": self.error,
            "batch": self.batch,
            "allowed": self.allowed,
        }


@dataclass
class GradCheck:
    passed: bool
    reason: str
    tolerance: float
    batches: list[str] = field(default_factory=list)
    output_error: float = 0.0  # the worst output (loss) error over the batches
    params: list[ParamError] = field(default_factory=list)  # worst first

    @property
    def worst(self) -> ParamError | None:
        return self.params[0] if self.params else None

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "reason": self.reason,
            "tolerance": self.tolerance,
            "batches": list(self.batches),
            "output_error": self.output_error,
            "params": [p.to_json() for p in self.params],
        }

    def __str__(self) -> str:
        w = self.worst
        where = f", worst gradient {w.error:.2e} at {w.name} ({w.batch})" if w else ""
        verdict = "passed" if self.passed else f"FAILED: {self.reason}"
        return (
            f"gradients of {len(self.params)} parameter(s) on {len(self.batches)} batch(es): "
            f"output error {self.output_error:.2e}{where}, tolerance {self.tolerance:.2g}; "
            f"{verdict}"
        )


def sample_batches(
    batch: tuple[Any, ...], captured: Any = None, n: int = 3
) -> list[tuple[str, tuple[Any, ...]]]:
    """(label, batch) x n: the example, then the capture's other sizes (`captured`, a
    graph.capture.Captured, None: the example again), floating tensors drawn afresh."""
    others = list(captured.variants()) if captured is not None else []
    sized = {tuple(_sizes(b)) for _, b in others}
    # prefer a different size each time; fall back to the example with new values
    picked = [("example", batch)]
    for label, b in others:
        if len(picked) >= n:
            break
        if tuple(_sizes(b)) in sized and tuple(_sizes(b)) != tuple(_sizes(batch)):
            picked.append((label, b))
            sized.discard(tuple(_sizes(b)))
    gen = torch.Generator().manual_seed(1234)
    while len(picked) < n:
        picked.append((f"example, new values {len(picked)}", batch))
    return [(label, _redrawn(b, gen) if i else b) for i, (label, b) in enumerate(picked)]


def _sizes(batch: tuple[Any, ...]) -> list[tuple[int, ...]]:
    return [tuple(x.shape) for x in pytree.tree_leaves(list(batch)) if isinstance(x, torch.Tensor)]


def _redrawn(batch: tuple[Any, ...], gen: torch.Generator) -> tuple[Any, ...]:
    def draw(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            new = torch.randn(x.shape, generator=gen, dtype=torch.float32)
            return new.to(dtype=x.dtype, device=x.device)
        return x

    return tuple(pytree.tree_map(draw, list(batch)))


def _scalar(out: Any, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The scalar to differentiate and the output tensors to compare."""
    tensors = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    floats = [t for t in tensors if t.is_floating_point()]
    if not floats:
        raise ValueError("the module returns no floating-point tensor to differentiate")
    if len(floats) == 1 and floats[0].dim() == 0:
        return floats[0].float(), floats
    gen = torch.Generator().manual_seed(seed)
    total = torch.zeros((), device=floats[0].device)
    for t in floats:
        r = torch.randn(t.shape, generator=gen).to(t.device)
        total = total + (t.float() * r).sum()
    return total, floats


def _in_dtype(reference: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Eager in the candidate's dtype: the float32 reference's copy, cast back (a bf16 or
    fp16 weight survives the round trip through float32 exactly)."""
    from opswap.graph.copies import private_copy

    return private_copy(reference).to(dtype)


def _in_precision(reference: nn.Module, precision: str) -> tuple[nn.Module, str]:
    """Eager in a mixed precision: the reference's copy, run under autocast (bf16, fp16),
    or with its eligible Linears made Float8Linear (fp8); and the precision to run it in."""
    from opswap.graph.copies import private_copy

    low = private_copy(reference)
    if precision == "fp8":
        from opswap.train.precision import float8_linears

        if not isinstance(low, nn.Linear):  # torchao swaps children, not the root
            float8_linears(low)
        return low, "float32"
    return low, precision


def _as_float(batch: tuple[Any, ...]) -> tuple[Any, ...]:
    low = (torch.bfloat16, torch.float16)
    return tuple(
        pytree.tree_map(
            lambda x: x.float() if isinstance(x, torch.Tensor) and x.dtype in low else x,
            list(batch),
        )
    )


def _run(
    module: nn.Module,
    batch: tuple[Any, ...],
    params: Sequence[nn.Parameter],
    seed: int,
    upcast: bool = False,
    precision: str = "float32",
) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    from opswap.train.precision import mixed

    device = params[0].device.type if params else "cpu"
    with preserved_state(module), torch.random.fork_rng(devices=[]), torch.enable_grad():
        torch.manual_seed(seed)
        with mixed(precision, device):
            out = module(*(_as_float(fresh(batch)) if upcast else fresh(batch)))
        scalar, outputs = _scalar(out, seed)
        grads = torch.autograd.grad(scalar, list(params), allow_unused=True)
    return [o.detach().float() for o in outputs], list(grads)


def _error(got: torch.Tensor | None, want: torch.Tensor | None, floor: float = 1e-12) -> float:
    if got is None and want is None:
        return 0.0
    if got is None or want is None:
        other = want if got is None else got
        assert other is not None
        return 0.0 if not bool(other.any()) else float("inf")
    got, want = got.detach().double(), want.detach().double()
    if got.shape != want.shape:
        return float("inf")
    scale = float(want.abs().max()) if want.numel() else 0.0
    diff = float((got - want).abs().max()) if want.numel() else 0.0
    if diff != diff:  # NaN
        return float("inf")
    return diff / max(scale, floor) if max(scale, floor) > 0 else diff


def verify_grads(
    reference: nn.Module,
    candidate: nn.Module,
    batch: Sequence[Any],
    captured: Any = None,
    batches: Sequence[Sequence[Any]] | None = None,
    exactness: str = "exact",
    *,
    names: dict[int, str] | None = None,
    n: int = 3,
    seed: int = 0,
    precision: str = "float32",
) -> GradCheck:
    """Compare `candidate` with `reference` (eager float32) on `batches` (default: `n`
    from `sample_batches`): outputs or loss, and the gradient of every parameter the
    candidate holds, matched to the reference's by name (`names`: id of a candidate
    parameter -> the reference's name for it; default: the candidate's own names).

    `precision` is the one the candidate trains in (a prepared module's, which applies it
    itself): the tolerance widens to `tolerance(..., precision=)`, and eager in that
    precision (the reference under autocast, or with its Linears made Float8Linear) is
    the low-precision peer whose own error, doubled, the candidate may also reach."""
    if exactness not in _BASE:
        raise ValueError(f"exactness must be one of exact, approx, lossy; not {exactness!r}")
    if precision not in _PRECISION:
        raise ValueError(f"precision must be one of {', '.join(_PRECISION)}; not {precision!r}")
    named = [(n_, p) for n_, p in candidate.named_parameters() if p.requires_grad]
    ref_params = dict(reference.named_parameters())
    pairs: list[tuple[str, nn.Parameter, nn.Parameter]] = []
    for own, p in named:
        name = (names or {}).get(id(p), own)
        if name not in ref_params:
            return GradCheck(False, f"parameter {own} has no counterpart in the reference", 0.0)
        pairs.append((name, p, ref_params[name]))
    dtype = next((p.dtype for _, p, _ in pairs), torch.float32)
    tol = tolerance(exactness, dtype, precision)
    # a low-precision candidate may err by twice what eager errs in its dtype
    low = _in_dtype(reference, dtype) if dtype in (torch.bfloat16, torch.float16) else None
    low_precision = "float32"
    if low is None and precision != "float32":
        low, low_precision = _in_precision(reference, precision)
    low_params = dict(low.named_parameters()) if low is not None else {}
    todo = (
        [(f"batch {i}", tuple(b)) for i, b in enumerate(batches)]
        if batches is not None
        else sample_batches(tuple(batch), captured, n)
    )
    worst: dict[str, ParamError] = {}
    out_err, out_allowed = 0.0, tol
    for i, (label, b) in enumerate(todo):
        try:
            want_out, want = _run(reference, b, [r for _, _, r in pairs], seed + i, True)
            got_out, got = _run(candidate, b, [p for _, p, _ in pairs], seed + i)
            low_out, low_grads = (
                _run(low, b, [low_params[n_] for n_, _, _ in pairs], seed + i, False, low_precision)
                if low is not None
                else (want_out, want)
            )
        except Exception as e:  # a candidate that fails to run or differentiate fails
            return GradCheck(False, f"{label}: {type(e).__name__}: {e}"[:300], tol, [label])
        if len(got_out) != len(want_out):
            return GradCheck(False, f"{label}: {len(got_out)} outputs, not {len(want_out)}", tol)
        for a, lo, w in zip(got_out, low_out, want_out, strict=True):
            allowed = max(tol, 2 * _error(lo, w))
            if _error(a, w) / allowed > out_err / out_allowed:
                out_err, out_allowed = _error(a, w), allowed
        # a gradient that is zero in exact arithmetic (a bias before a train-mode
        # BatchNorm) is judged against the batch's largest gradient, not its own noise
        floor = max(
            _FLOOR
            * max((float(r.abs().max()) for r in want if r is not None and r.numel()), default=0.0),
            1e-12,
        )
        for (name, _, _), g, o, r in zip(pairs, got, low_grads, want, strict=True):
            err = _error(g, r, floor)
            allowed = max(tol, 2 * _error(o, r, floor))
            if name not in worst or err / allowed > worst[name].error / worst[name].allowed:
                worst[name] = ParamError(name, err, label, allowed)
    params = sorted(worst.values(), key=lambda p: -p.error / p.allowed)
    labels = [label for label, _ in todo]
    if out_err > out_allowed:
        return GradCheck(
            False,
            f"the output differs by {out_err:.2e} (allowed {out_allowed:.1e})",
            tol,
            labels,
            out_err,
            params,
        )
    if params and params[0].error > params[0].allowed:
        bad = params[0]
        return GradCheck(
            False,
            f"the gradient of {bad.name} differs by {bad.error:.2e} on {bad.batch} "
            f"(allowed {bad.allowed:.1e})",
            tol,
            labels,
            out_err,
            params,
        )
    return GradCheck(True, "", tol, labels, out_err, params)
