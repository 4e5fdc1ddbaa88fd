"""What the CLI tests share: running ``snapmla`` in-process, a small synthetic dump's options, a
umask for the permission tests, and the assertion that a bad input is one `error: ...` line and
exit code 2."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from typer.testing import CliRunner

from snapmla_cli.cli.app import app

runner = CliRunner()
# synth options of a dump small enough for a test's every run (one layer, 64 tokens)
SYNTH = ("--layers", "1", "--tokens", "64", "--queries", "1", "--heads", "2")


def invoke(*args: object):
    """``snapmla ARGS`` in this process (typer's CliRunner); arguments are turned into strings."""
    return runner.invoke(app, [str(a) for a in args])


@contextmanager
def umask(mask: int) -> Iterator[None]:
    """The process umask set to ``mask`` for the block (the permission bits of new files)."""
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def assert_one_line_error(result, *needles: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], lines[0]
