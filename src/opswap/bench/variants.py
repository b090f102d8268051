"""The race at the end of the flow: every way the user could run the model, verified and
timed in one interleaved loop.

A speed-up against eager alone hides the question a user asks: "is this faster than
what I would do anyway?" So the candidates are

- `input`: the model as given (the yardstick: speed-ups are against it);
- `captured`: opswap's capture with no rewrite (shows what the capture itself costs);
- `opswap`: the optimized candidate;
- with `compare=["compile"]`: `compile` (torch.compile of the input, the one line a user
  would try first) and `opswap+compile` (torch.compile of the candidate).

Each is verified against the input before it may win, and all are timed in the same
`benchmark` call, so drift and neighbours hit them alike. The saved result is the
fastest verified variant; when nothing opswap made beats the input, the result is the
input unchanged. A runtime (ONNX Runtime, OpenVINO, ...) is one more builder here.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from opswap.errors import OpswapError

BASELINES = ("compile",)


@dataclass
class Variant:
    """One way to run the model. `saves` says what the saved artifact is when it wins:
    the input's graph or the candidate's, and whether it is to be compiled."""

    name: str
    fn: Callable | None
    saves: str  # "input" or "candidate"
    compiled: bool = False
    compile_s: float | None = None
    verified: bool | None = None
    reasons: list[str] = field(default_factory=list)
    note: str = ""


@dataclass
class VariantTiming:
    """A variant's place in the race: its median and spread, and its speed-up over the
    input as the ratio of the medians (so it agrees with the times printed beside it),
    with the quartiles of the per-round ratios as its noise."""

    name: str
    ms: float | None
    iqr_ms: float | None
    speedup_vs_input: float | None
    ratio_q1: float | None
    ratio_q3: float | None
    verified: bool
    compile_s: float | None = None
    note: str = ""

    @property
    def within_noise(self) -> bool:
        return (self.ratio_q1 is not None and self.ratio_q3 is not None
                and self.ratio_q1 <= 1.0 <= self.ratio_q3)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "ms": self.ms, "iqr_ms": self.iqr_ms,
                "speedup_vs_input": self.speedup_vs_input,
                "speedup_quartiles": [self.ratio_q1, self.ratio_q3],
                "within_noise": self.within_noise, "verified": self.verified,
                "compile_s": self.compile_s, "note": self.note}


def parse_compare(compare) -> list[str]:
    """The baselines a `--compare` setting asks for: "compile" (default), "none", or a
    list / comma-separated string of baseline names."""
    if compare is None:
        return ["compile"]
    items = [c.strip().lower() for c in (compare.split(",") if isinstance(compare, str)
                                         else compare) if str(c).strip()]
    if items in ([], ["none"]):
        return []
    bad = [c for c in items if c not in BASELINES]
    if bad:
        raise OpswapError(f"Unknown baseline {bad[0]!r} for --compare; use "
                          f"{', '.join(BASELINES)} or none.")
    return list(dict.fromkeys(items))


def compile_unavailable(device: torch.device) -> str | None:
    """Why torch.compile cannot run here, or None. On CPU Inductor writes C++ and needs a
    compiler on the PATH."""
    if device.type == "cpu" and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        return "no C++ compiler on the PATH, which torch.compile's CPU backend needs"
    return None


def _compiled(name: str, module, inputs: tuple, saves: str) -> Variant:
    """torch.compile of `module`, compiled now (first call timed as its compile time)."""
    try:
        fn = torch.compile(module)
        t0 = time.perf_counter()
        with torch.inference_mode():
            fn(*inputs)
        return Variant(name, fn, saves, compiled=True, compile_s=time.perf_counter() - t0)
    except Exception as e:  # a model Dynamo or Inductor cannot take: the race goes on
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        return Variant(name, None, saves, compiled=True, verified=False,
                       reasons=[f"torch.compile failed: {type(e).__name__}: {first}"],
                       note="torch.compile failed")


def build(model, captured_gm, candidate_gm, inputs: tuple, compare: list[str],
          device: torch.device) -> list[Variant]:
    """The variants of one run. `model` is opswap's private copy of the input; compiled
    variants compile private copies, so the models timed elsewhere stay eager."""
    from opswap.graph.copies import private_copy

    out = [Variant("input", model, "input", verified=True),
           Variant("captured", captured_gm, "input"),
           Variant("opswap", candidate_gm, "candidate")]
    if "compile" in compare:
        why = compile_unavailable(device)
        if why is not None:
            out += [Variant(n, None, s, compiled=True, verified=False, reasons=[why], note=why)
                    for n, s in (("compile", "input"), ("opswap+compile", "candidate"))]
        else:
            out.append(_compiled("compile", private_copy(model), inputs, "input"))
            out.append(_compiled("opswap+compile", private_copy(candidate_gm), inputs,
                                 "candidate"))
    return out


def race(variants: list[Variant], inputs: tuple, device: torch.device, *,
         min_time_s: float = 0.5) -> list[VariantTiming]:
    """Time every verified variant in one interleaved loop (inference mode; buffers put
    back afterwards). Unverified variants are listed without a time."""
    from opswap.bench.timing import benchmark
    from opswap.graph.copies import preserved_state

    runnable = [v for v in variants if v.fn is not None and v.verified]
    fns = {v.name: (lambda f=v.fn: f(*inputs)) for v in runnable}
    mods = [v.fn for v in runnable]
    with torch.inference_mode(), preserved_state(*mods):
        res = benchmark(fns, warmup=3, repeats=15, min_time_s=min_time_s, device=device)
    base = res["input"].median
    out = []
    for v in variants:
        if v.name not in fns:
            out.append(VariantTiming(v.name, None, None, None, None, None, False, v.compile_s,
                                     v.note or "; ".join(v.reasons)[:200]))
            continue
        s = res[v.name]
        r = res.ratio("input", v.name)
        out.append(VariantTiming(v.name, s.median * 1e3, s.iqr * 1e3, base / s.median,
                                 r.q1, r.q3, True, v.compile_s, v.note))
    return out


def best(timings: list[VariantTiming]) -> VariantTiming:
    """The fastest verified variant; the input unless something is faster than it beyond
    the noise of the run (its per-round speed-ups' lower quartile above 1)."""
    by = {t.name: t for t in timings}
    faster = [t for t in timings if t.verified and t.name != "input" and t.ms is not None
              and t.ratio_q1 is not None and t.ratio_q1 > 1.0]
    return min(faster, key=lambda t: t.ms) if faster else by["input"]


def run(model, captured, candidate_gm, verification, verify_fn, *, compare: list[str],
        device) -> tuple[list[VariantTiming], VariantTiming]:
    """Build, verify and race the variants of one optimize run; returns the timings and
    the winner. `verify_fn(fn, shapes: bool)` verifies a callable against the input,
    at every claimed shape when `shapes`, else at the example's (compiled variants
    would recompile for each new shape)."""
    from opswap.bench.timing import resolve_device

    dev = resolve_device(device)
    variants = build(model, captured.gm, candidate_gm, captured.example_inputs, compare, dev)
    for v in variants:
        if v.verified is not None:
            continue
        if v.name == "opswap":
            v.verified, v.reasons = verification.passed, list(verification.reasons)
        elif v.name == "captured":
            v.verified, v.note = True, "checked against the input when it was captured"
        else:
            check = verify_fn(v.fn, shapes=not v.compiled)
            v.verified, v.reasons = check.passed, list(check.reasons)
            if v.compiled:
                v.note = (f"compiled in {v.compile_s:.1f} s; verified at the example's shape"
                          if v.compile_s is not None else v.note)
    timings = race(variants, captured.example_inputs, dev)
    return timings, best(timings)
