"""Outputs that must not clobber, and outputs that land together (``cache.atomic``): a file that
appears while a command works is never silently replaced without --force; a group of outputs
whose moves fail part way is undone (replaced files restored, new ones removed, no temp or
backup file left), Ctrl-C included; filesystems without hard links still work; an empty output
path is refused as typed. CPU only, fast; everything happens under tmp_path."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cli_checks import SYNTH, assert_one_line_error, invoke, umask

from snapmla_cli.cache import atomic, rename_flags
from snapmla_cli.cache.atomic import (
    OutputWriteError,
    check_writable,
    committed_together,
    write_atomic,
    write_text_atomic,
)
from snapmla_cli.errors import SnapmlaError

# a file as a test sees it: content, permission bits, inode (a restored file is the same inode)
Snapshot = dict[str, tuple[bytes, int, int]]


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def snapshot(folder: Path) -> Snapshot:
    return {p.name: (p.read_bytes(), stat.S_IMODE(p.stat().st_mode), p.stat().st_ino)
            for p in folder.iterdir()}


def assert_one_line(message: str, *needles: str) -> None:
    assert "\n" not in message and ".tmp" not in message, message
    for needle in needles:
        assert needle in message, message


@pytest.fixture
def umask_022() -> Iterator[None]:
    with umask(0o022):
        yield


def fail_once(real: Callable[..., None], target: Path, failure: BaseException) -> Callable[..., None]:
    """``os.replace`` / ``os.link`` that raises ``failure`` the first time ``target`` is the
    destination (the undo renames onto the same names later, which must work)."""
    state = {"failed": False}

    def fake(src: object, dst: object, *args: object, **kwargs: object) -> None:
        if not state["failed"] and Path(dst) == target:
            state["failed"] = True
            raise failure
        real(src, dst, *args, **kwargs)

    return fake


def colliding(ours: str, someone_else: Callable[[], object]) -> Callable[[Path], None]:
    """A writer that writes ``ours`` into the temp file, then lets ``someone_else`` create the
    output (another process, after every check snapmla made)."""
    def write(tmp: Path) -> None:
        tmp.write_text(ours)
        someone_else()

    return write


def no_hard_links(src: object, dst: object, *args: object, **kwargs: object) -> None:
    raise OSError(errno.EPERM, "Operation not permitted")


# --- a file that appears between the check and the write -----------------------------------


def test_a_file_that_appears_during_the_work_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "out.json"
    check_writable(path, force=False)

    meanwhile = colliding("ours", lambda: path.write_text("theirs"))
    with pytest.raises(OutputWriteError) as caught:
        write_atomic(path, meanwhile, replace=False)
    assert_one_line(str(caught.value), str(path), "appeared", "--force")
    assert path.read_text() == "theirs" and listing(tmp_path) == ["out.json"]


def test_a_dangling_symlink_that_appears_counts_as_a_file(tmp_path: Path) -> None:
    path = tmp_path / "out.json"

    meanwhile = colliding("ours", lambda: path.symlink_to("elsewhere.json"))
    with pytest.raises(OutputWriteError, match="appeared"):
        write_atomic(path, meanwhile, replace=False)
    assert path.is_symlink() and not (tmp_path / "elsewhere.json").exists()
    assert listing(tmp_path) == ["out.json"]
    with pytest.raises(SnapmlaError, match="appeared"):  # refused up front too, nothing written
        write_text_atomic(path, "x", replace=False)
    assert listing(tmp_path) == ["out.json"]


def test_replace_still_replaces_and_keeps_the_mode(tmp_path: Path, umask_022: None) -> None:
    path = tmp_path / "out.json"
    path.write_text("old")
    path.chmod(0o604)

    meanwhile = colliding("new", lambda: path.write_text("theirs"))  # with --force: replaced too
    write_atomic(path, meanwhile, replace=True)
    assert path.read_text() == "new" and stat.S_IMODE(path.stat().st_mode) == 0o604
    write_text_atomic(path, "newer")  # the default: the kernel cache and tuning database
    assert path.read_text() == "newer" and stat.S_IMODE(path.stat().st_mode) == 0o604
    assert listing(tmp_path) == ["out.json"]


def test_synth_keeps_a_file_that_appeared_unless_forced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from snapmla_cli.cache import dump_file

    out = tmp_path / "d.st"
    real = dump_file.save_file

    def save_then_collide(*args, **kwargs):
        real(*args, **kwargs)
        out.write_text("another run's output")  # after every check, while the temp is written

    monkeypatch.setattr(dump_file, "save_file", save_then_collide)
    result = invoke("synth", "-o", out, *SYNTH)
    assert_one_line_error(result, "--output", str(out), "appeared", "--force")
    assert out.read_text() == "another run's output" and listing(tmp_path) == ["d.st"]
    out.unlink()
    result = invoke("synth", "-o", out, *SYNTH, "--force")
    assert result.exit_code == 0, result.output
    assert out.stat().st_size > 100 and listing(tmp_path) == ["d.st"]


def test_quantize_keeps_a_cache_file_that_appeared_unless_forced(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The FP8 cache output, like synth's dump: a file another run put there after the checks
    is kept without --force, replaced with it. The move lands after the --output block, at the
    end of the command's output group; the error still names the option."""
    from snapmla_cli.cache import fp8_file

    out = tmp_path / "c.st"
    real = fp8_file.save_file

    def save_then_collide(*args, **kwargs):
        real(*args, **kwargs)
        if not out.exists():
            out.write_text("another run's output")

    monkeypatch.setattr(fp8_file, "save_file", save_then_collide)
    quantize = ("quantize", "-o", out, "--configs", "snap", "--layers", "1", "--tokens", "64")
    result = invoke(*quantize)
    assert_one_line_error(result, f"--output: {out}", "appeared", "--force")
    assert out.read_text() == "another run's output" and listing(tmp_path) == ["c.st"]
    result = invoke(*quantize, "--force")
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] != b"another " and listing(tmp_path) == ["c.st"]


def test_quantize_json_that_appeared_stops_every_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from snapmla_cli.cli import quantize

    report = tmp_path / "r.json"
    real = quantize.analyze_layer

    def analyze_then_collide(*args, **kwargs):
        if not report.exists():
            report.write_text("theirs")
        return real(*args, **kwargs)

    monkeypatch.setattr(quantize, "analyze_layer", analyze_then_collide)
    result = invoke("quantize", "-o", tmp_path / "c.st", "--json", report, "--configs", "snap",
                    "--layers", "1", "--tokens", "128")
    assert_one_line_error(result, "--json", str(report), "appeared")
    assert report.read_text() == "theirs" and listing(tmp_path) == ["r.json"]


# --- outputs committed together whose moves fail part way ----------------------------------


def three_outputs(folder: Path) -> list[Path]:
    """a and c exist (a with its own mode), b is new."""
    a, b, c = folder / "a.txt", folder / "b.txt", folder / "c.txt"
    a.write_text("old a")
    a.chmod(0o640)
    c.write_text("old c")
    return [a, b, c]


@pytest.mark.parametrize("failing", [0, 1, 2])
def test_a_failed_move_undoes_the_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: int) -> None:
    outputs = three_outputs(tmp_path)
    before = snapshot(tmp_path)
    monkeypatch.setattr(atomic.os, "replace", fail_once(os.replace, outputs[failing],
                                                        OSError(errno.EIO, "Input/output error")))
    with pytest.raises(OutputWriteError) as caught, committed_together():
        for path in outputs:
            write_text_atomic(path, f"new {path.stem}", replace=True)
    assert_one_line(str(caught.value), f"could not write {outputs[failing]}", "Input/output error")
    assert snapshot(tmp_path) == before  # same names, contents, modes and inodes


def test_a_failed_no_clobber_link_undoes_the_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b, c = three_outputs(tmp_path)
    c.unlink()  # c is new too, written without --force
    before = snapshot(tmp_path)
    monkeypatch.setattr(atomic.os, "link", fail_once(os.link, c, OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(OutputWriteError) as caught, committed_together():
        write_text_atomic(a, "new a", replace=True)
        write_text_atomic(b, "new b", replace=False)
        write_text_atomic(c, "new c", replace=False)
    assert_one_line(str(caught.value), str(c), "No space left")
    assert snapshot(tmp_path) == before


def test_a_file_that_appears_before_the_group_lands_undoes_it(tmp_path: Path) -> None:
    a, b, c = three_outputs(tmp_path)
    c.unlink()
    with pytest.raises(OutputWriteError) as caught, committed_together():
        write_text_atomic(a, "new a", replace=True)
        write_text_atomic(b, "new b", replace=False)
        write_text_atomic(c, "new c", replace=False)
        c.write_text("theirs")  # after the checks and the writes, before the moves
    assert_one_line(str(caught.value), str(c), "appeared", "--force")
    assert a.read_text() == "old a" and c.read_text() == "theirs"
    assert listing(tmp_path) == ["a.txt", "c.txt"]


def test_a_group_that_lands_leaves_no_backup(tmp_path: Path, umask_022: None) -> None:
    a, b, c = three_outputs(tmp_path)
    with committed_together():
        for path in (a, b, c):
            write_text_atomic(path, f"new {path.stem}", replace=path.exists())
    assert [p.read_text() for p in (a, b, c)] == ["new a", "new b", "new c"]
    assert stat.S_IMODE(a.stat().st_mode) == 0o640 and stat.S_IMODE(b.stat().st_mode) == 0o644
    assert listing(tmp_path) == ["a.txt", "b.txt", "c.txt"]


# --- Ctrl-C --------------------------------------------------------------------------------


def test_interrupt_inside_the_group_leaves_nothing(tmp_path: Path) -> None:
    outputs = three_outputs(tmp_path)
    before = snapshot(tmp_path)
    with pytest.raises(KeyboardInterrupt), committed_together():
        write_text_atomic(outputs[0], "new a", replace=True)
        write_text_atomic(outputs[1], "new b", replace=False)
        raise KeyboardInterrupt
    assert snapshot(tmp_path) == before


def test_interrupt_while_landing_undoes_the_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    outputs = three_outputs(tmp_path)
    before = snapshot(tmp_path)
    monkeypatch.setattr(atomic.os, "replace", fail_once(os.replace, outputs[2], KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt), committed_together():
        for path in outputs:
            write_text_atomic(path, f"new {path.stem}", replace=True)
    assert snapshot(tmp_path) == before


def test_interrupt_after_a_move_landed_undoes_that_move_too(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C right after the last move was made (the file is in place, the call not yet
    returned): that output is restored as well, not only the ones before it."""
    outputs = three_outputs(tmp_path)
    before = snapshot(tmp_path)
    real = os.replace
    state = {"interrupted": False}

    def land_then_interrupt(src: object, dst: object) -> None:
        real(src, dst)
        if Path(dst) == outputs[2] and not state["interrupted"]:  # c's move, not its undo
            state["interrupted"] = True
            raise KeyboardInterrupt

    monkeypatch.setattr(atomic.os, "replace", land_then_interrupt)
    with pytest.raises(KeyboardInterrupt), committed_together():
        for path in outputs:
            write_text_atomic(path, f"new {path.stem}", replace=True)
    assert snapshot(tmp_path) == before


def test_a_backup_that_cannot_be_restored_is_kept_and_named(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The group replaced a, then c's move fails; renaming a's backup back fails too: the backup,
    now the only copy of the old a, stays on disk and the error says where."""
    a, _, c = three_outputs(tmp_path)
    real = os.replace
    calls: dict[Path, int] = {}

    def flaky(src: object, dst: object) -> None:
        calls[Path(dst)] = calls.get(Path(dst), 0) + 1
        if (Path(dst), calls[Path(dst)]) in ((c, 1), (a, 2)):  # c's move, then a's undo
            raise OSError(errno.EIO, "Input/output error")
        real(src, dst)

    monkeypatch.setattr(atomic.os, "replace", flaky)
    with pytest.raises(OutputWriteError) as caught, committed_together():
        write_text_atomic(a, "new a", replace=True)
        write_text_atomic(c, "new c", replace=True)
    message = str(caught.value)
    assert f"{a} could not be restored (Input/output error); its previous content is in " in message
    backup = Path(message.rsplit("its previous content is in ", 1)[1].split(";")[0])
    assert backup.parent == tmp_path and backup.read_text() == "old a"
    assert a.read_text() == "new a" and c.read_text() == "old c"


def test_an_output_that_appeared_is_an_eexist_error(tmp_path: Path) -> None:
    path = tmp_path / "out.json"
    with pytest.raises(OutputWriteError) as caught:
        write_atomic(path, colliding("ours", lambda: path.write_text("theirs")), replace=False)
    assert caught.value.errno == errno.EEXIST and isinstance(caught.value, OSError)
    assert path.read_text() == "theirs"


# --- filesystems without hard links --------------------------------------------------------
# Two kinds: with renameat2's flags (FAT, exFAT, most FUSE on Linux: atomic no-clobber moves and
# swaps) and without them (other systems, filesystems that reject the flags: the fallbacks).

needs_renameat2 = pytest.mark.skipif(rename_flags._libc_renameat2() is None,
                                     reason="needs Linux renameat2 (glibc 2.28+)")


@pytest.fixture(params=["renameat2", "no renameat2"])
def without_hard_links(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """os.link fails as on FAT; the second kind also has no renameat2 flags."""
    monkeypatch.setattr(atomic.os, "link", no_hard_links)
    if request.param == "renameat2":
        if rename_flags._libc_renameat2() is None:
            pytest.skip("needs Linux renameat2 (glibc 2.28+)")
    else:
        monkeypatch.setattr(atomic, "rename_noreplace", lambda src, dst: False)
        monkeypatch.setattr(atomic, "exchange", lambda a, b: False)
    return str(request.param)


def test_without_hard_links_new_files_are_written_and_existing_ones_refused(
        tmp_path: Path, without_hard_links: str) -> None:
    path = tmp_path / "out.json"
    write_text_atomic(path, "first", replace=False)
    assert path.read_text() == "first" and listing(tmp_path) == ["out.json"]
    other = tmp_path / "other.json"

    meanwhile = colliding("ours", lambda: other.write_text("theirs"))
    with pytest.raises(OutputWriteError, match="appeared"):
        write_atomic(other, meanwhile, replace=False)
    assert other.read_text() == "theirs" and listing(tmp_path) == ["other.json", "out.json"]


def test_without_hard_links_a_dangling_symlink_that_appears_is_kept(tmp_path: Path,
                                                                   without_hard_links: str) -> None:
    path = tmp_path / "out.json"
    meanwhile = colliding("ours", lambda: path.symlink_to("elsewhere.json"))
    with pytest.raises(OutputWriteError, match="appeared"):
        write_atomic(path, meanwhile, replace=False)
    assert path.is_symlink() and os.readlink(path) == "elsewhere.json"
    assert listing(tmp_path) == ["out.json"]


@needs_renameat2
def test_without_hard_links_no_clobber_has_no_window(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file created after every existence check (lexists told to see nothing, as if it came a
    microsecond later) is still kept: the move itself refuses to clobber."""
    monkeypatch.setattr(atomic.os, "link", no_hard_links)
    monkeypatch.setattr(atomic.os.path, "lexists", lambda path: False)
    path = tmp_path / "out.json"

    meanwhile = colliding("ours", lambda: path.write_text("theirs"))
    with pytest.raises(OutputWriteError, match="appeared"):
        write_atomic(path, meanwhile, replace=False)
    assert path.read_text() == "theirs" and listing(tmp_path) == ["out.json"]


def test_without_hard_links_a_group_still_lands(tmp_path: Path, without_hard_links: str) -> None:
    a, b, _ = three_outputs(tmp_path)
    before = snapshot(tmp_path)
    with committed_together():
        write_text_atomic(a, "new a", replace=True)
        write_text_atomic(b, "new b", replace=False)
    assert a.read_text() == "new a" and b.read_text() == "new b"
    assert listing(tmp_path) == ["a.txt", "b.txt", "c.txt"]
    assert stat.S_IMODE(a.stat().st_mode) == before["a.txt"][1]  # a replaced file keeps its mode


def test_without_hard_links_a_failed_group_restores_what_it_can(tmp_path: Path, without_hard_links: str) -> None:
    """The group replaces c, then finds a file at d: with renameat2 c comes back (the same
    inode: the swap kept the old file under the temp name); without it c was already replaced,
    and the error says so."""
    _, _, c = three_outputs(tmp_path)
    d = tmp_path / "d.txt"
    before = snapshot(tmp_path)
    with pytest.raises(OutputWriteError) as caught, committed_together():
        write_text_atomic(c, "new c", replace=True)
        write_text_atomic(d, "new d", replace=False)
        d.write_text("theirs")  # after the checks and the writes, before the moves
    message = str(caught.value)
    assert_one_line(message, str(d), "appeared")
    assert d.read_text() == "theirs"
    if without_hard_links == "renameat2":
        assert snapshot(tmp_path) == {**before, "d.txt": snapshot(tmp_path)["d.txt"]}
        assert "already replaced" not in message
    else:
        assert c.read_text() == "new c" and f"{c} was already replaced" in message
    assert listing(tmp_path) == ["a.txt", "c.txt", "d.txt"]


@needs_renameat2
def test_rename_flags_refuse_to_clobber_and_swap(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("A")
    b.write_text("B")
    with pytest.raises(FileExistsError):
        rename_flags.rename_noreplace(a, b)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(FileExistsError):
        rename_flags.rename_noreplace(a, dangling)
    assert rename_flags.exchange(a, b) and a.read_text() == "B" and b.read_text() == "A"
    assert rename_flags.rename_noreplace(a, tmp_path / "c") and not a.exists()
    with pytest.raises(FileNotFoundError):
        rename_flags.exchange(a, b)  # a is gone: a swap needs both names


@pytest.mark.parametrize("code", [errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP])
def test_renameat2_that_cannot_do_a_flag_is_a_fallback_not_an_error(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    code: int) -> None:
    """A kernel or filesystem without the flag answers ENOSYS / EINVAL / EOPNOTSUPP: False (the
    caller falls back), nothing moved; any other failure is raised as the OSError it is."""
    import ctypes

    def refusing(answer: int) -> Callable[..., int]:
        def fake(*args: object) -> int:
            ctypes.set_errno(answer)
            return -1
        return fake

    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("A")
    monkeypatch.setattr(rename_flags, "_libc_renameat2", lambda: refusing(code))
    assert rename_flags.rename_noreplace(a, b) is False
    assert rename_flags.exchange(a, b) is False
    monkeypatch.setattr(rename_flags, "_libc_renameat2", lambda: refusing(errno.EACCES))
    with pytest.raises(PermissionError):
        rename_flags.rename_noreplace(a, b)
    assert listing(tmp_path) == ["a"]


# --- an empty output path ------------------------------------------------------------------


@pytest.mark.parametrize(("option", "args"), [
    ("--output", ("synth", "-o", "", *SYNTH)),
    ("--output", ("synth", "--output=", *SYNTH)),
    ("--output", ("quantize", "-o", "")),
    ("--json", ("quantize", "-o", "c.st", "--json", "")),
    ("--plot", ("quantize", "-o", "c.st", "--plot", "")),
    ("--json", ("verify", "--json", "")),
    ("--plot", ("bench", "--cpu-fake", "--plot", "")),
    ("--json", ("bench", "--cpu-fake", "--json", "")),
    ("--output", ("dump", "--model", "m", "--prompts", "p.txt", "-o", "")),
])
def test_an_empty_output_path_is_named_as_typed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                option: str, args: tuple[str, ...]) -> None:
    monkeypatch.chdir(tmp_path)
    result = invoke(*args)
    assert_one_line_error(result, f"{option}: expected a file path, got ''")
    assert listing(tmp_path) == []


def test_an_empty_database_folder_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = invoke("tune", "--dry-run", "--db-dir", "")
    assert_one_line_error(result, "--db-dir: expected a folder path, got ''")


def test_the_new_contents_reach_the_disk_before_the_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rename is durable only after the data it points to: the temp file is fsynced with its
    full contents, while the target still holds the old ones."""
    target = tmp_path / "out.txt"
    target.write_text("old")
    synced: list[tuple[str, bytes, str]] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        synced.append((path.name, path.read_bytes(), target.read_text()))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    write_text_atomic(target, "new contents")
    assert target.read_text() == "new contents"
    assert any(name != "out.txt" and data == b"new contents" and before == "old" for name, data, before in synced), synced


def test_the_undo_never_removes_a_file_another_writer_put_there(tmp_path, monkeypatch):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    real_land = atomic._land

    def land(entry):
        if entry.target == b:  # a landed; meanwhile another process replaced it, then b fails
            other = tmp_path / "theirs.tmp"
            other.write_text("theirs")
            os.replace(other, a)
            raise OSError(errno.ENOSPC, "No space left on device")
        real_land(entry)

    monkeypatch.setattr(atomic, "_land", land)
    with pytest.raises(atomic.OutputWriteError, match="No space left"), atomic.committed_together():
        atomic.write_text_atomic(a, "ours", replace=False)
        atomic.write_text_atomic(b, "ours", replace=False)
    assert a.read_text() == "theirs"  # not ours to undo
    assert not b.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]  # no temp file left
