"""Calibration: what the tensors of a captured graph hold over sample inputs, for rules
that quantise activations with scales fixed ahead of time (static int8).

`attach(gm, Calibration(samples, ...))` stores the samples and the settings on the graph
module (`gm.meta`, which copies of it keep). A rule asks `observed(gm, node)` for the
observer of one node's output; the first call runs the graph over every sample (two
passes: the extremes, then the histograms, see opswap.graph.observers) and records an
observer on every floating-point node that feeds a Linear or a convolution, in that
node's meta, so that one run serves every site of a plan, and the planner's copies of
the graph carry them on. The graph is run as it is when first asked, that is after the
rules planned before (BatchNorm folds, merges), so the ranges are those of the layers
that will be quantised.

A plan that holds static int8 sites keeps what it needs to be applied again without the
samples: each site's scale and zero point (in its decision's data) and, in the plan's
`calibration`, a `CalibrationRecord`: the settings, what the samples were, and a digest
of the weights the ranges were observed with. `attach_stored` gives a fresh capture
those scales (`StoredScales`), keyed by the name of the layer that reads the quantised
value; the rules then take them as they are, and the int8 model is the one the plan was
made with, to the bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.fx as fx

from opswap.graph.observers import METHODS, Observer, QParams
from opswap.graph.ops import op_kind

_META = "opswap.calibration"
_STORED = "opswap.calibration.stored"
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
    #: why the samples could not run through the graph ("" while they could)
    error: str = field(default="", compare=False)

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

    def record(self, weights: str) -> CalibrationRecord:
        """What a plan keeps of this calibration; `weights`: the digest of the weights."""
        return CalibrationRecord(
            self.method,
            self.symmetric,
            self.per_channel,
            self.percentile,
            len(self.samples),
            self.source,
            weights,
        )


@dataclass(frozen=True)
class CalibrationRecord:
    """A plan's note of the calibration its static int8 scales came from. `weights` is the
    digest (planner.weights_digest) of the weights the ranges were observed with: the
    scales hold for those weights only."""

    method: str
    symmetric: bool
    per_channel: bool
    percentile: float
    samples: int
    source: str
    weights: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> CalibrationRecord:
        """The record `to_json` wrote; ValueError naming the field that is wrong."""
        if not isinstance(data, dict):
            raise ValueError("calibration must be an object")
        kinds: dict[str, tuple[type, ...]] = {
            "method": (str,),
            "symmetric": (bool,),
            "per_channel": (bool,),
            "percentile": (int, float),
            "samples": (int,),
            "source": (str,),
            "weights": (str,),
        }
        for name, kind in kinds.items():
            v = data.get(name)
            if not isinstance(v, kind) or (bool not in kind and isinstance(v, bool)):
                raise ValueError(f"calibration.{name} is missing or of the wrong type")
        if data["method"] not in METHODS:
            raise ValueError(f"calibration.method must be one of {', '.join(METHODS)}")
        return cls(**{k: data[k] for k in kinds})

    def calibration(self, samples: list[tuple[Any, ...]], source: str) -> Calibration:
        """A calibration on new `samples` with this record's settings."""
        return Calibration(
            samples, self.method, self.symmetric, self.per_channel, self.percentile, source
        )

    def describe(self) -> str:
        return f"{self.samples} {self.source}, {self.method} ranges"


@dataclass
class StoredScales:
    """Activation scales a plan holds, by the name of the layer (the Linear or the
    convolution node) whose input they quantise, used instead of a run over samples."""

    scales: dict[str, QParams]
    record: CalibrationRecord

    @property
    def method(self) -> str:
        return self.record.method

    @property
    def per_channel(self) -> bool:
        return self.record.per_channel

    def __deepcopy__(self, memo: dict[int, Any]) -> StoredScales:
        return self  # read only, shared by the copies of the graph as samples are


def attach(gm: fx.GraphModule, calibration: Calibration) -> None:
    """Give `gm` (and the copies made of it from now on) its calibration samples."""
    gm.meta.pop(_STORED, None)
    gm.meta[_META] = calibration


def attach_stored(gm: fx.GraphModule, stored: StoredScales) -> None:
    """Give `gm` (and its copies) the scales a plan holds, in place of samples."""
    gm.meta.pop(_META, None)
    gm.meta[_STORED] = stored


def calibration_of(gm: fx.GraphModule) -> Calibration | None:
    return gm.meta.get(_META)


def stored_of(gm: fx.GraphModule) -> StoredScales | None:
    return gm.meta.get(_STORED)


#: what a static int8 rule was told to do when there are neither samples nor scales
NO_CALIBRATION = (
    "no calibration samples: static int8 needs sample inputs to fix the activation scales; "
    "pass --calibration FILE (calibration_data= in Python)"
)


def scale_for(
    gm: fx.GraphModule, layer: fx.Node, x: fx.Node
) -> tuple[QParams, Calibration | StoredScales] | str:
    """The scale and zero point to quantise `x`, the input of `layer`, with, and the
    calibration (or the plan's scales) they come from; or why there are none."""
    stored = stored_of(gm)
    if stored is not None:
        qp = stored.scales.get(layer.name)
        if qp is None:
            return f"the plan holds no activation scale for {layer.name}"
        return qp, stored
    cal = calibration_of(gm)
    obs = observed(gm, x)
    if isinstance(obs, str):
        return obs
    assert cal is not None
    return cal.qparams(obs), cal


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
    if not wanted or calibration.error:
        return
    with torch.no_grad():
        for second in (False, True):
            rec = _Recorder(gm, wanted, second)
            for i, sample in enumerate(calibration.samples):
                try:
                    rec.run(*sample)
                except Exception as e:  # a batch the graph does not take: one sentence
                    calibration.error = _failed(i, sample, e)
                    return
    for n, obs in wanted.items():
        if obs.count:
            n.meta[_OBSERVER] = obs
    calibration.stats_runs += 1


def _failed(i: int, sample: tuple[Any, ...], e: Exception) -> str:
    shapes = ", ".join(
        "x".join(map(str, t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__
        for t in sample
    )
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return (
        f"calibration sample {i} (inputs {shapes}) did not run through the model "
        f"({type(e).__name__}: {first[:160]})"
    )


def observed(gm: fx.GraphModule, node: fx.Node) -> Observer | str:
    """The observer of `node`'s output over the calibration samples, or why there is none."""
    cal = calibration_of(gm)
    if cal is None:
        return NO_CALIBRATION
    obs = node.meta.get(_OBSERVER)
    if obs is None and not node.meta.get("opswap.observed_once"):
        _run_all(gm, cal)
        for n in _wanted(gm):
            n.meta["opswap.observed_once"] = True
        obs = node.meta.get(_OBSERVER)
    if cal.error:
        return cal.error
    if obs is None:
        return f"{node.name} held no finite floating-point value over the calibration samples"
    return obs


def samples_from(inputs: Sequence[tuple[Any, ...]], limit: int) -> list[tuple[Any, ...]]:
    """At most `limit` input tuples, each a tuple."""
    return [tuple(s) if isinstance(s, (tuple, list)) else (s,) for s in list(inputs)[:limit]]
