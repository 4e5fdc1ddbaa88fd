"""The ``snapmla`` command: a typer app whose subcommands live one per module in this package.

Errors are handled once, here: a :class:`SnapmlaError` (bad argument, bad file) or an ``OSError``
(unwritable path, full disk) from any subcommand becomes ``error: <message>`` on one line of
stderr and exit code 2, never a traceback. Anything else is a bug in snapmla: one line naming
it, exit code 3, and the traceback only with ``SNAPMLA_TRACEBACK=1``. To add a subcommand, add a
line to ``COMMANDS``; optional ones whose module is absent are skipped.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any, NoReturn

import typer
from typer.core import TyperGroup

try:  # typer 0.2x carries its own copy of click; older ones use click itself
    from typer._click import exceptions as click_errors
    from typer._click.core import Context as ClickContext
except ImportError:  # pragma: no cover (the pinned environments have the copy)
    from click import exceptions as click_errors  # type: ignore[no-redef]
    from click.core import Context as ClickContext  # type: ignore[assignment]

from ..env_switch import env_switch
from ..errors import SnapmlaError
from .common import one_line, version_line
from .entry import INTERRUPTED_EXIT, exit_on_termination_signals, show_warnings_on_one_line

# (name, module under snapmla_cli.cli, function, required). Optional modules may be absent.
COMMANDS: list[tuple[str, str, str, bool]] = [
    ("synth", "synth", "synth_command", True),
    ("quantize", "quantize", "quantize_command", True),
    ("verify", "verify", "verify_command", True),
    ("info", "info", "info_command", True),
    ("dump", "dump", "dump_command", False),
    ("tune", "tune", "tune_command", False),
    ("bench", "bench", "bench_command", False),
]


USAGE_EXIT = 2  # a bad argument or input file, an unwritable output
INTERNAL_EXIT = 3  # a bug: an exception snapmla did not expect
TRACEBACK_ENV = "SNAPMLA_TRACEBACK"  # set to 1: an internal error shows its traceback
STDOUT_GONE_EXIT = 1  # the reader of stdout left: rich's Console.on_broken_pipe exits 1 too


def _stdout_gone() -> NoReturn:
    """The reader of stdout went away (``snapmla verify | head``): nothing to report, and Python's
    flush at exit must not print a complaint of its own, so stdout now points at /dev/null."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    sys.exit(STDOUT_GONE_EXIT)


# typer validates choices through pydantic, whose message for a ValueError starts with this; the
# user asked for a choice, not for a validator's wording
_VALIDATOR_PREFIX = "Value error, "


def _without_validator_prefix(message: str) -> str:
    """A parse error's text without pydantic's "Value error, " (``--device foo``: "Invalid value
    for '--device': 'foo' is not one of 'auto', 'cpu', 'cuda'.")."""
    return message.replace(": " + _VALIDATOR_PREFIX, ": ")


class SnapmlaGroup(TyperGroup):
    """Turns user-facing errors of every subcommand into one line and exit code 2, the option
    parser's too (typer would draw them as a multi-line box)."""

    def main(self, *args: Any, **kwargs: Any) -> NoReturn:
        kwargs["standalone_mode"] = False
        try:
            code = super().main(*args, **kwargs)
        except BrokenPipeError:
            _stdout_gone()
        except click_errors.NoArgsIsHelpError:  # the help is on the screen already
            sys.exit(USAGE_EXIT)
        except click_errors.ClickException as exc:
            where = f"{exc.ctx.command_path}: " if isinstance(exc, click_errors.UsageError) and exc.ctx else ""
            typer.echo(f"error: {where}{one_line(_without_validator_prefix(exc.format_message()))}", err=True)
            sys.exit(exc.exit_code)
        except typer.Abort:  # end of input at a prompt
            typer.echo("aborted", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)

    def invoke(self, ctx: ClickContext) -> Any:
        try:
            return super().invoke(ctx)
        except BrokenPipeError:  # not the user's error: main() ends quietly
            raise
        except (SnapmlaError, OSError) as exc:
            typer.echo(f"error: {one_line(exc)}", err=True)
            raise typer.Exit(USAGE_EXIT) from None
        except (typer.Exit, typer.Abort, click_errors.ClickException, KeyboardInterrupt):
            raise
        except Exception as exc:
            if env_switch(TRACEBACK_ENV, False):
                raise
            typer.echo(f"error: internal error in snapmla ({type(exc).__name__}: {one_line(exc)}); "
                       f"please report it with the output of {TRACEBACK_ENV}=1", err=True)
            raise typer.Exit(INTERNAL_EXIT) from None


app = typer.Typer(
    cls=SnapmlaGroup,
    name="snapmla",
    help="FP8 MLA decoding for Hopper GPUs (SnapMLA): synthetic and captured KV caches, "
    "quantization fidelity, verification against float64 references, GPU facts.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # docstrings are wrapped at 100 columns: markdown joins a paragraph's lines, as rich keeps them
    rich_markup_mode="markdown",
)


def _show_version(value: bool) -> None:
    if value:
        typer.echo(version_line())
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(False, "--version", help="Show the version and the kernel sources' hash, then exit.",
                                 callback=_show_version, is_eager=True),
) -> None:
    """The options of ``snapmla`` itself (the help text is the app's ``help``)."""


def _register() -> None:
    for name, module_name, function, required in COMMANDS:
        full = f"{__package__}.{module_name}"
        if not required and importlib.util.find_spec(full) is None:
            continue
        module = importlib.import_module(full)
        app.command(name)(getattr(module, function))


if __name__ == "__main__":  # (python -m: before the commands' imports, which may warn)
    show_warnings_on_one_line()
try:
    _register()
except KeyboardInterrupt:  # (python -m snapmla_cli.cli.app: as entry.main does for the console script)
    if __name__ != "__main__":
        raise
    sys.exit(INTERRUPTED_EXIT)


def main() -> None:
    exit_on_termination_signals()
    show_warnings_on_one_line()
    app(prog_name="snapmla")


if __name__ == "__main__":
    main()
