"""Chapter 2: capture a model as a graph, classify every op, and find out which
ops are compute-bound and which are memory-bound on a target.

    python examples/ch02_graphs_and_operators.py [zoo:bert] [h100]
"""

import sys
from collections import Counter

from rich.console import Console

from opswap.api import capture
from opswap.cost.analyze import analyze, render
from opswap.graph import category, compute_nodes
from opswap.models import load
from opswap.report.advice import advised
from opswap.targets import get_target


def main(spec: str, target: str) -> None:
    loaded = load(spec)
    captured = capture(loaded.module, loaded.example_inputs)
    print(
        f"{spec}: captured with {captured.method}, "
        f"{sum(1 for _ in compute_nodes(captured.gm))} compute nodes"
    )
    print("ops per category:", dict(Counter(category(n) for n in compute_nodes(captured.gm))))
    result = advised(analyze(captured, get_target(target)))
    render(result, Console(), top=12)


if __name__ == "__main__":
    main(
        sys.argv[1] if len(sys.argv) > 1 else "zoo:bert",
        sys.argv[2] if len(sys.argv) > 2 else "h100",
    )
