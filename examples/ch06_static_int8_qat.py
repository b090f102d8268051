"""Chapter 6: static int8 and quantisation-aware training on a real task.

The digits CNN of the zoo (trained on scikit-learn's digits) is quantised statically:
its BatchNorms fold into the convolutions, each convolution's input gets a scale and a
zero point from calibration on training batches (four range methods compared), and
onednn's int8 convolutions run it, each one read only by another handing it uint8; then
the same int8 model compiled, its sites lowered to Inductor's own int8 path. Then the
same model goes through QAT: a few steps of
training with the int8 rounding simulated, and conversion to the real int8 model.
Top-1 accuracy on the held-out split is printed for each.

    python examples/ch06_static_int8_qat.py
"""

import torch
import torch.nn.functional as F

from opswap.backends.int8_inductor import compile_module
from opswap.graph.calibrate import Calibration, attach
from opswap.graph.capture import capture
from opswap.kernels import int8_static
from opswap.models import load
from opswap.models.zoo_digits import digits
from opswap.planner import apply_plan, make_plan
from opswap.targets.base import Target
from opswap.train import qat

# A profile where int8 pays, so that the int8 model is built on any CPU; whether it is
# faster on this one is what `opswap optimize` measures (its `cpu` target times each
# layer both ways), and benchmarks/bench_int8_static.py reports.
INT8_PAYS = Target(
    name="int8-pays",
    description="int8 at 4x the float32 rate",
    kind="cpu",
    peak_flops={"float32": 1e11, "int8": 4e11},
    mem_bandwidth=2e10,
    memory_bytes=2**34,
    dtypes=("float32", "int8"),
)


def static_int8(model, example, calibration, method):
    cap = capture(model, example)
    attach(cap.gm, Calibration(calibration, method=method, source="training batches"))
    plan = make_plan(
        cap, rules=["fusion.*", "precision.int8_static_*"], exactness="approx", target=INT8_PAYS
    )
    return apply_plan(cap, plan).gm, plan


def main() -> None:
    if not int8_static.onednn_available():
        print("onednn's int8 kernels do not run on this machine (an x86 CPU torch is needed)")
        return
    m = load("zoo:digits_cnn")
    task, example = m.task, m.example_inputs
    print(f"{m.spec}: float32 top-1 {task.evaluate(m.module):.4f} ({task.description})")
    print(f"int8 kernels here: {int8_static.describe()}")
    for method in ("minmax", "entropy"):  # percentile and mse too: see the chapter
        int8, plan = static_int8(m.module, example, task.calibration, method)
        rules = [d.rule for d in plan.decisions]
        layers = sum(
            r in ("precision.int8_static_conv", "precision.int8_static_linear") for r in rules
        )
        # precision.int8_static_handoff: a layer read only by another int8 layer hands it
        # uint8, requantised in its epilogue, instead of a float32 tensor
        handoffs = rules.count("precision.int8_static_handoff")
        print(
            f"  static int8, {method:<10} {task.evaluate(int8):.4f}  "
            f"({layers} int8 layers, {handoffs} uint8 handoffs between them)"
        )
    for miss in plan.misses:
        if miss.rule.startswith("precision"):
            print(f"    not {miss.where}: {miss.reason}")

    # Compiled, the int8 sites go through Inductor's own int8 lowering: the same scales,
    # onednn's int8 kernels with the work between them fused (what the race's
    # opswap+compile and opswap.load_optimized(compile=True) run). The graph is exported
    # as model.pt2 holds it, with a dynamic batch for the held-out split's batches.
    program = torch.export.export(
        int8, example, dynamic_shapes=({0: torch.export.Dim.AUTO},)
    ).module()
    compiled = compile_module(program)
    print(f"  static int8, compiled through Inductor's int8 path: {task.evaluate(compiled):.4f}")

    # QAT: simulate the rounding in training, then convert with the trained ranges
    data = digits()
    x = data.train_x.reshape(-1, 1, 8, 8)
    batches = [(x[i : i + 64], data.train_y[i : i + 64]) for i in range(0, len(x), 64)]
    torch.manual_seed(0)
    q = qat.prepare(m.module)
    losses = qat.fine_tune(q, batches, F.cross_entropy, steps=60, lr=1e-4)
    int8 = qat.convert(q, example)
    print(
        f"  QAT (60 steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}) then int8: "
        f"{task.evaluate(int8):.4f}"
    )


if __name__ == "__main__":
    main()
