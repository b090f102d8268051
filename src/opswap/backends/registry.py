"""The runtimes opswap races, verifies, benches, exports and saves in: one `Runtime` class per
engine, registered with `@register` in the engine's own module of opswap.backends (ort,
openvino, executorch, tvm). Everything else looks engines up here, never by name.

    from opswap.backends import registry
    for rt in registry.runtimes():          # ort, openvino, executorch, tvm: race order
        print(rt.name, rt.title, rt.file)   # ort ONNX Runtime model.onnx
    registry.for_export("pte").name          # "executorch"
    registry.of_variant("opswap+tvm").title  # "TVM"

A runtime states what it is (its name, the file it saves, the modules it needs, what
`--export` formats save its file, the words result.json uses) and does four things:
`build` writes a program's file and loads it (a backends.pt2.Artifact whose module is
timed), `load` opens a saved file, `deploy` says what the saved file holds and how to run
it, and, where the engine can return any named value of its file, `read_values` reads them
for the layer-by-layer comparison (backends.runtime_layers). A new runtime is one module of
opswap.backends with its class and its test (docs/runtimes.md); the registry finds it by
importing the modules of opswap.backends the first time it is asked.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from torch import nn

if TYPE_CHECKING:
    from opswap.backends.pt2 import Artifact, Exported
    from opswap.graph.dynamic import Dynamic

_RUNTIMES: dict[str, Runtime] = {}
_loaded = False


@dataclass(frozen=True)
class Deploy:
    """What a runtime's saved file holds and how to run it, in result.json's `deploy` words."""

    holds: str
    how: str
    run_under: str


def holds(mine: bool, form: str) -> str:
    """What a saved file holds, in result.json's `deploy` words: opswap's model or the input,
    `form` ("compiled by Apache TVM for this CPU")."""
    if mine:
        return f"opswap's optimized model {form}"
    return f"your model {form} with no rewrite: opswap's did not beat it in this run"


class Runtime:
    """One engine the race can time. Subclasses set the class attributes and define `build`,
    `load` and `deploy` (and `read_values` with `layer_forms`, for an engine that returns any
    named value of its file); `@register` adds one instance to the registry."""

    #: the --compare baseline, and its two variants: NAME (the input's file) and opswap+NAME
    name: ClassVar[str]
    #: the engine in the report's words ("ONNX Runtime")
    title: ClassVar[str]
    #: where its variants stand in the race and in every list of runtimes, lowest first
    rank: ClassVar[int]
    #: the name its own file is saved under in DIR, and what `load` opens ("model.onnx")
    file: ClassVar[str]
    #: the file its race variants write without --export, when not `file` (OpenVINO times
    #: .onnx files, which ONNX Runtime's `file` is)
    race_file: ClassVar[str] = ""
    #: files that travel with it, named from the file's "{name}" or "{stem}" ("{name}.data")
    beside: ClassVar[tuple[str, ...]] = ()
    #: the modules its files need, and the extra that installs them (pip install 'opswap[X]')
    needs: ClassVar[tuple[str, ...]]
    extra: ClassVar[str]
    #: the engine where the race runs it, for the note when the race is on another device
    runs: ClassVar[str]
    #: the --export (and `opswap export --to`) formats that race its variants and save its file
    exports: ClassVar[tuple[str, ...]] = ()
    #: what those formats save, in words ("an .onnx file"), and what `opswap export` makes
    saves: ClassVar[str] = ""
    exported_as: ClassVar[str] = ""
    #: whether its saved file is loaded back from DIR and verified before a run moves in
    reload: ClassVar[bool] = False
    #: whether `verify --backend` and `bench --backend` offer it
    backend: ClassVar[bool] = True
    #: the (int8 form, onnxscript fusions) its file is translated with, in the order tried, for
    #: the layer-by-layer comparison; empty: the engine keeps its values to itself
    layer_forms: ClassVar[tuple[tuple[str, bool], ...]] = ()
    #: why there are no layers, after the title ("keeps its intermediate values inside ...")
    no_layers: ClassVar[str] = "keeps its intermediate values to itself"
    #: the rules --export leaves out of every plan on the CPU, and the end of the note saying why
    left_out: ClassVar[tuple[tuple[str, ...], str] | None] = None

    def build(
        self,
        model: nn.Module | None,
        inputs: tuple,
        dynamic: Dynamic | None = None,
        *,
        exported: Exported | None = None,
        mine: bool = True,
        export: bool = False,
        portable: bool = False,
    ) -> Artifact:
        """The file of `model` (or of `exported`, backends.pt2's (program, note, kept) of it)
        written and loaded in the engine: an Artifact whose `module` is timed; never raises
        (its `error` says why). `mine`: opswap's file (what opswap adds in this engine);
        `export`: the form --export saves; `portable`: the file `opswap export` writes on its
        own, which holds nothing only this engine reads."""
        raise NotImplementedError

    def load(self, path: Path) -> nn.Module:
        """The saved file at `path`, opened for use: the model's inputs in, its outputs out."""
        raise NotImplementedError

    def deploy(self, mine: bool, file: str) -> Deploy:
        """What the saved `file` holds (opswap's when `mine`, else the input's) and how to run it."""
        raise NotImplementedError

    def read_values(self, path: Path, names: list[str], feed: dict) -> dict[str, Any]:
        """The values `names` of the .onnx file at `path`, run on `feed` (NumPy inputs by name),
        as NumPy arrays; a name the engine folded away is left out."""
        raise NotImplementedError

    @property
    def variants(self) -> tuple[str, str]:
        """Its two variants in the race: the input's file, then opswap's."""
        return self.name, f"opswap+{self.name}"

    @property
    def build_file(self) -> str:
        """The file its race variants write without --export."""
        return self.race_file or self.file

    def key(self, variant: str) -> str:
        """The key in Race.artifacts of `variant`'s file ("ort_input", "ort_candidate")."""
        return f"{self.name}_{'candidate' if variant.startswith('opswap+') else 'input'}"

    def files(self) -> tuple[str, ...]:
        """Every name its saved file may bring into DIR: the file and what travels with it."""
        return (self.file, *(self.beside_of(Path(self.file)).keys()))

    def beside_of(self, path: Path) -> dict[str, Path]:
        """The files that travel with the file at `path`, by their name."""
        out = {}
        for pattern in self.beside:
            p = path.with_name(pattern.format(name=path.name, stem=path.stem))
            out[p.name] = p
        return out

    def absent(self) -> list[str]:
        """The modules it needs that are not installed."""
        return [m for m in self.needs if importlib.util.find_spec(m) is None]

    def missing(self, what: str) -> str | None:
        """One sentence saying that `what` ("--export onnx") needs the modules that are not
        installed, and how to install them; None when none is missing."""
        absent = self.absent()
        if not absent:
            return None
        return (
            f"{what} needs {' and '.join(absent)}; install "
            f"{'it' if len(absent) == 1 else 'them'} with pip install 'opswap[{self.extra}]'."
        )

    def __repr__(self) -> str:
        return f"<runtime {self.name}: {self.title}, {self.file}>"


def register(cls: type[Runtime]) -> type[Runtime]:
    """Class decorator: add one instance of a Runtime subclass to the registry."""
    if not (isinstance(cls, type) and issubclass(cls, Runtime)):
        raise TypeError(f"@register takes a subclass of backends.registry.Runtime, not {cls!r}")
    for attr in ("name", "title", "rank", "file", "needs", "extra", "runs"):
        if not hasattr(cls, attr):
            raise TypeError(f"runtime {cls.__name__} lacks the class attribute {attr!r}")
    for method in ("build", "load", "deploy"):
        if getattr(cls, method) is getattr(Runtime, method):
            raise TypeError(f"runtime {cls.name} does not define {method}()")
    if cls.layer_forms and cls.read_values is Runtime.read_values:
        raise TypeError(f"runtime {cls.name} has layer_forms but does not define read_values()")
    if cls.exports and not cls.saves:
        raise TypeError(f"runtime {cls.name} has export formats but no `saves` words")
    held = _RUNTIMES.get(cls.name)
    if held is not None and type(held).__qualname__ != cls.__qualname__:
        raise TypeError(f"runtime name {cls.name!r} is taken by {type(held).__qualname__}")
    _RUNTIMES[cls.name] = cls()
    return cls


def _load() -> None:
    """Import every module of opswap.backends once, so that each runtime registers itself.
    A module that asks the registry while it is imported here (backends.runtime_layers)
    imports the rest first, so it never sees a partial registry."""
    global _loaded
    if _loaded:
        return
    import opswap.backends as package

    for info in pkgutil.iter_modules(package.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{package.__name__}.{info.name}")
    _loaded = True


def runtimes() -> tuple[Runtime, ...]:
    """Every registered runtime, in race order."""
    _load()
    return tuple(sorted(_RUNTIMES.values(), key=lambda r: (r.rank, r.name)))


def names() -> tuple[str, ...]:
    """Every runtime's name, in race order."""
    return tuple(r.name for r in runtimes())


def get(name: str) -> Runtime:
    """The runtime called `name`; KeyError for another name."""
    _load()
    return _RUNTIMES[name]


def of_variant(variant: str) -> Runtime | None:
    """The runtime whose variant `variant` is (`ort` or `opswap+ort`), or None."""
    _load()
    return _RUNTIMES.get(variant.removeprefix("opswap+"))


def for_export(fmt: str) -> Runtime | None:
    """The runtime whose file the --export format `fmt` saves, or None."""
    return next((r for r in runtimes() if fmt in r.exports), None)


def export_formats() -> tuple[str, ...]:
    """Every --export format, in race order."""
    return tuple(f for r in runtimes() for f in r.exports)


def of_file(path: str | Path) -> Runtime | None:
    """The runtime whose own file has `path`'s suffix (it saves and loads that file), or None."""
    suffix = Path(path).suffix
    return next((r for r in runtimes() if Path(r.file).suffix == suffix), None)
