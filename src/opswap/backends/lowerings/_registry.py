"""The lowerings registered so far: one record per op, written by `@lowering` (the op has
an onnxscript function) or by `no_lowering` (it has none, and the record says why)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

#: how a static int8 Linear is written: "qdq" (QuantizeLinear / DequantizeLinear around a
#: float MatMul, the interchange form OpenVINO runs as an int8 GEMM) or "integer"
#: (MatMulInteger, then the rescale: what ONNX Runtime's CPU provider runs as an int8
#: GEMM; it turned the QDQ form with a bias into a float32 Gemm on the dequantised weight,
#: 7.2 ms against 0.82 for a 128 x 768 -> 3072 layer on the VNNI VM)
INT8_FORMS = ("qdq", "integer")

#: the reason of a kernel's backward op: training graphs are not exported to a runtime
TRAINING_ONLY = "training only"


@dataclass(frozen=True)
class Options:
    """What an export chooses for the lowerings that have a choice.
    `int8`: the form of the static int8 Linear (INT8_FORMS)."""

    int8: str = "qdq"

    def __post_init__(self) -> None:
        if self.int8 not in INT8_FORMS:
            raise ValueError(f"int8 must be one of {', '.join(INT8_FORMS)}, not {self.int8!r}")


@dataclass(frozen=True)
class Lowering:
    """One op's entry. `function`: the translation torch.onnx calls with the op's arguments
    (by the schema's names), or, when `takes_options`, a function of the export's Options
    that returns it; None for an op with no lowering, whose `reason` says why."""

    op: str  # "namespace::name"; its default overload is the one translated
    module: str  # the module that registered it
    onnx: str | None = None  # what it becomes, in a few words (docs, error messages)
    function: Callable[..., Any] | None = None
    takes_options: bool = False
    reason: str | None = None  # why an op has no lowering

    @property
    def lowered(self) -> bool:
        return self.function is not None

    def overload(self) -> torch._ops.OpOverload:
        """The op's default overload (the op must be registered with torch by now)."""
        namespace, _, name = self.op.partition("::")
        packet = getattr(getattr(torch.ops, namespace), name, None)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            raise LookupError(
                f"{self.module} registers a lowering for {self.op}, which torch does not know; "
                "import the kernel that defines it first or correct the name."
            )
        return packet.default

    def translation(self, options: Options) -> Callable[..., Any]:
        """The function for the exporter's translation table."""
        if self.function is None:
            raise LookupError(f"{self.op} has no lowering ({self.reason}).")
        return self.function(options) if self.takes_options else self.function


_LOWERINGS: dict[str, Lowering] = {}


def _add(entry: Lowering) -> None:
    namespace, sep, name = entry.op.partition("::")
    if not (sep and namespace and name) or "." in name:
        raise TypeError(
            f"{entry.module}: a lowering names its op as 'namespace::name' (e.g. "
            f"'opswap::rms_norm'), not {entry.op!r}"
        )
    held = _LOWERINGS.get(entry.op)
    # a module executed again (importlib.reload) registers its entries anew
    if held is not None and held.module != entry.module:
        raise TypeError(f"{entry.op} is registered twice: by {held.module} and {entry.module}")
    _LOWERINGS[entry.op] = entry


def lowering(
    op: str, onnx: str, *, takes_options: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: the function lowers `op` ("namespace::name") to what `onnx` says. Its
    parameters are the op schema's, by name and in order (torch.onnx binds them so); with
    `takes_options`, it takes the export's Options and returns that function instead."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        _add(Lowering(op, fn.__module__, onnx, fn, takes_options))
        return fn

    return register


def no_lowering(op: str, reason: str, module: str) -> None:
    """Record that `op` has no lowering, and why (`module`: the caller's `__name__`)."""
    _add(Lowering(op, module, reason=reason))


def registered() -> list[Lowering]:
    """Every entry, lowered or not, by op name."""
    return [_LOWERINGS[k] for k in sorted(_LOWERINGS)]
