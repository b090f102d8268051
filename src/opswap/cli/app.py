"""The typer application: help that shows flags as flags, the exit statuses, and `main`,
which turns opswap's errors into one line and exit status 2."""

from __future__ import annotations

import importlib
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.text import Text

from opswap.cli import consoles
from opswap.errors import OpswapError

if TYPE_CHECKING:
    from click.exceptions import ClickException

EXIT_STATUS = (
    "Exit status, the same for every command: 0 when everything asked for was done and "
    "passed; 1 when a verification failed or decisions of a plan could not be applied "
    "(the command says what it saved and why); 2 for usage errors and for errors opswap "
    "names in one line (a bad spec, target, path, plan or weights file); 130 when "
    "interrupted."
)


class _FlagsAsFlags:
    """Help that shows a flag as a flag: typer >= 0.24 prints a type for every option,
    so `--no-bench` and `--help` read as if they took a value (`<bool>`)."""

    def get_params(self, ctx):
        params = super().get_params(ctx)
        for p in params:
            if getattr(p, "is_flag", False) and getattr(p, "metavar", None) is None:
                p.metavar = ""
        return params


class _Command(_FlagsAsFlags, typer.core.TyperCommand):
    pass


class _Group(_FlagsAsFlags, typer.core.TyperGroup):
    pass


class _App(typer.Typer):
    def command(self, *args, cls=None, **kwargs):
        return super().command(*args, cls=cls or _Command, **kwargs)


app = _App(
    name="opswap",
    help="Operator replacement for PyTorch models: find the costly ops, swap them, "
    "prove the numbers match, measure the gain.",
    epilog=EXIT_STATUS,
    cls=_Group,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from opswap import __version__

        typer.echo(f"opswap {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    pass


def overrides(items: list[str] | None) -> dict[str, str]:
    """The --set KEY=VALUE items as a dict."""
    out: dict[str, str] = {}
    for item in items or []:
        if "=" not in item:
            raise OpswapError(f"--set takes KEY=VALUE; got {item!r}.")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def check_outputs(
    json_path: Path | None, out: Path | None = None, *, out_dir: bool = False
) -> None:
    """Fail before any work when an output path cannot be written: a file where a directory
    goes, a directory where a file goes, or a file among its parents."""
    for opt, path, want_dir in (("--json", json_path, False), ("--out", out, out_dir)):
        if path is None:
            continue
        if want_dir and path.exists() and not path.is_dir():
            raise OpswapError(
                f"{opt} {path} is an existing file; name a directory (it is created if missing)."
            )
        if not want_dir and path.is_dir():
            raise OpswapError(f"{opt} {path} is an existing directory; name a file to write.")
        parent = next((q for q in path.parents if q.exists()), None)
        if parent is not None and not parent.is_dir():
            raise OpswapError(
                f"{opt} {path} lies under {parent}, which is a file; name another path."
            )


def _click_errors() -> tuple[type[ClickException], ...]:
    """ClickException of the click copy newer typer vendors and of the click package that
    older typer runs on; either may be absent (the two classes have the same interface)."""
    found = []
    for module in ("typer._click.exceptions", "click.exceptions"):
        try:
            found.append(importlib.import_module(module).ClickException)
        except (ImportError, AttributeError):
            pass
    return tuple(found)


#: loggers whose import-time lines say nothing to a user of the command: torchao's build
#: for CPU failing to load its CUDA-only extensions, and torch noting that torchao registers
#: Enum constants (both printed whenever transformers loads a model and imports torchao)
IMPORT_NOISE = ("torchao", "torch.utils._pytree")


def quiet_import_noise() -> None:
    """Keep only errors from IMPORT_NOISE's loggers (the command's process only)."""
    for name in IMPORT_NOISE:
        logging.getLogger(name).setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> None:
    quiet_import_noise()
    try:
        rc = app(args=argv, standalone_mode=False)
    except OpswapError as e:
        # Text, not markup: a message holding "[torch.float16]" must print as written
        consoles.err.print(Text.assemble(("error:", "bold red"), " ", str(e)), soft_wrap=True)
        sys.exit(2)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        consoles.err.print("aborted")
        sys.exit(130)
    except _click_errors() as e:  # usage errors: click's message, exit status 2
        e.show()
        sys.exit(e.exit_code)
    if isinstance(rc, int) and rc:
        sys.exit(rc)
