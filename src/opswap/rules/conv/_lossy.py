"""The rule shape the lossy conv decompositions share: read a 2-D conv's weights, fit a
chain of cheaper convs (rules/conv/_decompose.py), report its error and what it saves,
refuse where it saves nothing or errs too far, and put the chain in the conv's place.

Sample inputs: when the plan's capture carries calibration samples (a lossy plan does:
the task's training batches, the user's calibration data, or random samples like the
example; stages.calibrate_stage), the conv's inputs on them are read by running the graph
up to the conv, and the output error is measured there (the stacked 3x3 fit also trains
on them). Without samples, seeded standard-normal inputs of the example's shape stand in.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from opswap.cost import NodeCost
from opswap.graph.calibrate import calibration_of
from opswap.graph.ops import copy_meta
from opswap.graph.shapes import info
from opswap.rules._cost import saving
from opswap.rules._edits import call, drop_dead_attrs, erase, install_module, new_const
from opswap.rules._matching import input_of
from opswap.rules._weights import weighted
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.conv._decompose import Decomposition, Layer, output_error

#: the largest relative L2 error a rule accepts for the conv's output on the samples: the
#: lossy verification's own bound (verify/tolerance.py), so a site that fails it alone is
#: refused here rather than rolled back later
MAX_OUTPUT_ERROR = 0.15
#: the rank is the smallest whose kernel errs at most this (relative L2 of the weight)
MAX_WEIGHT_ERROR = 0.1
#: a chain must cost at most this share of the conv's multiply-adds to be worth a change
#: of function
KEEP = 0.9
#: at most this many sample images are read for the error (and the stacked fit)
SAMPLE_IMAGES = 16


class _Stop(Exception):
    pass


class _Grab(fx.Interpreter):
    """Runs a graph until `node`'s first argument is computed, and keeps that value."""

    def __init__(self, gm: fx.GraphModule, node: fx.Node):
        super().__init__(gm)
        self.want = input_of(node)
        self.value: torch.Tensor | None = None

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n is self.want:
            self.value = out
            raise _Stop
        return out


def sample_inputs(
    gm: fx.GraphModule, node: fx.Node, shape: tuple[int, ...]
) -> tuple[torch.Tensor, str]:
    """A batch of the conv's inputs (float64, at most SAMPLE_IMAGES images) and what they
    are: from the capture's calibration samples, else seeded standard-normal ones."""
    cal = calibration_of(gm)
    got: list[torch.Tensor] = []
    if cal is not None:
        for args in cal.samples:
            grab = _Grab(gm, node)
            try:
                with torch.no_grad():
                    grab.run(*args)
            except _Stop:
                pass
            except Exception:  # a sample the (partly rewritten) graph cannot run
                break
            if grab.value is None:
                break
            got.append(grab.value.detach().double().cpu())
            if sum(len(t) for t in got) >= SAMPLE_IMAGES:
                break
    if got:
        return torch.cat(got)[:SAMPLE_IMAGES], f"{cal.source if cal else ''}"
    gen = torch.Generator().manual_seed(0)
    n = min(int(shape[0]), SAMPLE_IMAGES)
    return torch.randn(n, *shape[1:], generator=gen, dtype=torch.float64), "random inputs"


class LossyConv(Rule):
    """Base of the decomposition rules: subclasses say how to fit the chain."""

    family = "conv"
    chapter = 11
    exactness = "lossy"
    targets = ("cpu", "cuda")
    anchors = ("conv",)
    relieves = ("compute:conv",)

    def fit(self, conv: Layer, h: int, w: int, inputs: torch.Tensor) -> Decomposition | str:
        """The chain for `conv` at an h x w input, or why there is none worth having."""
        raise NotImplementedError

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        x = input_of(node)
        if x is None:
            return None
        wt = weighted(gm, node)
        if isinstance(wt, str):
            return Refused(wt)
        if wt.transposed:
            return Refused(f"{node.name} is a transposed convolution, which is not decomposed")
        if wt.weight.dim() != 4:
            return Refused(
                f"{node.name} is a {wt.weight.dim() - 2}-D convolution; only 2-D ones decompose"
            )
        if wt.padding_mode != "zeros":
            return Refused(
                f"{node.name} pads with padding_mode={wt.padding_mode!r}; the chain pads with zeros only"
            )
        xi = info(x)
        if xi is None or len(xi.shape) != 4:
            return Refused(f"the input of {node.name} has no known [N, C, H, W] shape")
        if not xi.dtype.is_floating_point:
            return Refused(f"{node.name} reads a {xi.dtype} input")
        padding = wt.padding
        if isinstance(padding, str):
            if padding != "valid":
                kh, kw = wt.weight.shape[2:]
                if any((d * (k - 1)) % 2 for d, k in zip(wt.dilation, (kh, kw), strict=True)):
                    return Refused(
                        f"{node.name} uses padding='same' with an even kernel, which pads unevenly"
                    )
                padding = tuple(
                    d * (k - 1) // 2 for d, k in zip(wt.dilation, (kh, kw), strict=True)
                )
            else:
                padding = (0, 0)
        conv = Layer(
            wt.weight.detach().double().cpu(),
            None if wt.bias is None else wt.bias.detach().double().cpu(),
            tuple(wt.stride),  # type: ignore[arg-type]
            tuple(padding),  # type: ignore[arg-type]
            tuple(wt.dilation),  # type: ignore[arg-type]
            int(wt.groups),
        )
        h, w_ = int(xi.shape[2]), int(xi.shape[3])
        inputs, source = sample_inputs(gm, node, tuple(int(s) for s in xi.shape))
        dec = self.fit(conv, h, w_, inputs)
        if isinstance(dec, str):
            return Refused(dec)
        before, after = conv.macs(h, w_), dec.macs(h, w_)
        if after > KEEP * before:
            return Refused(
                f"{dec.describe()} costs {after / before:.0%} of the conv's "
                f"multiply-adds, which saves nothing worth a change of function"
            )
        err = output_error(conv, dec, inputs)
        if err > MAX_OUTPUT_ERROR:
            return Refused(
                f"{dec.describe()} errs {err:.3f} (relative L2 of the output on "
                f"{source}), over the {MAX_OUTPUT_ERROR} a lossy plan accepts; "
                "opswap.train.distill_conv.decompose and fine_tune trade that back by training"
            )
        params = sum(t.numel() for t in (conv.weight, conv.bias) if t is not None)
        record = dict(
            method=dec.method,
            rank=dec.rank,
            weight_error=round(dec.weight_error, 6),
            output_error=round(err, 6),
            error_on=source,
            macs_before=before,
            macs_after=after,
            params_before=params,
            params_after=dec.params(),
        )
        return Found(
            (node,),
            f"{node.name}: {dec.describe()}; output error {err:.3f} on {source}, "
            f"{1 - after / before:.0%} of the multiply-adds and "
            f"{1 - dec.params() / params:.0%} of the weights saved",
            dict(
                x=x,
                dec=dec,
                dtype=wt.weight.dtype,
                device=wt.weight.device,
                batch=int(xi.shape[0]),
                hw=(h, w_),
            ),
            record=record,
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        node, dec = found.nodes[0], found["dec"]
        dtype, device = found["dtype"], found["device"]
        if node.op == "call_module":
            install_module(gm, node, dec.module(dtype, device), f"{node.target}_{dec.method}")
            return
        cur = found["x"]
        for i, layer in enumerate(dec.layers):
            w = new_const(
                gm, node, f"{node.name}_{dec.method}{i}_weight", layer.weight.to(device, dtype)
            )
            b = (
                None
                if layer.bias is None
                else new_const(
                    gm, node, f"{node.name}_{dec.method}{i}_bias", layer.bias.to(device, dtype)
                )
            )
            with gm.graph.inserting_before(node):
                cur = call(
                    gm.graph,
                    node,
                    "conv2d",
                    (
                        cur,
                        w,
                        b,
                        list(layer.stride),
                        list(layer.padding),
                        list(layer.dilation),
                        layer.groups,
                    ),
                )
        copy_meta(cur, node)
        node.replace_all_uses_with(cur)
        drop_dead_attrs(gm, erase(gm, [node]))

    def predict(self, gm: fx.GraphModule, found: Found, target: Any) -> Estimate:
        dec: Decomposition = found["dec"]
        n, (h, w) = found["batch"], found["hw"]
        size = torch.empty((), dtype=found["dtype"]).element_size()
        added = []
        c = dec.layers[0].in_channels
        for layer in dec.layers:
            oh, ow = layer.out_size(h, w)
            read = n * c * h * w + layer.weight.numel()
            written = n * layer.out_channels * oh * ow
            added.append(NodeCost(2 * n * layer.macs(h, w), size * (read + written)))
            h, w, c = oh, ow, layer.out_channels
        est = saving(target, [found.nodes[0]], added)
        return Estimate(
            est.flops_saved,
            est.bytes_saved,
            est.time_saved_s,
            f"{len(dec.layers)} convs in place of one: fewer multiply-adds, "
            f"{len(dec.layers) - 1} more intermediate tensors written and read",
        )
