"""The command line at the edges of the process: termination signals, an interrupt during start-up,
standard output closed or full, and output names near the file-name limit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from snapmla_cli.cache.atomic import hidden_sibling, write_atomic
from snapmla_cli.cli import entry

CLI = [sys.executable, "-m", "snapmla_cli.cli.app"]
TINY_SYNTH = ["synth", "--layers", "1", "--tokens", "64", "--queries", "1", "--heads", "2"]


def _leftovers(folder: Path) -> list[str]:
    return sorted(name for name in os.listdir(folder) if name.startswith("."))


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP"])
def test_a_termination_signal_during_a_write_keeps_the_old_file_and_leaves_no_temp_file(
        tmp_path: Path, signame: str) -> None:
    """A `timeout`, a cancelled CI job or a closed terminal killed the process before the atomic
    writer's clean-up ran: the old file survived, a `.NAME.XXXXXXXX.tmp` stayed next to it."""
    target = tmp_path / "out.st"
    target.write_text("old")
    code = textwrap.dedent(f"""
        import os, signal, sys, time
        from pathlib import Path
        from snapmla_cli.cache.atomic import write_atomic
        from snapmla_cli.cli.entry import exit_on_termination_signals
        exit_on_termination_signals()
        def write(tmp):
            tmp.write_text("half")
            os.kill(os.getpid(), signal.{signame})
            time.sleep(30)  # (never reached: the handler raises at once)
        write_atomic(Path(sys.argv[1]), write, replace=True)
    """)
    done = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 128 + getattr(signal, signame), done.stderr
    assert target.read_text() == "old"
    assert _leftovers(tmp_path) == []


def test_an_interrupt_while_the_app_is_imported_exits_130_without_a_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Importing the app takes 1-2 s (torch): a Ctrl-C then printed a 25-line traceback."""
    class Interrupting:
        def find_spec(self, name: str, path: object = None, target: object = None) -> None:
            if name == "snapmla_cli.cli.app":
                raise KeyboardInterrupt
    monkeypatch.delitem(sys.modules, "snapmla_cli.cli.app", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Interrupting(), *sys.meta_path])
    monkeypatch.setattr(entry, "exit_on_termination_signals", lambda: None)  # (not this test's)
    with pytest.raises(SystemExit) as exited:
        entry.main()
    assert exited.value.code == 130


def test_json_to_a_closed_standard_output_is_refused_up_front(tmp_path: Path) -> None:
    done = subprocess.run([*CLI, "info", "--json", "-"], capture_output=False, stderr=subprocess.PIPE, text=True,
                          preexec_fn=lambda: os.close(1), timeout=120, check=False)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: snapmla info: --json -: standard output is closed; expected a file path"]


@pytest.mark.parametrize("args", [["info"], ["info", "--json", "-"]], ids=["report", "json"])
def test_a_full_standard_output_is_named(args: list[str]) -> None:
    """`> /dev/full` said only "[Errno 28] No space left on device", naming no file."""
    with open("/dev/full", "w") as full:
        done = subprocess.run([*CLI, *args], stdout=full, stderr=subprocess.PIPE, text=True, timeout=120,
                              check=False)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "error: standard output: could not write the report (No space left on device)")


def test_synth_writes_its_file_before_a_full_standard_output_fails(tmp_path: Path) -> None:
    out = tmp_path / "s.st"
    with open("/dev/full", "w") as full:
        done = subprocess.run([*CLI, *TINY_SYNTH, "-o", str(out)], stdout=full, stderr=subprocess.PIPE, text=True,
                              timeout=120, check=False)
    assert done.returncode == 2 and "standard output: could not write the report" in done.stderr
    assert out.stat().st_size > 0 and _leftovers(tmp_path) == []


@pytest.mark.parametrize("name", ["a" * 251 + ".st", "é" * 125 + ".st"], ids=["ascii", "two-byte"])
def test_an_output_name_at_the_length_limit_is_written_and_replaced(tmp_path: Path, name: str) -> None:
    """A legal name of 243-255 bytes failed after all the work: the temp name added 14 bytes."""
    assert len(os.fsencode(name)) <= 255
    target = tmp_path / name
    write_atomic(target, lambda tmp: tmp.write_text("one"), replace=False)
    write_atomic(target, lambda tmp: tmp.write_text("two"), replace=True)  # (a hard-link backup too)
    assert target.read_text() == "two"
    assert _leftovers(tmp_path) == []


def test_hidden_siblings_stay_within_the_name_limit_and_keep_the_suffix(tmp_path: Path) -> None:
    for name in ("short.yaml", "x" * 255, "é" * 127):
        sibling = hidden_sibling(tmp_path / name, ".lock")
        raw = os.fsencode(sibling.name)
        assert raw.startswith(b".") and raw.endswith(b".lock") and len(raw) <= 255
        assert sibling.parent == tmp_path
        sibling.touch()  # (the filesystem takes it)
    assert hidden_sibling(tmp_path / "short.yaml", ".lock").name == ".short.yaml.lock"


def _small_file_limit() -> None:
    """In the child: files of at most 64 bytes, and EFBIG instead of SIGXFSZ past that."""
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))


def test_a_late_json_write_failure_names_the_option(tmp_path: Path) -> None:
    """verify and info said "could not write PATH: ..." without the option (quantize and bench
    said --json); the document is written after the checks, so only the write can fail here."""
    report = tmp_path / "info.json"
    done = subprocess.run([*CLI, "info", "--json", str(report)], capture_output=True, text=True, timeout=120,
                          preexec_fn=_small_file_limit, check=False)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == f"error: --json: could not write {report}: File too large"
    assert not report.exists() and _leftovers(tmp_path) == []


def test_warnings_are_one_line_like_the_errors() -> None:
    """Python's format took two lines, the second a line of snapmla's source."""
    code = ("import warnings; from snapmla_cli.cli.entry import show_warnings_on_one_line; "
            "show_warnings_on_one_line(); warnings.warn('SNAPMLA_PDL=x is neither\\n on nor off')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.stderr.splitlines() == ["warning: SNAPMLA_PDL=x is neither on nor off"]
