"""conv.algorithm: run each convolution with the algorithm that is fastest for it, measured.

For every conv1d/conv2d with constant weights, the candidates are PyTorch's own conv
(cuDNN / oneDNN / ATen's, with the input in NCHW and in channels-last) and every
algorithm registered in opswap.kernels.conv_algorithms (im2col + GEMM, FFT, Winograd, ...)
that does not refuse the site. The race, in three steps:

1. accuracy (at check time, no target needed): an approximate algorithm's relative L2
   error against a float64 direct convolution, on random inputs at the site's shapes and
   dtype, may be at most twice PyTorch's own conv's in that dtype; else it is out,
   with both figures ("error 3.1e-03 is 2.6x PyTorch's conv's (1.2e-03)");
2. timing (at predict time, on the target with its timer): every remaining candidate
   and PyTorch's conv both ways, interleaved, at the site's shapes; cached per site;
3. choice: the fastest algorithm, only if it beats the faster of PyTorch's two layouts
   measured in the same run; else the site is left to PyTorch's conv, and the plan says
   why, with every time.

The check answers one `Found` per candidate algorithm, keyed `conv@algorithm`: the
planner predicts each, and only the race's winner is predicted to save time, so a
plan.json names the chosen algorithm in its site key and `opswap apply` replays exactly
that choice without timing again. A target without a timer (a datasheet GPU planned on
a CPU machine) cannot race: its sites are skipped with that reason.

Exactness: rules cannot see the plan's exactness setting, so the rule is `approx` as a
whole (Winograd and FFT round differently), and at `--exactness exact` it does not run
at all, im2col included.

Layouts at the edges: the race hands every candidate an input in the layout the capture
saw at the example (`ConvSite.channels_last`). In an NCHW model an algorithm that computes
in channels-last (the prepacked oneDNN conv) converts the input and the output inside its
op, and the race counts both copies in its time; in a channels-last model the op keeps the
input's format and pays none, and neither does the race's figure. PyTorch's channels-last
baseline is timed on an input converted beforehand, with no conversion, in either model:
the bar a candidate must clear is the lower one.

The rewrite replaces the conv by `algorithm.op(x, weight, bias, *algorithm.extra(site))`,
reading the weights where the conv read them; the extra arguments are the conv's own
settings (stride, padding, groups), never the example's sizes, so the graph stays
symbolic in batch and spatial sizes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from opswap.cost import roofline_point
from opswap.graph.ops import arg
from opswap.graph.shapes import info, strides_seen
from opswap.kernels._conv_error import error_against_float64
from opswap.kernels.conv_algorithms import ConvAlgorithm, ConvSite, algorithms
from opswap.rules._edits import new_const, replace_with
from opswap.rules._matching import input_of
from opswap.rules._weights import Weighted, weighted, zero_padding
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.registry import register
from opswap.targets.base import Target

#: PyTorch's conv, the baseline every algorithm must beat, in its two layouts
TORCH = "pytorch"
TORCH_CL = "pytorch_channels_last"
#: an approximate algorithm's error may be at most this multiple of PyTorch's conv's
ERROR_RATIO = 2.0
NO_TIMER = "algorithm choice needs timing on the target; plan on the target machine"

_CONV: dict[int, Callable[..., torch.Tensor]] = {1: F.conv1d, 2: F.conv2d}
_ERRORS: dict[tuple[Hashable, ...], tuple[float, float]] = {}
_RACES: dict[tuple[Hashable, ...], dict[str, float]] = {}


def _site(w: Weighted, x: fx.Node, padding: tuple[int, ...]) -> ConvSite | str:
    """The ConvSite of a conv node at the example's shapes, or why there is none."""
    shape = info(x)
    if shape is None:
        return f"the input shape of {w.node.name} is unknown (the capture recorded none)"
    if not shape.dtype.is_floating_point:
        return f"{w.node.name} convolves {shape.dtype} values; the algorithms take floats"
    return ConvSite(
        input_shape=tuple(int(s) for s in shape.shape),
        weight_shape=tuple(int(s) for s in w.weight.shape),
        stride=tuple(int(s) for s in w.stride),
        padding=padding,
        dilation=tuple(int(d) for d in w.dilation),
        groups=int(w.groups),
        dtype=shape.dtype,
        device="cpu",  # where the accuracy test runs; the race runs on the target's device
        channels_last=_channels_last_at_example(x),
    )


def _channels_last_at_example(x: fx.Node) -> bool:
    """Whether the conv's 4-D input had channels-last strides (and not NCHW's) at the
    example."""
    seen = strides_seen(x)
    if not seen or len(seen[0][0]) != 4:
        return False
    shape, stride = seen[0]
    t = torch.empty_strided(shape, stride, device="meta")
    return not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)


def accuracy(algorithm: ConvAlgorithm, site: ConvSite) -> str | None:
    """Why `algorithm` is too inexact at `site` (error over ERROR_RATIO x PyTorch's, on
    random inputs at the site's shapes with a batch of one), or None; an exact algorithm
    passes without a test. Cached per (algorithm, site)."""
    if algorithm.exactness == "exact":
        return None
    # at batch 1: the error is per output value, and a float64 conv at a large batch is slow
    one = dataclasses.replace(site, input_shape=(1, *site.input_shape[1:]))
    key = (algorithm.name, algorithm.op, one)
    if key not in _ERRORS:
        _ERRORS[key] = error_against_float64(algorithm, one)
    mine, theirs = _ERRORS[key]
    if mine <= ERROR_RATIO * theirs:
        return None
    ratio = mine / theirs if theirs > 0 else math.inf
    return f"error {mine:.1e} is {ratio:.1f}x PyTorch's conv's ({theirs:.1e})"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-4 else f"{seconds * 1e6:.3g} µs"


def race(
    site: ConvSite,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    candidates: tuple[ConvAlgorithm, ...],
    target: Target,
) -> dict[str, float]:
    """Seconds per call of PyTorch's conv (NCHW, and channels-last for 2-D) and of each
    candidate at `site`, measured side by side with the target's timer on its device;
    cached per site, candidate set, thread count and timer."""
    timer = target.timer
    assert timer is not None  # predict refuses a target without one first
    device = "cuda" if target.kind == "cuda" else "cpu"
    key = (site, tuple((a.name, a.op) for a in candidates), device, torch.get_num_threads(), timer)
    hit = _RACES.get(key)
    if hit is not None:
        return hit
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(site.input_shape, generator=gen).to(device=device, dtype=site.dtype)
    if site.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    w = weight.detach().to(device=device, dtype=site.dtype)
    b = None if bias is None else bias.detach().to(device=device, dtype=site.dtype)
    conv = _CONV[site.dims]
    settings = (site.stride, site.padding, site.dilation, site.groups)
    fns: dict[str, Callable[[], object]] = {TORCH: lambda: conv(x, w, b, *settings)}
    if site.dims == 2:
        cl = torch.channels_last
        x_cl, w_cl = x.contiguous(memory_format=cl), w.contiguous(memory_format=cl)
        fns[TORCH_CL] = lambda: conv(x_cl, w_cl, b, *settings)
    for a in candidates:
        fns[a.name] = lambda a=a: a(x, w, b, site)  # type: ignore[misc]
    with torch.inference_mode():
        times = dict(timer(fns))
    _RACES[key] = times
    return times


def roofline(site: ConvSite, name: str, target: Target) -> float:
    """Seconds the roofline predicts for candidate `name` at `site`: 2 FLOPs per
    multiplication it counts, and the bytes of input, weight and output (plus the column
    matrix's write and read for im2col, the spectra's for the FFT)."""
    item = torch.empty((), dtype=site.dtype).element_size()
    n, o = site.input_shape[0], site.weight_shape[0]
    out = n * o * math.prod(site.output_spatial)
    moved = (math.prod(site.input_shape) + math.prod(site.weight_shape) + out) * item
    if name in (TORCH, TORCH_CL):
        mults = site.direct_multiplications()
    else:
        algorithm = next(a for a in algorithms() if a.name == name)
        mults = algorithm.multiplications(site)
        if name == "im2col":
            c = site.weight_shape[1] * site.groups
            cols = n * c * math.prod(site.kernel) * math.prod(site.output_spatial) * item
            moved += 2 * cols
        elif name == "fft":
            padded = [s + 2 * p for s, p in zip(site.input_shape[2:], site.padding, strict=True)]
            # complex64 spectra of half the padded points each: 4 bytes per point
            spectra = (n * site.input_shape[1] + n * o) * math.prod(padded) * 4
            moved += 2 * spectra
    return roofline_point(2 * mults, moved, target, site.dtype).time_s


@register
class ConvAlgorithmRace(Rule):
    """Race PyTorch's conv against every registered convolution algorithm at each site,
    on the target, and keep the fastest verified one (PyTorch's conv when it wins)."""

    name = "conv.algorithm"
    family = "conv"
    chapter = 11
    exactness = "approx"
    targets = ("cpu", "cuda")
    # BatchNorms are folded (and ReLUs fused) first: the conv raced is the one that runs
    after = ("fusion.*",)
    relieves = ("compute:conv",)
    description = (
        "Conv1d/Conv2d -> the fastest of im2col + GEMM, FFT, Winograd, NNPACK, oneDNN on a "
        "prepacked weight and PyTorch's own conv (NCHW and channels-last), timed at the "
        "site's shapes on the target; "
        "approximate algorithms must err at most 2x PyTorch's conv against float64."
    )
    anchors = ("conv",)

    def check(self, gm: fx.GraphModule, node: fx.Node) -> list[Found | Refused] | Refused | None:
        w = weighted(gm, node)
        if isinstance(w, str):
            return Refused(w)
        if w.transposed:
            return Refused(f"{node.name} is a transposed convolution; the algorithms race convs")
        if w.weight.dim() - 2 not in (1, 2):
            return Refused(
                f"{node.name} is a {w.weight.dim() - 2}-D convolution; the algorithms race "
                "conv1d and conv2d"
            )
        padding = zero_padding(w, node)
        if isinstance(padding, str):
            return Refused(padding)
        x = input_of(node)
        if x is None:
            return None
        site = _site(w, x, padding)
        if isinstance(site, str):
            return Refused(site)
        out: list[Found | Refused] = []
        refused: dict[str, str] = {}
        passing: list[ConvAlgorithm] = []
        for a in algorithms():
            why = a.refuses(site) or accuracy(a, site)
            if why is None:
                passing.append(a)
                continue
            refused[a.name] = why
            if why.startswith("error "):  # too inexact: a near miss the user should see
                out.append(Refused(f"{a.name} at {node.name}: {why}", node))
        if not passing:
            reasons = "; ".join(f"{k}: {v}" for k, v in refused.items()) or "none registered"
            return [*out, Refused(f"no convolution algorithm can run {node.name} ({reasons})")]
        data = dict(w=w, x=x, site=site, candidates=tuple(passing), refused=refused)
        for a in passing:
            out.append(
                Found(
                    [node],
                    f"run {node.name} as {a.name} if it wins the race",
                    dict(data, algorithm=a),
                    key=f"{node.name}@{a.name}",
                    record=dict(conv=node.name, algorithm=a.name),
                )
            )
        return out

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        node, w, x = found.nodes[0], found["w"], found["x"]
        algorithm: ConvAlgorithm = found["algorithm"]
        weight = _tensor_node(gm, w, 1, "weight", w.weight)
        bias = None if w.bias is None else _tensor_node(gm, w, 2, "bias", w.bias)
        replace_with(gm, node, algorithm.op, (x, weight, bias, *algorithm.extra(found["site"])))

    def predict(self, gm: fx.GraphModule, found: Found, target: Any) -> Estimate:
        site: ConvSite = found["site"]
        mine: ConvAlgorithm = found["algorithm"]
        w: Weighted = found["w"]
        predicted = {
            n: roofline(site, n, target)
            for n in (TORCH, *([TORCH_CL] if site.dims == 2 else []))
            + tuple(a.name for a in found["candidates"])
        }
        if getattr(target, "timer", None) is None:
            # no saving can be claimed without a measurement: refuse with the reason
            return Estimate(time_saved_s=-predicted[mine.name], note=NO_TIMER)
        # the site was checked on the CPU; a CPU-only algorithm (oneDNN's packed conv,
        # NNPACK) is left out of a race on another device
        there = dataclasses.replace(site, device="cuda" if target.kind == "cuda" else "cpu")
        candidates = tuple(a for a in found["candidates"] if a.refuses(there) is None)
        if mine not in candidates:
            return Estimate(
                time_saved_s=-predicted[mine.name], note=f"{mine.name}: {mine.refuses(there)}"
            )
        times = race(site, w.weight, w.bias, candidates, target)
        torch_best = min(times[n] for n in (TORCH, TORCH_CL) if n in times)
        ours = {a.name: times[a.name] for a in candidates}
        winner = min(ours, key=lambda n: ours[n])
        flops = 2.0 * (site.direct_multiplications() - mine.multiplications(site))

        def table(names: list[str]) -> str:
            return ", ".join(f"{n} {_ms(times[n])} (roofline {_ms(predicted[n])})" for n in names)

        others = sorted(ours, key=lambda n: ours[n])
        torch_names = [n for n in (TORCH, TORCH_CL) if n in times]
        lost = "; ".join(f"{k}: {v}" for k, v in found["refused"].items())
        tail = f"; not raced: {lost}" if lost else ""
        common = dict(flops_saved=flops, measured_s=dict(times), predicted_s=predicted)
        if ours[winner] >= torch_best:
            first = candidates[0].name
            note = (  # the whole race once per site, with its first candidate
                f"PyTorch's conv was fastest: {table(torch_names)}; {table(others)}{tail}"
                if mine.name == first
                else f"PyTorch's conv was fastest (the race's times: {found.nodes[0].name}@{first})"
            )
            return Estimate(
                time_saved_s=torch_best - ours[mine.name] - 1e-12,
                note=note,
                **common,  # type: ignore[arg-type]
            )
        if winner != mine.name:
            return Estimate(
                time_saved_s=ours[winner] - ours[mine.name] - 1e-12,
                note=f"{mine.name} lost the race to {winner}: {table(others)}",
                **common,  # type: ignore[arg-type]
            )
        return Estimate(
            time_saved_s=torch_best - ours[mine.name],
            note=f"{winner} was fastest: {table(others)}; PyTorch's conv "
            f"{table(torch_names)}{tail}",
            **common,  # type: ignore[arg-type]
        )


def _tensor_node(
    gm: fx.GraphModule, w: Weighted, index: int, name: str, tensor: torch.Tensor
) -> fx.Node:
    """The node the new op reads the conv's weight or bias from: the conv's own get_attr or
    lifted parameter, the module's parameter for an nn.Conv call, else a new constant."""
    node = w.node
    if node.op == "call_module":
        with gm.graph.inserting_before(node):
            return gm.graph.get_attr(f"{node.target}.{name}")
    old = arg(node, index, name)
    if isinstance(old, fx.Node) and old.op in ("get_attr", "placeholder"):
        return old
    return new_const(gm, node, f"{node.name}_{name}", tensor.detach())
