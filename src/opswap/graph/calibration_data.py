"""Calibration data a user gives: the batches static int8 runs the model on to fix its
activation scales, read from a file or taken from Python, and checked against the
model's example inputs.

The forms, the same from `--calibration FILE`, a spec file's `calibration()` and
`calibration_data=` in Python:

- a list (or tuple) of batches, each one call's positional inputs: a tensor for a model
  that takes one input, else a tuple (or list) of tensors, in forward's order;
- one tensor: samples stacked along the first axis, for a model that takes one input;
  it is cut into batches of the example's batch size (a last, shorter batch is dropped,
  unless it is the only one);
- in a file: `.pt` / `.pth` (torch.save of either form above, read with
  `weights_only=True`), `.npy` (one stacked array) or `.npz` (one stacked array per
  input, in the order the archive holds them: `np.savez(f, x)` or
  `np.savez(f, ids=..., mask=...)`).

Every batch must hold as many tensors as the example, each of the example's rank and
kind of dtype (floating, integer, bool); a floating tensor is converted to the example's
floating dtype (NumPy's float64 to float32, say), an integer one to its integer dtype,
and every tensor is moved to the example's device. Sizes are left to the run: a graph
that keeps a size static refuses another one when calibration runs it, in one sentence.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from opswap.errors import CalibrationError

#: the file suffixes `read_file` takes
SUFFIXES = (".pt", ".pth", ".npy", ".npz")


def check_path(path: str | os.PathLike) -> Path:
    """`path` as a Path when it names a calibration file opswap reads; else one sentence."""
    p = Path(os.path.expanduser(os.fspath(path)))
    if not p.is_file():
        raise CalibrationError(
            f"No calibration file at {p}; give a .pt (torch.save of a list of input "
            "batches, or of one tensor of stacked samples), .npy or .npz file."
        )
    if p.suffix.lower() not in SUFFIXES:
        raise CalibrationError(
            f"{p.name} is not a calibration file opswap reads; use {', '.join(SUFFIXES)} "
            "(see `opswap optimize --help`)."
        )
    return p


def read_file(path: str | os.PathLike) -> Any:
    """What a calibration file holds, not yet cut into batches: a tensor, a list of
    batches, or (from .npz) a tuple of stacked tensors, one per input."""
    p = check_path(path)
    suffix = p.suffix.lower()
    try:
        if suffix in (".pt", ".pth"):
            return torch.load(p, map_location="cpu", weights_only=True)
        import numpy as np

        if suffix == ".npy":
            return torch.from_numpy(np.load(p, allow_pickle=False))
        with np.load(p, allow_pickle=False) as archive:
            if not archive.files:
                raise CalibrationError(f"{p.name} holds no arrays; save one array per input.")
            return _Stacked(tuple(torch.from_numpy(archive[k]) for k in archive.files))
    except CalibrationError:
        raise
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CalibrationError(
            f"Could not read calibration file {p.name} ({type(e).__name__}: {first[:200]})."
        ) from e


class _Stacked(tuple):
    """Stacked samples of several inputs (an .npz file): cut into batches like one tensor."""


def batches(data: Any, example_inputs: Sequence[Any], where: str) -> list[tuple[Any, ...]]:
    """`data` in any of the module's forms as a list of input tuples shaped like
    `example_inputs` (checked, converted, on its device); `where` names the data in
    errors ("batches.pt", "calibration() in model.py")."""
    example = tuple(example_inputs)
    if isinstance(data, (str, os.PathLike)):
        data = read_file(data)
    if isinstance(data, torch.Tensor):
        data = _Stacked((data,))
    if isinstance(data, _Stacked):
        out = _cut(data, example, where)
    elif isinstance(data, (list, tuple)):
        out = [
            tuple(b) if isinstance(b, (list, tuple)) else (b,) for b in data
        ]  # a tensor alone is one input
    else:
        raise CalibrationError(
            f"Calibration data from {where} is a {type(data).__name__}; give a list of input "
            "batches (each a tensor or a tuple of tensors) or one tensor of stacked samples."
        )
    if not out:
        raise CalibrationError(f"Calibration data from {where} holds no batch; give at least one.")
    return [_fit(b, example, where, i) for i, b in enumerate(out)]


def _batch_size(example: tuple[Any, ...], where: str) -> int:
    first = example[0] if example else None
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        raise CalibrationError(
            f"Calibration data from {where} is stacked samples, but the model's first input "
            "has no batch axis to cut them along; give a list of input batches instead."
        )
    return int(first.shape[0])


def _cut(stacked: tuple[Any, ...], example: tuple[Any, ...], where: str) -> list[tuple]:
    """Stacked samples, one tensor per input, cut into batches of the example's size."""
    if len(stacked) != len(example):
        raise CalibrationError(
            f"Calibration data from {where} holds {len(stacked)} stacked "
            f"input{'s' if len(stacked) != 1 else ''}, and the model takes {len(example)}; "
            "give one array per input, or a list of input batches."
        )
    if any(not isinstance(t, torch.Tensor) or t.dim() == 0 for t in stacked):
        raise CalibrationError(
            f"Calibration data from {where} holds a value that is not a tensor of samples."
        )
    counts = {int(t.shape[0]) for t in stacked}
    if len(counts) != 1:
        raise CalibrationError(
            f"The stacked inputs in {where} hold different numbers of samples "
            f"({', '.join(str(n) for n in sorted(counts))}); give each input the same number."
        )
    n, size = counts.pop(), _batch_size(example, where)
    if n == 0:
        return []
    if n <= size:
        return [tuple(stacked)]
    return [tuple(t[i : i + size] for t in stacked) for i in range(0, n - size + 1, size)]


def _kind(t: torch.Tensor) -> str:
    if t.dtype == torch.bool:
        return "bool"
    return "floating" if t.is_floating_point() else "complex" if t.is_complex() else "integer"


def _fit(batch: tuple[Any, ...], example: tuple[Any, ...], where: str, i: int) -> tuple:
    """One batch checked against the example, converted to its dtypes and device."""
    if len(batch) != len(example):
        raise CalibrationError(
            f"Calibration batch {i} from {where} holds {len(batch)} "
            f"input{'s' if len(batch) != 1 else ''}, and the model takes {len(example)}; "
            "give each batch as a tuple of forward's positional inputs."
        )
    out = []
    for j, (x, ref) in enumerate(zip(batch, example, strict=True)):
        if not isinstance(ref, torch.Tensor):
            out.append(ref)  # a constant the example passes (none in a capture's inputs)
            continue
        at = f"calibration batch {i}, input {j}, from {where}"
        if not isinstance(x, torch.Tensor):
            raise CalibrationError(f"The {at} is a {type(x).__name__}, not a tensor.")
        if x.dim() != ref.dim():
            raise CalibrationError(
                f"The {at} has shape {list(x.shape)}, and the model's example has "
                f"{list(ref.shape)}: {ref.dim()} axes are needed."
            )
        if _kind(x) != _kind(ref):
            raise CalibrationError(
                f"The {at} is {str(x.dtype).removeprefix('torch.')}, and the model's example "
                f"is {str(ref.dtype).removeprefix('torch.')}; give {_kind(ref)} values."
            )
        out.append(x.detach().to(device=ref.device, dtype=ref.dtype))
    return tuple(out)
