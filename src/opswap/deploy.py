"""Loading what `opswap optimize --out DIR` saved, ready to run.

    import torch, opswap
    model = opswap.load_optimized("out/resnet")
    with torch.inference_mode():
        y = model(x)

DIR/model.pt2 is the variant that won the race (result.json's `deploy`), the very
file that was timed. Loading registers opswap's ops first and runs no pickled code.
When the winner was a compiled variant, the loaded graph is handed to torch.compile,
as it was when timed. Run it under `torch.inference_mode()` (or `torch.no_grad()`):
with autograd recording, the fused kernels give way to differentiable ones and
most of the speed-up is gone.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from opswap.errors import OpswapError


def load_optimized(directory: str | Path, *, compile: bool | None = None) -> nn.Module:
    """The saved best variant of an optimize run in `directory` (or a model.pt2 path).

    `compile=None` follows the run (torch.compile when a compiled variant won);
    True / False force it on or off."""
    from opswap.backends.pt2 import load

    path = Path(directory)
    folder = path.parent if path.suffix == ".pt2" else path
    pt2 = path if path.suffix == ".pt2" else path / "model.pt2"
    if not pt2.is_file():
        state = folder / "model_state.pt"
        if state.is_file():
            raise OpswapError(
                f"{folder} holds model_state.pt but no model.pt2 (the model did not export, "
                f"see model_state.txt); rebuild it with `opswap apply SPEC {folder}/plan.json`.")
        raise OpswapError(f"No saved model at {pt2}; `opswap optimize SPEC --out DIR` writes "
                          f"DIR/model.pt2.")
    deploy = {}
    result = folder / "result.json"
    if result.is_file():
        try:
            deploy = json.loads(result.read_text()).get("deploy") or {}
        except (json.JSONDecodeError, OSError) as e:
            raise OpswapError(f"{result} is not readable JSON ({e}); rerun opswap optimize.") from e
    module = load(pt2)
    if compile if compile is not None else bool(deploy.get("compile")):
        return torch.compile(module)
    return module
