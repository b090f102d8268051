"""Chapter 23: precision debugging -- find the layer that broke the numbers.

A ResNet from the zoo is captured, and a candidate is made by hand with one
middle convolution computed in half precision (what a precision rule does to one
layer). The script then:

1. verifies the candidate end to end on three inputs, against the `exact` and the
   `approx` tolerances, and prints the five metrics;
2. compares the two graphs layer by layer and prints the table;
3. names the first divergence: under `exact`, the first row that breaks the
   tolerance; under `approx`, where the error first jumps above rounding level.

Run:  python examples/ch23_precision_debugging.py [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

import opswap
from opswap.api import capture
from opswap.graph.ops import op_kind
from opswap.verify import Tolerance, compare_layers, verify


class LowPrecision(nn.Module):
    """Runs a module in `dtype` and hands float32 back, as a mixed-precision swap would."""

    def __init__(self, module: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.inner = copy.deepcopy(module).to(dtype)
        self.dtype = dtype

    def forward(self, x):
        return self.inner(x.to(self.dtype)).to(x.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)

    loaded = opswap.load("zoo:resnet")
    ref = capture(loaded.module, loaded.example_inputs)
    cand = copy.deepcopy(ref.gm)
    convs = [n.target for n in cand.graph.nodes if op_kind(n) == "conv"]
    victim = convs[-2]  # deep enough that the error has layers to travel through
    cand.set_submodule(victim, LowPrecision(cand.get_submodule(victim), dtype))
    print(
        f"model: zoo:resnet ({ref.method} graph, {len(convs)} convs); "
        f"candidate runs {victim} in {args.dtype}\n"
    )

    v = verify(ref.gm, cand, ref.example_inputs, samples=3, tolerance="exact")
    print(f"worst over 3 inputs: {v.metrics}")
    for level in ("exact", "approx"):  # the same metrics, judged by two tolerances
        tol = Tolerance.for_exactness(level)
        passed, reasons = tol.check(v.metrics)
        print(f"  {level:<6} ({tol}): {'PASSED' if passed else 'FAILED'}")
        for reason in reasons:
            print(f"    - {reason}")
    print()

    report = compare_layers(ref.gm, cand, ref.example_inputs)
    exact_div = report.first_divergence("exact")
    print(report.table(mark=exact_div))
    print()
    print(f"first divergence (exact):  {exact_div}")
    print(f"first divergence (approx): {report.first_divergence('approx')}")


if __name__ == "__main__":
    main()
