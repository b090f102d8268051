"""An `hf:` model (or any spec opswap loads) as an .onnx file another tool would have made:
torch.onnx.export with the dynamo exporter, its own graph optimizer off (ORT's transformer
optimizer then crashes on GPT-2's Gemm without bias and fuses nothing more on BERT or
ViT), batch and sequence symbolic. The peer comparison, its test, the chapter's example
and the benchmark start from such files."""

from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path
from typing import Any

from opswap.errors import SpecError


def export_spec(
    spec: str,
    path: str | Path,
    sets: dict[str, Any] | None = None,
    opset: int = 18,
    exporter: str = "dynamo",
) -> Path:
    """Export `spec` (with `sets` as overrides) to `path` with the `dynamo` exporter or the
    `legacy` (TorchScript) one, which takes a tenth of the time but cannot export GPT-2
    under transformers 5 (aten::diff); dims named batch and sequence (images keep their
    size). Returns the path."""
    import torch

    from opswap.models import load

    loaded = load(spec, {k: str(v) for k, v in (sets or {}).items()})
    names = list(
        getattr(
            loaded.module, "input_names", [f"input_{i}" for i in range(len(loaded.example_inputs))]
        )
    )
    batch = torch.export.Dim("batch", min=1, max=64)
    seq = torch.export.Dim("sequence", min=2, max=512)
    dyn = []
    for x in loaded.example_inputs:
        dims: dict[int, Any] = {0: batch}
        if x.dim() == 2 and not x.is_floating_point():
            dims[1] = seq  # token ids and masks
        dyn.append(dims)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            if exporter == "legacy":
                axes = {
                    n: {k: ("batch" if k == 0 else "sequence") for k in d}
                    for n, d in zip(names, dyn, strict=True)
                }
                torch.onnx.export(
                    loaded.module,
                    tuple(loaded.example_inputs),
                    str(out),
                    dynamo=False,
                    input_names=names,
                    dynamic_axes=axes,
                    opset_version=min(opset, 17),
                )
            else:
                torch.onnx.export(
                    loaded.module,
                    tuple(loaded.example_inputs),
                    str(out),
                    dynamo=True,
                    optimize=False,
                    input_names=names,
                    dynamic_shapes=tuple(dyn),
                    opset_version=opset,
                )
    except Exception as e:
        raise SpecError(
            f"{spec} could not be exported to ONNX ({type(e).__name__}: {str(e).splitlines()[0][:200]})."
        ) from None
    return out
