"""Small pieces shared by the subcommands: consoles, number formatting, progress bars, the
``--device`` choice, output-path options (``--json -``: standard output), writing JSON reports
and the version line."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import IO, Any, cast

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..cache.atomic import naming, write_text_atomic
from ..errors import SnapmlaError

try:  # typer 0.2x carries its own copy of click (as in cli.app); older ones use click itself
    from typer._click.exceptions import BadParameter
except ImportError:  # pragma: no cover (the pinned environments have the copy)
    from click.exceptions import BadParameter  # type: ignore[assignment]

_PIPE_WIDTH = 160  # rich's width when the output is not a terminal (pipes, files, CI logs)
_MIN_WIDTH = 80  # the narrowest a terminal console is made: the tables need about that much


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


def console(stderr: bool = False) -> Console:
    """A console on stdout (tables) or stderr (progress); wide enough for the tables in logs.
    Markup is off (paths may hold brackets): style with ``rich.text.Text``."""
    probe = Console(stderr=stderr)
    width: int | None
    if not probe.is_terminal:
        width = _PIPE_WIDTH
    else:  # a terminal's width, or $COLUMNS: 0 or 1 there printed nothing or a column of letters
        width = None if probe.width >= _MIN_WIDTH else _MIN_WIDTH
    if stderr or sys.stdout is None:  # (rich drops the output of a closed stdout itself)
        return Console(stderr=stderr, markup=False, width=width)
    named = cast(IO[str], _NamedStdout(sys.stdout))  # (a proxy: rich asks only for what it forwards)
    return Console(file=named, markup=False, width=width)


class _NamedStdout:
    """Standard output for the report consoles and ``--json -``: a failed write (``> /dev/full``,
    a full disk under ``> report.txt``) is a :class:`SnapmlaError` naming standard output, where
    the bare ``[Errno 28] No space left on device`` left the user to guess which file was full.
    A reader that left (``BrokenPipeError``) still ends the command quietly (cli.app). Anything
    else is the stream's own."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        return int(_named_stdout_call(lambda: self._stream.write(text)))

    def flush(self) -> None:
        _named_stdout_call(self._stream.flush)

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding: what rich asks
        return getattr(self._stream, name)


def _named_stdout_call(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise SnapmlaError(f"standard output: could not write the report ({exc.strerror or exc})") from exc


def require_at_least(option: str, value: int | None, least: int = 1) -> None:
    """A one-line error naming ``option`` when a count given on the command line is below
    ``least`` (None: the option was left out)."""
    if value is not None and value < least:
        raise SnapmlaError(f"{option}: expected at least {least}, got {value}")


def require_at_most(option: str, value: int, most: int) -> None:
    """A one-line error naming ``option`` when a count given on the command line is above
    ``most`` (a typo, not a shape: it would otherwise run the host out of memory)."""
    if value > most:
        raise SnapmlaError(f"{option}: expected at most {most}, got {value}")


def fmt(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "-"
    if math.isnan(value) or math.isinf(value):
        return str(value)
    return f"{value:.{digits}e}"


def progress(err: Console) -> Progress:
    """A transient progress bar on stderr (disappears when done, invisible in pipes)."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,  # off a terminal rich would still end with an empty line
    )


def _json_safe(value: object) -> object:
    """Standard JSON has no inf/NaN: write them as the strings "inf", "-inf", "nan"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


# What ``--json -`` parses to: standard output. One object, compared by identity (``is_stdout``),
# because ``Path("./-")`` equals ``Path("-")``: ``--json ./-`` must still name a file called ``-``.
STDOUT = Path("-")
STDOUT_ONLY_FOR = "--json"  # the one kind of output that may go to standard output


def is_stdout(path: Path | None) -> bool:
    """Whether ``path`` is the ``-`` of ``--json -`` (standard output), not a file."""
    return path is STDOUT


def file_path(path: Path | None) -> Path | None:
    """``path`` when it names a file, None for standard output: what the output checks take
    (standard output exists, is no file to refuse or replace, needs no ``--force``)."""
    return None if is_stdout(path) else path


def report_console(json_path: Path | None) -> Console:
    """The console for a command's tables and lines: stdout, or stderr when ``--json -`` owns
    stdout, so that a pipe (``snapmla info --json - | jq``) reads one JSON document and the
    person at the terminal still sees the report."""
    return console(stderr=is_stdout(json_path))


def write_json(path: Path, payload: dict, force: bool = False) -> None:
    """The report as JSON, atomically; a file at ``path`` is replaced only with ``force``, also
    one that appeared after the command checked its outputs (see ``cache.atomic``). For
    :data:`STDOUT` the document is written to standard output in one piece (callers write it
    last, after their files landed, so a failed command prints no half-reported JSON)."""
    text = json.dumps(_json_safe(payload), indent=2) + "\n"
    if is_stdout(path):
        stdout = _NamedStdout(sys.stdout)
        stdout.write(text)
        stdout.flush()
        return
    write_text_atomic(path, text, replace=force)


def write_json_file(path: Path | None, payload: Callable[[], dict], force: bool = False) -> None:
    """``--json FILE``, written before the command prints its report, as quantize writes its
    files: a reader of stdout that leaves early (``snapmla verify --json r.json | head``) ends
    the command quietly at its next print, which must not cost the file asked for. Nothing for
    ``--json -`` (:func:`write_json_stdout`, after the report) or no ``--json``. ``payload``
    builds the document: it runs only here or in :func:`write_json_stdout` (a path is one or the
    other), so a report is built once, and not at all without ``--json``."""
    if path is not None and not is_stdout(path):
        with naming("--json"):  # (verify's and info's late failures named no option)
            write_json(path, payload(), force=force)


def write_json_stdout(path: Path | None, payload: Callable[[], dict]) -> None:
    """``--json -``: the document on standard output, after the files landed."""
    if is_stdout(path):
        write_json(STDOUT, payload())


def wrote_lines(*paths: Path | None) -> list[str]:
    """``wrote PATH`` for each output file given (standard output is not a file written)."""
    return [f"wrote {path}" for path in paths if path is not None and not is_stdout(path)]


class _PathError(BadParameter):
    """A path refused as typed on the command line (empty, or a folder's name for a file),
    phrased like ``check_writable``'s refusals (option and path, then what was expected) rather
    than click's "Invalid value for ...". ``typed``: the path as given, shown after the option
    (pathlib drops a trailing slash, so the later errors could not show it)."""

    def __init__(self, message: str, typed: str = "") -> None:
        super().__init__(message)
        self.typed = typed

    def format_message(self) -> str:
        if self.param is not None and self.param.param_type_name == "argument":  # DUMP, as in the usage
            name = self.param.metavar or (self.param.name or "path").upper()
        else:
            opts = self.param.opts if self.param is not None else []
            name = opts[0] if opts else "path"
        return f"{name} {self.typed}: {self.message}" if self.typed else f"{name}: {self.message}"


def _names_folder(typed: str) -> bool:
    """Whether the path as typed can only name a folder: a trailing slash, or a last part of
    ``.`` / ``..``. ``Path`` drops the slash and the ``.``, so ``-o out/`` would write a file
    ``out`` where the user asked for a folder."""
    return typed.endswith(os.sep) or os.path.basename(typed) in (".", "..")


def _refuse_file_as_folder(typed: str) -> None:
    """A file read through a path that names a folder (``--dump d.safetensors/``): the OS
    refuses that path ("not a directory"), and so does snapmla, instead of reading the file."""
    try:
        os.stat(typed)
    except NotADirectoryError:
        raise _PathError("not a directory (a trailing slash names a folder; expected a file path)",
                         typed) from None
    except OSError:  # missing, a loop: the reader names it
        pass


def _path_parser(kind: str, reads: bool = False, stdout: bool = False) -> Any:
    """The parser of a path option that refuses the empty string (typer would turn ``-o ''``
    into ``Path('.')``, and the later errors would then name ``'.'``, not what was typed) and,
    for a file, a path that names a folder: an output is refused outright, an input where it
    is a file (see :func:`_refuse_file_as_folder`). An output's ``-`` is standard output where
    ``stdout`` allows it (:data:`STDOUT`), else refused: a safetensors file or an image on a
    terminal is garbage, and a file silently named ``-`` is not what the user meant."""

    def parse(value: str | Path) -> Path:
        if isinstance(value, str) and value == "":
            raise _PathError(f"expected a {kind} path, got ''")
        if isinstance(value, str) and value == "-" and not reads:
            if stdout and sys.stdout is None:  # (started with fd 1 closed: `>&-`)
                raise _PathError("standard output is closed; expected a file path", value)
            if stdout:
                return STDOUT
            raise _PathError(f"'-' (standard output) is only supported for {STDOUT_ONLY_FOR}; "
                             f"expected a {kind} path (./- names one called -)", value)
        if isinstance(value, str) and kind == "file" and _names_folder(value):
            if not reads:
                raise _PathError("expected a file path, not a folder", value)
            _refuse_file_as_folder(value)
        path = Path(value)
        if str(path) == "-":  # ./- (or - for an input): a file named -, whose bare name every
            return Path(os.path.abspath(path))  # later message ("wrote -") would show as stdout's
        return path

    return parse


def output_option(*names: str, help: str, folder: bool = False) -> Any:
    """``typer.Option`` for a path the command writes (``--output``, ``--json``, ``--plot``;
    ``folder``: a folder it writes in): the empty string, and for a file a path that names a
    folder (``out/``), are one-line usage errors naming the option. ``--json -`` is standard
    output (:data:`STDOUT`; see :func:`report_console`); ``-`` for any other output is a usage
    error. Use as ``Annotated[Path, output_option("--output", "-o", help=...)]``."""
    stdout = STDOUT_ONLY_FOR in names
    if stdout:
        help = f"{help} `-`: standard output (the report then goes to stderr)."
    return typer.Option(*names, help=help, parser=_path_parser("folder" if folder else "file", stdout=stdout),
                        metavar="<path>")


def input_option(*names: str, help: str) -> Any:
    """``typer.Option`` for a file the command reads (``--dump``, ``--prompts``): the empty string
    is a one-line usage error naming the option, where typer would read ``Path('.')`` and the
    reader then report that ``.`` is a folder; so is a file named with a trailing slash. Use as
    ``Annotated[Path | None, input_option("--dump", help=...)]``."""
    return typer.Option(*names, help=help, parser=_path_parser("file", reads=True), metavar="<path>")


def input_argument(name: str, help: str) -> Any:
    """``typer.Argument`` for a file the command reads (quantize's ``DUMP``), with the empty
    string and a file named with a trailing slash refused as :func:`input_option` refuses them,
    the error naming ``name``."""
    return typer.Argument(help=help, parser=_path_parser("file", reads=True), metavar=name)


def one_line(message: BaseException | str) -> str:
    """``message`` (an exception's, or a text) on one line (runs of whitespace, newlines included,
    become one space: a path may hold a newline); an exception without a message gives its type's
    name. For commands that print their own errors; the app's handler does the same for the others."""
    text = " ".join(str(message).split())
    return text if text or isinstance(message, str) else type(message).__name__


# torch.Generator.manual_seed takes at most 64 bits; a seed beyond was a traceback
MAX_SEED = 2**63 - 1


def seed_option(help: str, maximum: int = MAX_SEED) -> Any:
    """``typer.Option`` for ``--seed``: an integer in 0 .. ``maximum`` (2^63 - 1, what every random
    generator snapmla seeds accepts; the commands that make synthetic data pass
    ``cache.synth.MAX_SYNTH_SEED``, below which no two seeds give the same data), out of range a
    one-line usage error. Use as ``Annotated[int, seed_option(help=...)]``."""
    return typer.Option("--seed", help=help, min=0, max=maximum)


def version_line(stamp: tuple[str | None, str] | None = None) -> str:
    """``snapmla 0.1.0 (kernel sources b29e59e6f1e8d09c)``: the package's version and the hash
    the tuning database's entries are stamped with, so a report names the exact kernels
    (``snapmla --version``, the first line of ``snapmla info``). ``stamp``: the kernel sources'
    stamp if the caller has read it (``nvrtc.kernel_sources_stamp``), else it is read here."""
    from .. import __version__
    from ..runtime.nvrtc import kernel_sources_stamp

    digest, why = stamp if stamp is not None else kernel_sources_stamp()
    return f"snapmla {__version__} ({f'kernel sources {digest}' if digest else one_line(why)})"
