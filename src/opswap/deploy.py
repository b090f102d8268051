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
    result = folder / "result.json"
    if compile is None:
        compile = _compiled(result) if result.is_file() else False
    module = load(pt2)
    if compile:
        return torch.compile(module)
    return module


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
               int: "a number", float: "a number", type(None): "null"}


def _compiled(result: Path) -> bool:
    """Whether the run in result.json saved a compiled variant (its `deploy.compile`)."""
    try:
        data = json.loads(result.read_text())
    except (json.JSONDecodeError, OSError, UnicodeDecodeError) as e:
        raise OpswapError(f"{result} is not readable JSON ({e}); rerun opswap optimize.") from e

    def refuse(what: str) -> OpswapError:
        return OpswapError(f"{result} is not an opswap result ({what}); rerun opswap optimize, "
                           f"or pass compile=True or False to load model.pt2 without it.")

    if not isinstance(data, dict):
        raise refuse(f"it holds {_JSON_TYPES.get(type(data), 'a value')}, not an object")
    deploy = data.get("deploy")
    if deploy is None:  # a result.json from before `deploy` was written
        return False
    if not isinstance(deploy, dict):
        raise refuse(f"its deploy is {_JSON_TYPES.get(type(deploy), 'a value')}, not an object")
    flag = deploy.get("compile", False)
    if not isinstance(flag, bool):
        raise refuse(f"its deploy.compile is {json.dumps(flag)}, not true or false")
    return flag
