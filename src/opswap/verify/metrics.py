"""How far a candidate tensor is from a reference tensor, in the five usual measures.

Everything is computed in float64, whatever the dtypes compared, so the metric
itself adds no rounding worth mentioning: a float16 candidate is compared with a
float32 reference as the two sets of numbers they are.

- `max_abs`: largest |cand - ref|. In the units of the output; good for a hard
  bound when the output scale is known (probabilities, logits of a fixed model).
- `max_rel`: largest |cand - ref| / max(|ref|, floor) with
  floor = 1e-3 * max|ref| (1 when ref is all zero). Without the floor, one
  reference element that happens to be 1e-9 makes the ratio meaningless; with it,
  elements a thousand times below the tensor's peak are judged on the absolute
  scale of that peak instead.
- `cosine`: cos of the angle between the flattened tensors. Blind to a global
  scale, so it says "same direction", not "same numbers".
- `sqnr_db`: 10 log10(sum ref^2 / sum (cand - ref)^2); inf when equal. Signal
  to quantisation-noise ratio, the measure the quantisation literature uses
  (each bit of a uniform quantiser is worth about 6 dB).
- `rel_l2`: ||cand - ref|| / ||ref||. The same information as SQNR in a linear
  unit: sqnr_db = -20 log10(rel_l2).
- The absolute floor: a difference at or below `resolution(ref)` (one unit in the last
  place of the reference's peak in the reference's dtype, and never less than the
  dtype's smallest normal number) counts as zero in max_rel, cosine, SQNR and rel_l2.
  Below it the dtype cannot tell the numbers apart at the output's scale: an output of
  near-zero elements (denormals around 1e-40 in float32) that an exact BatchNorm fold
  changed by 2.8e-45 otherwise scores cosine 0.95 and the fold is rolled back.
  `max_abs` stays the raw largest difference, so `exact` still means bit for bit. Where
  there were differences and every one was at or below the floor (`within_resolution`),
  SQNR and rel_l2 read inf and 0 beside a nonzero max_abs: displays show both as
  `RESOLUTION` and say why in `RESOLUTION_NOTE`, so the three agree.
- `nonfinite`: positions where the candidate is NaN/Inf and the reference is
  finite, or the reference is NaN/Inf and the candidate holds anything else.
  The other measures are taken over the positions where both are finite.

Integer and bool tensors are compared the same way after a cast to float64, so
equal outputs give the perfect values (0, 1, inf) and a flipped token id shows up.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from opswap.errors import VerificationError

#: max_rel divides by max(|ref|, REL_FLOOR * max|ref|)
REL_FLOOR = 1e-3


@dataclass(frozen=True)
class Metrics:
    """Distance of a candidate from a reference (see the module docstring for each field)."""

    max_abs: float = 0.0
    max_rel: float = 0.0
    cosine: float = 1.0
    sqnr_db: float = math.inf
    rel_l2: float = 0.0
    numel: int = 0
    nonfinite: int = 0

    @property
    def exact(self) -> bool:
        """Bit-for-bit equal values (up to the float64 cast)."""
        return self.max_abs == 0.0 and self.nonfinite == 0

    def to_json(self) -> dict[str, Any]:
        # inf (equal outputs) stays a float: json.dumps writes Infinity and reads it back.
        return asdict(self)

    def __str__(self) -> str:
        return (
            f"max_abs={self.max_abs:.3g} max_rel={self.max_rel:.3g} "
            f"cosine={self.cosine:.9f} sqnr={self.sqnr_db:.1f}dB rel_l2={self.rel_l2:.3g}"
            + (f" nonfinite={self.nonfinite}" if self.nonfinite else "")
        )


#: what a display shows for SQNR and rel_l2 where `within_resolution`
RESOLUTION = "rounding"
RESOLUTION_NOTE = (
    f"{RESOLUTION}: every difference is within the dtype's resolution at the value's scale "
    "(eps times its largest magnitude), which cosine, sqnr and rel_l2 count as none; "
    "max_abs shows the largest"
)


def within_resolution(m: Metrics | Mapping[str, Any]) -> bool:
    """Whether `m` (Metrics or its to_json) found differences, all of them at or below the
    floor: max_abs above 0 while rel_l2 is 0 (the floor zeroed every one)."""
    get = m.get if isinstance(m, Mapping) else lambda k: getattr(m, k)
    return bool(get("max_abs")) and get("rel_l2") == 0.0 and not get("nonfinite")


def shown(m: Metrics | Mapping[str, Any], key: str, spec: str) -> str:
    """Field `key` of `m` formatted with `spec` (`.1f`, `.3g`), or `RESOLUTION` for SQNR
    and rel_l2 where `within_resolution`."""
    if key in ("sqnr_db", "rel_l2") and within_resolution(m):
        return RESOLUTION
    value = m[key] if isinstance(m, Mapping) else getattr(m, key)
    return format(value, spec) if isinstance(value, float) else str(value)


def _as_tensor(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach()
    return torch.as_tensor(x)


def resolution(ref: torch.Tensor) -> float:
    """The smallest difference `ref`'s dtype resolves at `ref`'s scale: eps times the
    peak |ref|, at least the dtype's smallest normal number; 0 for integers and bools."""
    if not ref.is_floating_point():
        return 0.0
    fi = torch.finfo(ref.dtype)
    finite = ref[torch.isfinite(ref)]
    peak = float(finite.abs().max()) if finite.numel() else 0.0
    return max(fi.tiny, fi.eps * peak)


def compare(ref, cand, floor: float | None = None) -> Metrics:
    """Metrics of `cand` against `ref` (tensors or numbers of the same shape); `floor` is
    the absolute difference that counts as zero (default: `resolution(ref)`; a caller
    comparing values derived from an output, such as the output centred per row, passes
    the output's own).

    Raises VerificationError when the shapes differ: there is nothing to compare.
    """
    r, c = _as_tensor(ref), _as_tensor(cand)
    if r.shape != c.shape:
        raise VerificationError(
            f"Cannot compare a candidate of shape {tuple(c.shape)} with a reference of shape "
            f"{tuple(r.shape)}; the replacement changed the output shape."
        )
    if r.is_complex() or c.is_complex():
        r = torch.view_as_real(r.to(torch.complex128))
        c = torch.view_as_real(c.to(torch.complex128))
    if floor is None:
        floor = resolution(r)  # in the reference's own dtype, before the float64 cast
    r = r.to(torch.float64)
    c = c.to(device=r.device, dtype=torch.float64)
    n = r.numel()
    if n == 0:
        return Metrics(numel=0)

    r_fin, c_fin = torch.isfinite(r), torch.isfinite(c)
    # cand NaN/Inf over a finite ref, or a non-finite ref not reproduced exactly (NaN == NaN here)
    same_nonfinite = (c == r) | (torch.isnan(r) & torch.isnan(c))
    bad = (r_fin & ~c_fin) | (~r_fin & ~same_nonfinite)
    nonfinite = int(bad.sum())
    both = r_fin & c_fin
    if not bool(both.all()):
        r, c = r[both], c[both]

    diff = (c - r).abs()
    if diff.numel() == 0:
        return Metrics(numel=n, nonfinite=nonfinite)
    max_abs = float(diff.max())
    if floor > 0 and max_abs > 0:
        below = diff <= floor
        c = torch.where(below, r, c)
        diff = diff.masked_fill_(below, 0.0)
    peak = float(r.abs().max())
    rel_floor = REL_FLOOR * peak if peak > 0 else 1.0
    max_rel = float((diff / r.abs().clamp_min(rel_floor)).max())

    signal = float((r * r).sum())
    noise = float((diff * diff).sum())
    if noise == 0.0:
        sqnr, rel_l2 = math.inf, 0.0
    elif signal == 0.0:
        sqnr, rel_l2 = -math.inf, math.inf
    else:
        sqnr = 10.0 * math.log10(signal / noise)
        rel_l2 = math.sqrt(noise / signal)

    norm_r, norm_c = math.sqrt(signal), float(torch.linalg.vector_norm(c))
    if noise == 0.0 or (norm_r == 0.0 and norm_c == 0.0):  # equal: exactly 1, not 1 - 2 ulp
        cosine = 1.0
    elif norm_r == 0.0 or norm_c == 0.0:
        cosine = 0.0
    else:
        cosine = float((r * c).sum()) / (norm_r * norm_c)
        cosine = max(-1.0, min(1.0, cosine))  # rounding can step just past 1
    return Metrics(max_abs, max_rel, cosine, sqnr, rel_l2, n, nonfinite)


def combine(metrics: Iterable[Metrics]) -> Metrics:
    """The worst case over several comparisons (samples, outputs): the largest errors,
    the smallest cosine and SQNR; element and non-finite counts add up."""
    ms = list(metrics)
    if not ms:
        return Metrics()
    return Metrics(
        max_abs=max(m.max_abs for m in ms),
        max_rel=max(m.max_rel for m in ms),
        cosine=min(m.cosine for m in ms),
        sqnr_db=min(m.sqnr_db for m in ms),
        rel_l2=max(m.rel_l2 for m in ms),
        numel=sum(m.numel for m in ms),
        nonfinite=sum(m.nonfinite for m in ms),
    )
