"""What a loaded `.onnx` file is: `OnnxModel` and the `InputSpec` of each graph input.

They sit under every module of opswap.onnx that reads them (load makes them; sizes,
runtime, plan and optimize read them), so that none of those imports another to name
their type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import onnx


@dataclass(frozen=True)
class InputSpec:
    """One graph input: its name, numpy dtype name, and dims (an int, or a symbol's name)."""

    name: str
    dtype: str
    dims: tuple[int | str, ...]
    #: for ids that index a constant table (Gather of an embedding): its number of rows
    high: int | None = None

    def shape(self, sizes: dict[str, int]) -> tuple[int, ...]:
        return tuple(d if isinstance(d, int) else sizes[d] for d in self.dims)


@dataclass
class OnnxModel:
    """A loaded ONNX model: the proto (with external data read in), where it came from, its
    default-domain opset, its inputs and the example size of every symbolic dim."""

    proto: onnx.ModelProto
    path: Path
    opset: int
    inputs: list[InputSpec]
    sizes: dict[str, int] = field(default_factory=dict)
    inferred: bool = False  # whether shape inference filled in value_info
    #: the file as given, where `proto` is its conversion to another opset
    given: onnx.ModelProto | None = None
    #: what loading did that the user should know (an opset converted, sizes picked)
    notes: list[str] = field(default_factory=list)
    #: the ORT session of the file as given (onnx.runtime.reference makes it once)
    _reference: Any = field(default=None, repr=False, compare=False)

    @property
    def as_given(self) -> onnx.ModelProto:
        """The model as the file holds it: what opswap's result is checked and timed against."""
        return self.given if self.given is not None else self.proto

    @property
    def symbols(self) -> list[str]:
        seen: list[str] = []
        for i in self.inputs:
            seen += [d for d in i.dims if isinstance(d, str) and d not in seen]
        return seen

    def describe(self) -> str:
        dims = ", ".join(f"{i.name} {i.dtype}[{', '.join(map(str, i.dims))}]" for i in self.inputs)
        return f"{self.path.name}: opset {self.opset}, {len(self.proto.graph.node)} nodes, inputs {dims}"
