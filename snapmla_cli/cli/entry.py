"""The ``snapmla`` console script: the process's signal set-up, before the app is imported.

Importing the app imports every subcommand and torch (1-2 s): a Ctrl-C in that time printed a
25-line traceback. SIGTERM and SIGHUP (``timeout``, a cancelled CI job, a closed terminal) ended
the process without running the atomic writers' clean-up, which left ``.NAME.XXXXXXXX.tmp``
files next to the outputs. Here both raise ``SystemExit(128 + signal)``, so that ``finally``
blocks run as they do for Ctrl-C's ``KeyboardInterrupt``, and an interrupt during the import
ends quietly with exit code 130, as one during a command does."""

from __future__ import annotations

import signal
import sys
import warnings
from types import FrameType
from typing import TextIO

from ..errors import bounded

INTERRUPTED_EXIT = 128 + signal.SIGINT
TERMINATION_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


def _exit_for_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def exit_on_termination_signals() -> None:
    """SIGTERM and SIGHUP as ``SystemExit(128 + signal)`` in the main thread: the shell's exit
    status for a killed process, after the ``finally`` clean-ups."""
    for signum in TERMINATION_SIGNALS:
        signal.signal(signum, _exit_for_signal)


def show_warnings_on_one_line() -> None:
    """Warnings as one ``warning: ...`` line on stderr, like the errors: Python's own format took
    two lines, the second a line of snapmla's source. Set before the app's imports, which read
    the environment switches (and warn about a value that is neither on nor off)."""
    warnings.showwarning = _show_warning


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: TextIO | None = None, line: str | None = None) -> None:
    print(f"warning: {bounded(str(message))}", file=file or sys.stderr)


def main() -> None:
    exit_on_termination_signals()
    show_warnings_on_one_line()
    try:
        from .app import main as app_main
    except KeyboardInterrupt:
        sys.exit(INTERRUPTED_EXIT)
    app_main()
