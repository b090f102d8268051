"""The device a timing runs on: resolved from what the user typed, and described in words."""

from __future__ import annotations

import re

import torch

from opswap.errors import OpswapError
from opswap.tuning.keys import cpu_name


def resolve_device(device) -> torch.device:
    """A torch.device from 'cpu', 'cuda', 'cuda:1' or a device; errors in words."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise OpswapError(f"Unknown device {device!r}; use cpu or cuda.") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise OpswapError("CUDA was asked for but torch sees no GPU; time on --device cpu.")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise OpswapError(f"Timing on {dev.type!r} is not supported; use cpu or cuda.")
    return dev


def describe_device(device) -> str:
    """'cpu: <model>, N threads' or 'cuda: <GPU name>'."""
    dev = resolve_device(device)
    if dev.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(dev)}"
    n = torch.get_num_threads()
    return f"cpu: {cpu_name()}, {n} thread{'s' if n != 1 else ''}"


def check_device(device: str) -> None:
    """Refuse, in one sentence, a device name opswap cannot run on (cpu, cuda or cuda:N),
    and CUDA on a machine without a GPU, before any work."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise OpswapError(f"Unknown device {device!r}; use cpu, cuda or cuda:N.")
    resolve_device(device)
