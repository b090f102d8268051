"""A busy machine on demand: a stand-in for bench.timing's clock, for tests and demos.

Figures that hold on a quiet machine and fall apart on a loaded one (an interval that
holds anything, two runs minutes apart that disagree fivefold) cannot be tested by
waiting for a neighbour to start a build. `busy(seed, load, jitter)` returns a timer
class that `bench.timing.benchmark` uses in place of its own (monkeypatch
`opswap.bench.timing._Timer`): each function still runs (once per sample, so side
effects and errors are real), its measured time is scaled to the calls the sample
stands for, then multiplied by

- the run's load: `load[i]` for the i-th `benchmark` call, cycling (a neighbour that
  comes and goes between the attribution run and the race), and
- a per-sample jitter drawn from `jitter`: (probability, factor) pairs, e.g.
  ((0.5, 1.0), (0.5, 20.0)) for a machine that is half the time 20x slower.

The clock that decides when timing stops advances by `_TICK` per sample, not by the real
time, so a run "out of time" at 8 s stops after a few dozen rounds and costs a fraction
of that; results are reproducible for a seed up to the real functions' own times.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

# Simulated seconds one sample takes on the clock that stops timing: a run of k functions
# that never settles stops after about max_time_s / (k * _TICK) rounds.
_TICK = 0.05


def busy(
    seed: int = 0,
    load: Sequence[float] = (1.0,),
    jitter: Sequence[tuple[float, float]] = ((0.5, 1.0), (0.5, 20.0)),
) -> type:
    """A bench.timing._Timer replacement simulating a busy machine (see the module)."""
    rng = random.Random(seed)
    calls = {"n": 0}
    clock = {"t": 0.0}
    weights = [p for p, _ in jitter]
    factors = [f for _, f in jitter]

    class BusyTimer:
        def __init__(self, dev: torch.device):
            self.dev = dev
            self.cuda = False
            self.load = load[calls["n"] % len(load)]
            calls["n"] += 1

        def sync(self) -> None:
            pass

        @staticmethod
        def now() -> float:
            return clock["t"]

        def time(self, fn: Callable[[], Any], inner: int) -> float:
            t0 = time.perf_counter()
            fn()
            real = time.perf_counter() - t0
            factor = rng.choices(factors, weights)[0]
            clock["t"] += _TICK
            return real * inner * self.load * factor

    return BusyTimer
