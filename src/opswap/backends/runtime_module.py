"""What every runtime module of opswap.backends shares: a saved file called like the module it
was made from (`RuntimeModule`), its inputs checked and fed, its outputs put back into the
model's own structure, and the small helpers each engine's code would otherwise copy.

    class OrtModule(RuntimeModule):
        def __init__(self, path, out_spec=None, threads=None, names=None):
            super().__init__(path, out_spec, threads)
            ...                                      # open the engine's session
        def run(self, leaves): ...                   # the engine's call, tensors out

The base class owns `forward` (the tensors among the arguments, `run`, the outputs in the
model's structure), `extra_repr` and `__deepcopy__` (an engine's session does not pickle: a
copy opens the file again with the same arguments, `reopen`).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import logging
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import torch
from torch import nn
from torch.utils import _pytree as pytree

from opswap.errors import ExportError, InputError

if TYPE_CHECKING:
    from opswap.backends.pt2 import Artifact


def first_line(e: BaseException, limit: int = 200, *, innermost: bool = False) -> str:
    """The first line of `e`'s message (of its innermost cause's, with `innermost`), or its
    type's name when it has none."""
    while innermost and e.__cause__ is not None:
        e = e.__cause__
    text = str(e).strip()
    return text.splitlines()[0][:limit] if text else type(e).__name__


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """An engine's import-time warnings and log lines, kept out of the user's console."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        level = logging.root.level
        logging.root.setLevel(logging.ERROR)
        try:
            yield
        finally:
            logging.root.setLevel(level)


def require(title: str, package: str, extra: str, *modules: str) -> None:
    """Import `modules`, or raise ExportError naming the pip `package` and opswap's `extra`."""
    try:
        for m in modules:
            importlib.import_module(m)
    except ImportError as e:
        raise ExportError(
            f"Running in {title} needs {package}; install it with pip install 'opswap[{extra}]'."
        ) from e


def tensors(name: str, input_names: list[str], args: tuple) -> list[torch.Tensor]:
    """The tensors among `args` (a call's arguments), refused in one sentence when there are
    not as many as the file `name` takes."""
    leaves = [x for x in pytree.tree_leaves(list(args)) if isinstance(x, torch.Tensor)]
    if len(leaves) != len(input_names):
        raise InputError(
            f"{name} takes {len(input_names)} input tensor(s) "
            f"({', '.join(input_names)}), got {len(leaves)}."
        )
    return leaves


def numpy_feed(
    name: str, where: str, input_names: list[str], fed: set[str], args: tuple
) -> dict[str, Any]:
    """The runtime's input dict for a call with `args`: one CPU tensor per input name, as
    NumPy (inputs the file does not read are left out); a wrong count, device or dtype is
    one sentence. Shared by the ONNX Runtime and OpenVINO modules and the layer readers."""
    feed = {}
    for n, x in zip(input_names, tensors(name, input_names, args), strict=True):
        if x.device.type != "cpu" or x.dtype == torch.bfloat16:
            raise InputError(
                f"{name} runs {where} and takes CPU tensors NumPy can hold; input {n} is "
                f"{x.dtype} on {x.device}."
            )
        if n in fed:
            feed[n] = x.detach().contiguous().numpy()
    return feed


def structured(tensors: list[torch.Tensor], out_spec: Any) -> Any:
    """A runtime's outputs in the model's own structure (its pytree spec), or a tensor / tuple."""
    if out_spec is not None and out_spec.num_leaves == len(tensors):
        return pytree.tree_unflatten(tensors, out_spec)
    return tensors[0] if len(tensors) == 1 else tuple(tensors)


def exported_program(
    model: nn.Module | None,
    inputs: tuple,
    dynamic: Any,
    exported: Any,
    *,
    reason: Callable[[BaseException], str] = first_line,
    needs: str = "the runtime",
) -> tuple[Any, str | None]:
    """(backends.pt2's (program, note, kept) of `model` for a runtime's file, or `exported`
    as given; None) or (None, why torch.export failed, in `reason`'s words). `needs` names
    the function that was given neither."""
    from opswap.backends.pt2 import export

    try:
        if exported is None:
            if model is None:
                raise ValueError(f"{needs} needs a model or its exported program")
            with torch.no_grad():
                exported = export(model, tuple(inputs), dynamic, runtime=True)
        _, _, _ = exported
    except Exception as e:
        return None, f"torch.export failed: {reason(e)}"
    return exported, None


def program_file(
    model: nn.Module | None,
    inputs: tuple,
    dynamic: Any,
    exported: Any,
    directory: str | Path | None,
    name: str,
    *,
    reason: Callable[[BaseException], str],
    needs: str,
) -> tuple[Any, str | None, Any, Path] | Artifact:
    """(program, note, kept, path) for a runtime's file of `model` (`exported_program`): the
    file DIRECTORY/NAME (in a fresh temporary folder without a directory) and the program's
    note speaking of NAME instead of model.pt2; or the Artifact saying why torch.export failed."""
    from opswap.backends.pt2 import Artifact

    exported, why = exported_program(model, inputs, dynamic, exported, reason=reason, needs=needs)
    if why is not None:
        return Artifact(None, None, error=why)
    program, note, kept = exported
    path = Path(directory or tempfile.mkdtemp(prefix=f"opswap-{Path(name).suffix[1:]}-")) / name
    return program, note.replace("model.pt2", name) if note else note, kept, path


def failed(path: Path, e: BaseException, note: str | None, kept: Any) -> Artifact:
    """The Artifact of a file that could not be written or loaded: removed, and why."""
    from opswap.backends.pt2 import Artifact

    path.unlink(missing_ok=True)
    return Artifact(None, None, note=note, error=str(e), kept=kept)


class RuntimeModule(nn.Module):
    """A runtime's file called like the module it was made from: positional tensors in (the
    program's inputs, in order), the model's output structure out. A subclass opens the file
    in `__init__` (after this one's), sets `input_names` and `reopen` (the keyword arguments a
    copy opens it again with), and defines `run`."""

    input_names: list[str]

    def __init__(self, path: str | Path, out_spec: Any = None, threads: int | None = None):
        super().__init__()
        self.path = Path(path)
        self.out_spec = out_spec
        self.threads = threads
        self.session_threads = threads or torch.get_num_threads()
        self.reopen: dict[str, Any] = {}
        self.training = False

    @classmethod
    def of_program(cls, path: str | Path, program: Any, **kwargs: Any) -> Self:
        """The file at `path` written from `program` (an ExportedProgram): the model's output
        structure and the names of its inputs from the program."""
        names = list(program.graph_signature.user_inputs)
        make: Any = cls  # every subclass takes `names`
        return make(path, program.call_spec.out_spec, names=names, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Self:  # a copy opens its own session
        return type(self)(
            self.path, copy.deepcopy(self.out_spec, memo), self.threads, **self.reopen
        )

    def extra_repr(self) -> str:
        return f"{self.path.name}, inputs={', '.join(self.input_names)}"

    def run(self, args: tuple) -> list[torch.Tensor]:
        """The engine's outputs for a call with `args`, as torch tensors this module owns."""
        raise NotImplementedError

    def forward(self, *args: Any) -> Any:
        return structured(self.run(args), self.out_spec)
