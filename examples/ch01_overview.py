"""Chapter 1: the first thing to run. Optimize a built-in ResNet-style model for
this CPU and print what changed, whether the numbers still match, and the gain.

    python examples/ch01_overview.py [OUT_DIR]
"""

import sys
import tempfile

import opswap


def main(out_dir: str) -> None:
    loaded = opswap.load("zoo:resnet")
    result = opswap.optimize(loaded.module, loaded.example_inputs, target="cpu", name="zoo:resnet")
    for site in result.applied:
        print(f"applied  {site.rule:<22} {site.key}")
    for miss in result.plan.misses:
        print(f"missed   {miss.rule:<22} {miss.where}: {miss.reason}")
    v, b = result.verification, result.benchmark
    print(
        f"verification {'passed' if v.passed else 'FAILED'}: cosine {v.cosine:.8f}, "
        f"max abs {v.max_abs:.2e}"
    )
    print(f"latency {b.ref_ms:.3f} ms -> {b.opt_ms:.3f} ms ({b.speedup:.2f}x, {b.device})")
    paths = result.save(out_dir)
    print("report:", paths["report_html"])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="opswap-ch01-"))
