"""Fresh inputs shaped like the example: verification must not pass by luck on one input.

Each new sample keeps every input's shape, dtype, device and strides:

- floating tensors are drawn from a normal with the example's own mean and std, so
  a normalised image stays normalised and hidden states keep their scale;
- integer tensors (token ids, indices, class labels) are drawn uniformly from the
  example's [min, max], so an embedding lookup stays inside its table;
- integer tensors of two values whose every row is one run of each (a 0/1 attention
  mask, ones then zeros or zeros then ones; token_type_ids 0..0 1..1) get new run
  lengths instead, the order of the runs kept: a mask stays a padding mask with at
  least one 1 per row where the example had one in every row, two segments stay two;
- bool tensors, tensors of a single value or of two values (0/1 or 0/-inf
  attention masks, padding masks stored as floats), tensors with NaN/Inf,
  complex tensors and non-tensor arguments are copied unchanged: they encode
  structure, not data.

Sample 0 is the example itself, so a failure on the user's own input is reported.

No sample holds inf or NaN, and none is far outside the example's scale: most models
are not meant to take them (an image model turns inf into NaN everywhere, in the
reference and the candidate alike, and a NaN matching a NaN counts as agreement, so such
a sample would check nothing). For a model that is meant to take them,
`extreme_sample` makes one (values at 1e4 times the example's spread, and on request
+inf, -inf and NaN once each in three rows); pass it to `verify` as a variant,
`variants=[("large and non-finite", extreme_sample(x, nonfinite=True))]`.

Outputs of class scores are judged on many rows (about 1000 to see a 1% rate of changed
classes, see `verify.decisions`); `row_samples` draws them as more fresh samples, at a
larger batch where the batch size is dynamic, so that they cost few calls.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils import _pytree as pytree

from opswap.graph.capture import as_inputs
from opswap.graph.dynamic import Dynamic, at, step_rows, within

#: rows for class scores are drawn in at most this many calls, at a batch of at most
#: DECISION_BATCH (or the example's) and at most DECISION_NUMEL output elements a call
DECISION_CALLS = 256
DECISION_BATCH = 64
DECISION_NUMEL = 1 << 22


def _is_structural(x: torch.Tensor) -> bool:
    """Masks and constants: a float tensor holding at most two distinct finite values."""
    if x.numel() < 2 or not bool(torch.isfinite(x).all()):
        return True
    lo, hi = x.min(), x.max()
    return bool(((x == lo) | (x == hi)).all())


def _new_runs(x: torch.Tensor, side: str, lo: int, hi: int, gen: torch.Generator) -> torch.Tensor:
    """Rows of `x` (one run of `hi` and one of `lo` each) with new run lengths; a row keeps
    at least one `hi` (one `lo`) where every row of `x` had one."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    low = 1 if bool((rows == hi).any(1).all()) else 0
    high = n - 1 if bool((rows == lo).any(1).all()) else n
    k = torch.randint(low, max(low, high) + 1, (rows.shape[0], 1), generator=gen)
    pos = torch.arange(n).unsqueeze(0)
    is_hi = pos < k if side == "head" else pos >= n - k
    return torch.where(is_hi, hi, lo).to(torch.int64).reshape(x.shape)


def _fresh(x, gen: torch.Generator):
    if not isinstance(x, torch.Tensor) or x.layout != torch.strided or x.is_complex():
        return x
    if x.dtype == torch.bool or x.numel() == 0:
        return x.clone()
    x = x.detach()
    if x.is_floating_point():
        if _is_structural(x):
            return x.clone()
        stats = x.to(torch.float64)
        mean, std = float(stats.mean()), float(stats.std())
        new = torch.randn(x.shape, generator=gen, dtype=torch.float64) * std + mean
    else:
        lo, hi = int(x.min()), int(x.max())
        if lo == hi:
            return x.clone()
        side = step_rows(x)
        if side is not None:
            new = _new_runs(x, side, lo, hi, gen)
        else:
            new = torch.randint(lo, hi + 1, x.shape, generator=gen, dtype=torch.int64)
    out = torch.empty_like(x)  # keeps strides (channels_last stays channels_last)
    out.copy_(new.to(x.device))
    return out


def make_samples(example_inputs, n: int = 3, seed: int = 0) -> list[tuple]:
    """`n` input tuples like `example_inputs` (a tuple of arguments, or a single tensor):
    the example itself first, then n - 1 fresh draws from a generator seeded with `seed`."""
    example = as_inputs(example_inputs)
    if n < 1:
        return []
    gen = torch.Generator().manual_seed(seed)
    samples = [example]
    for _ in range(n - 1):
        samples.append(tuple(pytree.tree_map(lambda x: _fresh(x, gen), list(example))))
    return samples


def data_ranges(batches) -> list[tuple[float, float] | None]:
    """Per positional input, the [min, max] its floating values take over `batches` (input
    tuples, the user's data); None for an input that is not a floating tensor of data (ids,
    masks, constants), whose draws are left as they are."""
    rows = [as_inputs(b) for b in batches]
    out: list[tuple[float, float] | None] = []
    for i in range(len(rows[0]) if rows else 0):
        xs = [r[i] for r in rows if i < len(r)]
        if not all(
            isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel() for x in xs
        ) or all(_is_structural(x) for x in xs):
            out.append(None)
            continue
        finite = [x[torch.isfinite(x)] for x in xs]
        finite = [f for f in finite if f.numel()]
        out.append(
            (min(float(f.min()) for f in finite), max(float(f.max()) for f in finite))
            if finite
            else None
        )
    return out


def clamped(sample, ranges: list[tuple[float, float] | None]) -> tuple:
    """`sample` with each floating input held inside its range of `ranges` (data_ranges):
    a random draw like the user's data that stays where that data lies."""
    out = []
    for i, x in enumerate(as_inputs(sample)):
        r = ranges[i] if i < len(ranges) else None
        if r is not None and isinstance(x, torch.Tensor) and x.is_floating_point():
            x = x.clamp(r[0], r[1])
        out.append(x)
    return tuple(out)


def refresh_floats(example_inputs, seed: int = 0) -> tuple:
    """`example_inputs` with fresh floating values (as in `make_samples`); integer, bool
    and structural tensors as they are, so ids, offsets and masks stay valid."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(
        pytree.tree_map(
            lambda x: (
                _fresh(x, gen) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
            ),
            list(as_inputs(example_inputs)),
        )
    )


def extreme_sample(
    example_inputs, scale: float = 1e4, nonfinite: bool = False, seed: int = 0
) -> tuple:
    """`example_inputs` with its floating (non-structural) tensors drawn at `scale` times
    their spread around their mean; with `nonfinite`, each also holds +inf, -inf and NaN
    once, at its first, middle and last element (three rows when it has three). Integer,
    bool and structural tensors stay as they are. Opt-in: see the module docstring."""
    gen = torch.Generator().manual_seed(seed)

    def wild(x):
        if (
            not isinstance(x, torch.Tensor)
            or not x.is_floating_point()
            or x.numel() < 2
            or _is_structural(x)
        ):
            return x
        stats = x.detach().to(torch.float64)
        new = torch.randn(x.shape, generator=gen, dtype=torch.float64) * float(
            stats.std()
        ) * scale + float(stats.mean())
        if nonfinite and x.numel() >= 3:
            flat = new.view(-1)
            flat[0], flat[flat.numel() // 2], flat[-1] = math.inf, -math.inf, math.nan
        out = torch.empty_like(x)  # keeps strides
        out.copy_(new.to(x.device))
        return out

    return tuple(pytree.tree_map(wild, list(as_inputs(example_inputs))))


def row_samples(
    example_inputs,
    rows: int,
    numel: int,
    needed: int,
    seed: int,
    dynamic: Dynamic | None = None,
) -> tuple[str, int, Iterator[tuple]]:
    """Fresh inputs like `example_inputs` that give `needed` more rows of an output having
    `rows` rows (`numel` elements) at the example's shape: at a larger batch where
    `dynamic` claims the batch size dynamic (up to DECISION_BATCH and DECISION_NUMEL
    output elements a call, within its guards), else at the example's shape; at most
    DECISION_CALLS calls. Returns the label of their shape, the number of calls, and the
    inputs, drawn one call at a time."""
    example = as_inputs(example_inputs)
    xs, per, label = example, max(rows, 1), "example shape"
    axis = dynamic.axis("batch") if dynamic is not None else None
    if dynamic is not None and axis is not None and rows >= axis.size and rows % axis.size == 0:
        item_rows, item_numel = rows // axis.size, max(numel // axis.size, 1)
        size = min(
            math.ceil(needed / item_rows),
            max(axis.size, DECISION_BATCH),
            max(axis.size, DECISION_NUMEL // item_numel),
        )
        if size > axis.size:
            grown = at(example, axis, size)
            if within(dynamic)(grown):
                xs, per, label = grown, item_rows * size, f"batch {size}"
    calls = max(0, min(DECISION_CALLS, math.ceil(needed / per)))

    def draws() -> Iterator[tuple]:
        gen = torch.Generator().manual_seed(seed)
        for _ in range(calls):
            yield tuple(pytree.tree_map(lambda x: _fresh(x, gen), list(xs)))

    return label, calls, draws()
