"""A loaded program's calls of opswap's Triton ops, made without the dispatcher when that
changes nothing.

An eager call of `torch.ops.opswap.rms_norm` goes through the dispatcher twice (the
autograd kernel `register_autograd` installs, then the op's Python implementation) before
opswap's Python launches the kernel. Measured on an H100 (benchmarks/bench_host_overhead.py,
2026-12-07, bf16 8x4096, host-bound): 108 us of host time per call, of which about 40 us is
the dispatcher's and 19 us the bare Triton launch, against 9 us for torch's own fused op. A
row kernel at 4096x4096 runs in about 20 us on that card, so every opswap row op in an
eager graph was bound by its host time.

`fast_calls` rewrites a loaded GraphModule so that each call of an opswap Triton op goes to
a small function instead. That function calls the op's Python implementation directly
(with torch's HOP wrapping of the launch off, as the op's own eager kernel has it) when the
call is a plain eager call: no torch.compile or export tracing it, no dispatch mode active
(fake tensors, functionalisation, make_fx), only plain tensors, and no gradient to record.
Any other call goes to the op, so torch.compile of the loaded module, torch.export, FX
tracing and training see the op exactly as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from opswap.kernels._triton_op import PYTHON

try:  # torch's switch for the HOP wrapping of kernel launches (its triton_op eager path)
    from torch._library.triton import set_wrap_triton_enabled
except ImportError:  # pragma: no cover - a torch without it keeps the dispatcher
    set_wrap_triton_enabled = None  # type: ignore[assignment]

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _plain_call(args: tuple, kwargs: dict) -> bool:
    """Whether a call can skip the dispatcher: no dispatch mode, plain tensors only, and
    nothing that asks autograd to record it."""
    if torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled():
        return False
    grad = torch.is_grad_enabled()
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            if type(a) not in _PLAIN or (grad and a.requires_grad):
                return False
        elif isinstance(a, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in a):
            return False  # lists of tensors: leave them to the op's own checks
    return True


def direct(op: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
    """The function a graph calls in place of `op`: `fn` (the op's Python implementation)
    for a plain eager call, else the op."""

    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() or not _plain_call(args, kwargs):
            return op(*args, **kwargs)
        with set_wrap_triton_enabled(False):  # type: ignore[misc]
            return fn(*args, **kwargs)

    call.__name__ = call.__qualname__ = f"direct_{op.name().split('::')[-1]}"
    call.__module__ = __name__
    call.opswap_op = op  # type: ignore[attr-defined]
    return call


def fast_calls(module: fx.GraphModule) -> int:
    """Point every call of an opswap Triton op in `module` at `direct(op)` (in place) and
    recompile; the number of calls rewritten."""
    if set_wrap_triton_enabled is None:
        return 0
    made: dict[Any, Callable[..., Any]] = {}
    n = 0
    for node in module.graph.nodes:
        op = node.target
        if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
            continue
        fn = PYTHON.get(op._schema.name)
        if fn is None:
            continue
        if op not in made:
            made[op] = direct(op, fn)
        node.target = made[op]
        n += 1
    if n:
        module.recompile()
    return n
