"""The arguments and options the commands share, with their help texts."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

Spec = Annotated[
    str,
    typer.Argument(
        metavar="SPEC",
        help="Model: zoo:NAME, hf:TYPE, hf:PATH, torchvision:NAME, "
        "timm:NAME, file.py:function or model.pt2.",
    ),
]
PlanArg = Annotated[Path, typer.Argument(metavar="PLAN", help="plan.json from `opswap plan`.")]
TargetOpt = Annotated[
    str,
    typer.Option(
        "--target", "-t", metavar="TARGET", help="Hardware target (cpu, h100, h200, a100)."
    ),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", metavar="KEY=VALUE", help="Model override (repeatable)."),
]
WeightsOpt = Annotated[
    Path | None,
    typer.Option(
        "--weights",
        "-w",
        metavar="FILE",
        help="Weights for the spec's architecture: a .safetensors file or a torch.save state dict (read with weights_only=True).",
    ),
]
JsonOpt = Annotated[
    Path | None,
    typer.Option("--json", metavar="PATH", help="Also write machine-readable output here."),
]
RulesOpt = Annotated[
    str | None,
    typer.Option(
        "--rules",
        "-r",
        metavar="GLOBS",
        help="Comma-separated rule globs, e.g. 'fusion.*,layout.drop_*'.",
    ),
]
ExactOpt = Annotated[
    str,
    typer.Option(
        "--exactness", "-e", metavar="CLASS", help="Loosest rules allowed: exact, approx or lossy."
    ),
]
RulesFromOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--rules-from",
        metavar="MODULE",
        help="Also load the rules @register'ed in this Python module (a name found on the Python path or in the current directory, or a .py file; repeatable). Installed packages add theirs through the opswap.rules entry-point group.",
    ),
]
DynamicOpt = Annotated[
    str,
    typer.Option(
        "--dynamic",
        metavar="SIZES",
        help="Input sizes kept symbolic: auto (batch and sequence, detected), none, batch, seq, or I:D=NAME items.",
    ),
]
_DEVICES = "cpu, cuda or cuda:N"
_STAGES = [
    "load",
    "capture",
    "analyze",
    "plan",
    "apply",
    "verify",
    "rollback",
    "bench",
    "measure",
    "prune",
    "layers",
    "race",
    "report",
]
BackendOpt = Annotated[
    str,
    typer.Option(
        "--backend",
        metavar="BACKEND",
        help="Where the models run: pytorch, or a runtime on the CPU that both are exported "
        "to: ort (ONNX Runtime), openvino or executorch (the XNNPACK delegate).",
    ),
]
CalibrationOpt = Annotated[
    Path | None,
    typer.Option(
        "--calibration",
        metavar="FILE",
        help="Input batches static int8 calibrates its activation scales on, every one used: "
        "a .pt file (torch.save of a list of batches, each a tensor or a tuple of forward's "
        "inputs; or of one tensor of stacked samples, cut into batches of the example's "
        "size), a .npy file (stacked samples) or a .npz file (one stacked array per input).",
    ),
]
