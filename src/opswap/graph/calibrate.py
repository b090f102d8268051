"""Calibration: what the tensors of a captured graph hold over sample inputs, for rules
that quantise activations with scales fixed ahead of time (static int8).

`attach(gm, Calibration(samples, ...))` stores the samples and the settings on the graph
module (`gm.meta`, which copies of it keep). A rule asks `observed(gm, node)` for the
observer of one node's output; the first call runs the graph over every sample (two
passes: the extremes, then the histograms, see opswap.kernels.observers) and records an
observer on every floating-point node that feeds a Linear or a convolution, in that
node's meta, so that one run serves every site of a plan, and the planner's copies of
the graph carry them on. The graph is run as it is when first asked, that is after the
rules planned before (BatchNorm folds, merges), so the ranges are those of the layers
that will be quantised.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from opswap.graph.ops import op_kind
from opswap.kernels.observers import METHODS, Observer, QParams

_META = "opswap.calibration"
_OBSERVER = "opswap.observer"
#: the op kinds whose input a static int8 rule quantises
_CONSUMERS = frozenset({"linear", "conv", "conv2d", "conv1d", "matmul"})


@dataclass
class Calibration:
    """Sample inputs (positional argument tuples) and how to turn their ranges into scales."""

    samples: list[tuple[Any, ...]]
    method: str = "minmax"
    symmetric: bool = False
    per_channel: bool = True
    percentile: float = 99.99
    source: str = "random samples"  # what the samples are, for the report
    stats_runs: int = field(default=0, compare=False)  # how many times the graph was run

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"unknown calibration method {self.method!r}; use one of {', '.join(METHODS)}"
            )
        if not self.samples:
            raise ValueError("calibration needs at least one sample input")
        if not 50.0 < self.percentile <= 100.0:
            raise ValueError(f"percentile {self.percentile} must be in (50, 100]")

    def __deepcopy__(self, memo: dict[int, Any]) -> Calibration:
        # shared, not copied, by the planner's copies of the graph: samples are read only
        return self

    def qparams(self, observer: Observer) -> QParams:
        return observer.qparams(self.method, self.symmetric, self.percentile)

    def describe(self) -> str:
        sym = "symmetric" if self.symmetric else "asymmetric"
        wts = "per-channel" if self.per_channel else "per-tensor"
        return (
            f"{len(self.samples)} {self.source}, {self.method} ranges, {sym} uint8 "
            f"activations, {wts} int8 weights"
        )


def attach(gm: fx.GraphModule, calibration: Calibration) -> None:
    """Give `gm` (and the copies made of it from now on) its calibration samples."""
    gm.meta[_META] = calibration


def calibration_of(gm: fx.GraphModule) -> Calibration | None:
    return gm.meta.get(_META)


def _wanted(gm: fx.GraphModule) -> list[fx.Node]:
    out = []
    for node in gm.graph.nodes:
        if op_kind(node) in _CONSUMERS and node.args and isinstance(node.args[0], fx.Node):
            out.append(node.args[0])
    return list(dict.fromkeys(out))


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, wanted: dict[fx.Node, Observer], second: bool):
        super().__init__(gm)
        self.wanted = wanted
        self.second = second

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        obs = self.wanted.get(n)
        if obs is not None and isinstance(out, torch.Tensor) and out.is_floating_point():
            (obs.observe_values if self.second else obs.observe_range)(out)
        return out


def _run_all(gm: fx.GraphModule, calibration: Calibration) -> None:
    wanted = {n: Observer() for n in _wanted(gm)}
    if not wanted:
        return
    with torch.no_grad():
        for second in (False, True):
            rec = _Recorder(gm, wanted, second)
            for sample in calibration.samples:
                rec.run(*sample)
    for n, obs in wanted.items():
        if obs.count:
            n.meta[_OBSERVER] = obs
    calibration.stats_runs += 1


def observed(gm: fx.GraphModule, node: fx.Node) -> Observer | str:
    """The observer of `node`'s output over the calibration samples, or why there is none."""
    cal = calibration_of(gm)
    if cal is None:
        return (
            "no calibration samples: static int8 needs sample inputs to fix the activation "
            "scales (opswap optimize supplies them; in Python, graph.calibrate.attach)"
        )
    obs = node.meta.get(_OBSERVER)
    if obs is None and not node.meta.get("opswap.observed_once"):
        _run_all(gm, cal)
        for n in _wanted(gm):
            n.meta["opswap.observed_once"] = True
        obs = node.meta.get(_OBSERVER)
    if obs is None:
        return f"{node.name} held no finite floating-point value over the calibration samples"
    return obs


def samples_from(inputs: Sequence[tuple[Any, ...]], limit: int) -> list[tuple[Any, ...]]:
    """At most `limit` input tuples, each a tuple."""
    return [tuple(s) if isinstance(s, (tuple, list)) else (s,) for s in list(inputs)[:limit]]
