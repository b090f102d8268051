"""Chapter 26: opswap's result as OpenVINO's own IR (model.xml + model.bin, float32).

A small Conv+BN+ReLU network returning (logits, features) goes through the whole flow with
`export="openvino"`: your model's export and opswap's (BatchNorm folded into the conv)
are converted to IR, verified at every size they keep, timed in one interleaved loop, and
the faster verified IR is saved, loaded back in a fresh OpenVINO Core and verified again.
Then a plan's result is exported the same way (`opswap export --to openvino`), and the
saved IR is run outside opswap, in a plain OpenVINO Core, at another batch and image size.

    python examples/ch26_openvino_export.py [OUT_DIR]
"""

import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

import opswap


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x))).mean((2, 3))
        return self.fc(h), h


def main(out_dir: str) -> None:
    import openvino as ov

    torch.manual_seed(0)
    model = Net().eval()
    with torch.no_grad():  # trained-looking statistics, so the fold changes the numbers
        model.bn.running_var.uniform_(0.5, 2.0)
        model.bn.running_mean.uniform_(-0.3, 0.3)
    x = torch.randn(2, 3, 16, 16)

    # the race: openvino and opswap+openvino, each an IR, verified and timed
    result = opswap.optimize(
        model, (x,), rules="fusion.conv_bn", compare="none", export="openvino", samples=1
    )
    for v in result.variants:
        ms = f"{v.ms:.3f} ms" if v.ms is not None else "not timed"
        print(f"  {v.name:<16} {ms:>12}  {'verified' if v.verified else 'FAILED'}  {v.note}")
    run_dir = Path(out_dir) / "run"
    result.save(run_dir)
    deploy = result.deploy()
    print(f"saved {result.best}: {deploy['holds']}")
    reloaded = opswap.load_optimized(run_dir)  # an OpenVinoModule over run/model.xml
    xs = torch.randn(5, 3, 20, 24)  # another batch and another image size
    with torch.no_grad():
        want = model(xs)
    got = reloaded(xs)
    err = max((g - w).abs().max().item() for g, w in zip(got, want, strict=True))
    kind = f"a {type(got).__name__} of {len(got)}"
    print(f"load_optimized: {type(reloaded).__name__} returns {kind}; max abs {err:.2e}")

    # a plan's result, as `opswap export SPEC plan.json --to openvino --out DIR` writes it
    plan = opswap.plan(model, (x,), rules="fusion.conv_bn,fusion.conv_relu")
    done = opswap.export(model, (x,), plan, to="openvino", out=Path(out_dir) / "plan")
    v = done.verification
    size = done.path.with_suffix(".bin").stat().st_size
    print(f"wrote {done.path} and model.bin ({size} bytes of float32 weights)")
    print(f"verified as loaded back: {'passed' if v.passed else 'FAILED'} at {', '.join(v.shapes)}")

    # outside opswap: the IR in a plain OpenVINO Core, numpy in, numpy out
    compiled = ov.Core().compile_model(str(done.path), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    outs = compiled([xs.numpy()])
    logits = torch.from_numpy(outs[compiled.outputs[0]])
    print(f"plain OpenVINO, batch 5 at 20x24: max abs {(logits - want[0]).abs().max():.2e}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="opswap-ch26-ov-"))
