"""Output files: checked before any work, written atomically (temp file in the target's folder,
fsync, rename), never clobbered without force, never replacing anything but a regular file.

Every command with outputs goes through these helpers, so that all of them refuse the same paths
with the same one-line errors: :func:`check_writable` per output path, :func:`check_distinct`
for outputs that would overwrite each other or an input, :func:`write_atomic` to write (with
``replace=force``, so that a file appearing while the command works is not replaced either),
:func:`committed_together` for outputs that land all or none, and :func:`naming` to say which
option a late write failure belongs to.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

from ..errors import SnapmlaError
from .rename_flags import exchange, rename_noreplace

# (what the user called it, e.g. "--json" or "DUMP"; the path, None when the option was not given)
NamedPath = tuple[str, Path | None]

# errno values of os.link meaning "no hard links here" (FAT, some network and FUSE filesystems,
# a file system's link-count limit): the no-clobber move and the backups fall back, see their docs
_NO_HARD_LINKS = frozenset(getattr(errno, name) for name in
                           ("EPERM", "EOPNOTSUPP", "ENOTSUP", "EXDEV", "EMLINK", "ENOSYS")
                           if hasattr(errno, name))


@dataclass
class _Landing:
    """A written, synced temp file on its way to ``target`` (``path`` as the user gave it)."""

    tmp: Path
    target: Path
    path: Path
    replace: bool
    backup: Path | None = None  # a hard link to the file it replaces, until the group is done
    inode: tuple[int, int] | None = None  # (st_dev, st_ino) of what lands: undo removes only that
    existed: bool = False  # something was at ``target`` before the move
    keep_backup: bool = False  # a backup that could not be renamed back: the only copy left
    swap: bool = False  # no hard link for a backup: land by an atomic swap, the old file the backup
    option: str | None = None  # the option that named ``path`` (:func:`naming`), for a late error


# The moves that wait for the end of a :func:`committed_together` block (None: outside one).
_PENDING: ContextVar[list[_Landing] | None] = ContextVar("snapmla_pending_outputs", default=None)
# The option of the :func:`naming` block a write runs in: a group's moves land after that block.
_OPTION: ContextVar[str | None] = ContextVar("snapmla_output_option", default=None)

_DEFAULT_NAME_MAX = 255  # bytes in a file name on Linux filesystems, where pathconf cannot tell
_KINDS = ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "fifo"), (stat.S_ISSOCK, "socket"),
          (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"))


class OutputWriteError(SnapmlaError, OSError):
    """Writing an output failed (full disk, I/O error, a writer's own exception).

    A SnapmlaError, so every command reports it as one line; also an OSError, so callers that
    treat an unwritable cache folder as "skip it" (kernel cache, tuning database) still do."""


def check_writable(path: Path, force: bool, what: str = "output") -> None:
    """Refuse, before any work, an output that cannot or may not be written: no file name, an
    existing file (or dangling symlink) without ``force``, anything that is not a regular file
    even with ``force`` (replacing a device or fifo by a file breaks the system, not the output),
    or a folder that is missing or not writable. Symlinks are followed: the file they point to
    is what gets written."""
    path = Path(path)
    if path.name in ("", ".", ".."):
        raise SnapmlaError(f"{what}: expected a file path, got {str(path)!r}")
    target = final_target(path)
    kind = _existing_kind(path, what)
    _refuse_special(kind, path, what)
    if kind == "file":
        _refuse_standard_stream(path, what)
    dangling = kind is None and os.path.islink(path)
    if dangling and not force:
        raise SnapmlaError(f"{what} {path} exists (a dangling symlink to {target}); "
                           "pass --force to write there")
    if kind == "file" and not force:
        raise SnapmlaError(f"{what} {path} exists; pass --force to overwrite it")
    _check_folder(path, target, what)


_STREAMS = ((1, "standard output"), (2, "standard error"))


def _refuse_standard_stream(path: Path, what: str) -> None:
    """Refuse an output that is the very file this process's stdout or stderr writes to
    (``-o /dev/stdout > file``, or the output named again in the shell's redirection): an atomic
    write replaces it by rename, so the stream would go on into the old, unlinked file and
    whatever the command prints there would be lost (and the shell has truncated it anyway)."""
    try:
        info = os.stat(path)
    except OSError:
        return
    for fd, name in _STREAMS:
        try:
            stream = os.fstat(fd)
        except OSError:  # (closed, or not a file descriptor here)
            continue
        if (stream.st_dev, stream.st_ino) == (info.st_dev, info.st_ino):
            raise SnapmlaError(f"{what} {path} is the file this command's {name} goes to (written "
                               f"atomically it would be replaced, cutting the stream off); give another "
                               f"path{_stdout_hint(what)}")


def _stdout_hint(what: str) -> str:
    """Where a stream was named as ``--json``: the way to get the report there."""
    return "; `--json -` prints the report on standard output" if what == "--json" else ""


def check_distinct(outputs: Sequence[NamedPath], inputs: Sequence[NamedPath] = ()) -> None:
    """Refuse two outputs naming the same file (the second write would silently replace the
    first), and an output that is an input or lies in an input folder (it would destroy what
    is being read). Paths are compared resolved, and by inode where both exist (hard links)."""
    given_outputs = [(what, Path(p)) for what, p in outputs if p is not None]
    given_inputs = [(what, Path(p)) for what, p in inputs if p is not None]
    for i, (what, path) in enumerate(given_outputs):
        for other, other_path in given_outputs[i + 1:] + given_inputs:
            if _same_file(path, other_path):
                raise SnapmlaError(f"{what} and {other} name the same file ({path}); "
                                   "expected different files")
    for what, path in given_outputs:
        for other, folder in given_inputs:
            if _replaces_inside(path, folder):
                raise SnapmlaError(f"{what} {path} would replace a file inside {other} {folder}; "
                                   "expected a path outside it")


def check_outputs(outputs: Sequence[NamedPath], force: bool, inputs: Sequence[NamedPath] = ()) -> None:
    """A command's output paths, before any work: distinct from each other and from its inputs
    (:func:`check_distinct`), each writable (:func:`check_writable`). An output that is no
    regular file (a folder, a fifo) is named as such first: ``dump --model m -o m`` was told that
    two options named the same file, of a folder."""
    for what, path in outputs:
        if path is not None:
            _refuse_special(_existing_kind(path, what), path, what)
    check_distinct(outputs, inputs)
    for what, path in outputs:
        if path is not None:
            check_writable(path, force, what)


def write_atomic(path: Path, write: Callable[[Path], object], *, replace: bool = True) -> None:
    """Call ``write(tmp_path)`` and move the result onto ``path`` only when it succeeded.

    ``replace=False`` (a user's output without ``--force``) never clobbers: :func:`check_writable`
    ran before the work, which can take minutes, so a file that appeared at ``path`` meanwhile
    (another run, another user) must not be silently replaced. The final step is then
    ``os.link`` (atomic, fails if anything is at ``path``, a dangling symlink included) and the
    temp name is removed; on a filesystem without hard links it is a ``renameat2`` with
    ``RENAME_NOREPLACE`` (just as atomic), and only where that flag is missing too an existence
    check followed by ``os.replace``, which leaves a window of a few microseconds in which a
    file created by someone else would be replaced. ``replace=True`` (``--force``, the kernel cache, the tuning
    database) replaces whatever regular file is there.

    A symlink is written through when replacing (its target replaced, the link kept). A new
    file gets the permission bits ``open()`` would give it (0666 less the umask); a replaced
    file keeps its own. Any failure of the write (OSError, a writer's own exception such as
    safetensors' ``SafetensorError`` on a full disk) becomes one :class:`OutputWriteError`
    naming ``path``, never the temp file; the temp file is removed in every case, Ctrl-C
    included."""
    path = Path(path)
    target = final_target(path)
    kind = _existing_kind(path, "output")
    _refuse_special(kind, path, "output")
    if not replace and os.path.lexists(path):
        raise _appeared(path)
    keep_mode = stat.S_IMODE(os.stat(target).st_mode) if kind == "file" else None
    tmp: Path | None = None
    try:
        while True:  # (named before it exists: a signal between its creation and the assignment left it)
            tmp = _temp_path(target)
            if _created(tmp):
                break
            tmp = None  # (another writer's)
        mode = keep_mode if keep_mode is not None else stat.S_IMODE(os.stat(tmp).st_mode)
        write(tmp)
        os.chmod(tmp, mode)  # also when the writer replaced the temp file by one of its own
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        landing = _Landing(tmp, target, path, replace, option=_OPTION.get())
        pending = _PENDING.get()
        if pending is None:
            _land(landing)
        else:
            pending.append(landing)  # lands with the others at the end of the group
        tmp = None
    except SnapmlaError:
        raise
    except Exception as exc:
        raise _write_error(path, tmp, exc) from exc
    finally:
        if tmp is not None:
            with suppress(OSError):
                tmp.unlink()


@contextmanager
def committed_together() -> Iterator[None]:
    """The outputs written inside land together when the block ends, or none of them does.

    Each :func:`write_atomic` inside writes and syncs its temp file; the moves onto the final
    names wait for the end. If anything fails inside (a late ``--plot`` on a full disk), none
    of them lands and their temp files are removed, so a command with several outputs never
    leaves some written and others not.

    The moves themselves can fail part way (a full inode table, a file that appeared at a
    no-clobber output): before the first move every file about to be replaced is hard-linked to
    a hidden backup name in its folder; if a move fails, the ones already made are undone in
    reverse order (the backup renamed back, a new file removed) and one error names the output
    that failed. On a filesystem without hard links a file to be replaced is instead swapped
    with its temp file in one ``renameat2(RENAME_EXCHANGE)``, after which the temp name holds the
    old file as the backup; only where that flag is missing too does an entry get no backup, and
    a file it replaced cannot be brought back (the error says so). Temp and backup files are
    removed in every case, Ctrl-C included; the one exception is a backup that could not be
    renamed back, which is kept and named in the error since it holds the only copy."""
    pending: list[_Landing] = []
    token = _PENDING.set(pending)
    try:
        yield
        _land_all(pending)
    finally:
        _PENDING.reset(token)
        for entry in pending:
            _discard(entry)


def write_text_atomic(path: Path, text: str, *, replace: bool = True) -> None:
    """:func:`write_atomic` of a text file."""
    write_atomic(path, lambda tmp: tmp.write_text(text), replace=replace)


@contextmanager
def naming(what: str) -> Iterator[None]:
    """Prefix a write failure with the option whose file it was (``--plot: ...``): the writers
    know the path, only the command knows which of its options named it. A write inside a
    :func:`committed_together` group keeps the name for its move at the end of the group."""
    token = _OPTION.set(what)
    try:
        yield
    except SnapmlaError as exc:
        _name_error(exc, what)
        raise
    finally:
        _OPTION.reset(token)


def _name_error(exc: BaseException, what: str | None) -> None:
    """``exc``'s message prefixed with ``what`` (same exception: type, errno, cause), once."""
    if what is not None and not str(exc).startswith(what):
        exc.args = (f"{what}: {exc}",)


def _appeared(path: Path) -> OutputWriteError:
    """The no-clobber move found a file (or symlink) at ``path``: it was not there when the
    command checked its outputs."""
    error = OutputWriteError(f"{path} appeared while snapmla was working; "
                             "pass --force to overwrite it")
    error.errno = errno.EEXIST
    return error


def _land(entry: _Landing) -> None:
    """Move ``entry``'s temp file onto its target: ``os.replace`` (a group's entry without a
    hard-link backup: an atomic swap, the temp name then the backup), or with ``replace=False``
    a hard link that fails if anything is there, then the temp name removed. Without hard
    links: ``renameat2(RENAME_NOREPLACE)``, and where that is missing too an existence check,
    then ``os.replace`` (the residual window of :func:`write_atomic`)."""
    if entry.replace:
        if entry.swap:
            entry.backup = entry.tmp  # first: once swapped, the temp name holds the old file
            if exchange(entry.tmp, entry.target):
                return
            entry.backup = None
        os.replace(entry.tmp, entry.target)
        return
    try:
        os.link(entry.tmp, entry.target)
    except FileExistsError:
        raise _appeared(entry.path) from None
    except OSError as exc:
        if exc.errno not in _NO_HARD_LINKS:
            raise
        _land_without_links(entry)
        return
    with suppress(FileNotFoundError):
        entry.tmp.unlink()


def _land_without_links(entry: _Landing) -> None:
    """The no-clobber move where ``os.link`` is unsupported."""
    try:
        if rename_noreplace(entry.tmp, entry.target):
            return
    except FileExistsError:
        raise _appeared(entry.path) from None
    if os.path.lexists(entry.target):
        raise _appeared(entry.path) from None
    os.replace(entry.tmp, entry.target)


def _land_all(pending: list[_Landing]) -> None:
    """Every move of a :func:`committed_together` group, or none: backups first, then the
    moves; a failure undoes the moves made and raises one error naming the failing output."""
    for entry in pending:
        _prepare(entry)
    landed: list[_Landing] = []
    for entry in pending:
        try:
            _land(entry)
        except BaseException as exc:
            if _is_inode(entry.target, entry.inode):  # it landed, then Ctrl-C came
                landed.append(entry)
            lost = _undo(landed)
            if isinstance(exc, SnapmlaError):
                if lost:
                    exc.args = (f"{exc}; {lost}",)
                _name_error(exc, entry.option)
                raise
            if not isinstance(exc, Exception):  # Ctrl-C: undone, and still an interrupt
                raise
            error = _write_error(entry.path, entry.tmp, exc)
            if lost:
                error.args = (f"{error}; {lost}",)
            _name_error(error, entry.option)
            raise error from exc
        landed.append(entry)
    for entry in pending:
        _drop_backup(entry)


def _prepare(entry: _Landing) -> None:
    """Before any move of the group: what lands (to undo a new file, and only that file) and a
    backup link to the regular file it replaces (without hard-link support: a swap at landing
    time, see :func:`_land`)."""
    try:
        info = os.stat(entry.tmp)
        entry.inode = (info.st_dev, info.st_ino)
        entry.existed = os.path.lexists(entry.target)
        if entry.replace and entry.existed and stat.S_ISREG(os.lstat(entry.target).st_mode):
            entry.backup = _link_backup(entry.target)
            entry.swap = entry.backup is None
    except OSError as exc:  # nothing has moved yet: the caller removes the temp files
        raise _write_error(entry.path, entry.tmp, exc) from exc


def _link_backup(target: Path) -> Path | None:
    """A hidden hard link to ``target`` next to it, or None where hard links are unsupported."""
    while True:
        backup = _temp_path(target)
        try:
            os.link(target, backup)
        except FileExistsError:
            continue
        except OSError as exc:
            if exc.errno in _NO_HARD_LINKS:
                return None
            raise
        return backup


def _undo(landed: list[_Landing]) -> str:
    """Undo the moves made, last first: a replaced file renamed back from its backup, a new
    file removed (only if it is still the one that landed). Returns what could not be undone
    ("" when everything was), for the error."""
    problems = []
    for entry in reversed(landed):
        try:
            if entry.backup is not None:
                os.replace(entry.backup, entry.target)
                entry.backup = None
            elif not entry.existed and _is_inode(entry.target, entry.inode):
                entry.target.unlink()
            elif entry.existed:
                problems.append(f"{entry.path} was already replaced (no hard links for a backup)")
        except OSError as exc:
            if entry.backup is not None:
                entry.keep_backup = True
                problems.append(f"{entry.path} could not be restored ({exc.strerror}); "
                                f"its previous content is in {entry.backup}")
            else:
                problems.append(f"{entry.path} could not be removed ({exc.strerror})")
    return "; ".join(problems)


def _is_inode(path: Path, inode: tuple[int, int] | None) -> bool:
    """Whether ``path`` is (still) the file ``inode`` names, not one put there by someone else."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return inode == (info.st_dev, info.st_ino)


def _drop_backup(entry: _Landing) -> None:
    if entry.backup is not None and not entry.keep_backup:
        with suppress(OSError):
            entry.backup.unlink()
        entry.backup = None


def _discard(entry: _Landing) -> None:
    """After a group, successful or not: its temp file (gone already if it landed by rename;
    the backup itself if it landed by a swap) and its backup (unless it is the only copy left)."""
    if entry.tmp != entry.backup:
        with suppress(OSError):
            entry.tmp.unlink()
    _drop_backup(entry)


def final_target(path: Path) -> Path:
    """The file a write to ``path`` lands in: the end of a symlink chain (which may not exist
    yet), else ``path`` itself (unresolved, so messages show what the user typed)."""
    return Path(os.path.realpath(path)) if os.path.islink(path) else path


def _existing_kind(path: Path, what: str) -> str | None:
    """None if nothing is at ``path`` (or its symlinks' end), "file" for a regular file, else
    what it is. ``path`` itself is stat()ed, not :func:`final_target`'s text: a /proc link
    (``/dev/stdout`` into a pipe) points at ``pipe:[N]``, a name that exists nowhere, so the
    resolved path would call the pipe a dangling symlink and --force would try to write there."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:  # a symlink loop, a folder we may not search: an OSError too, so
        # that a cache skipping unwritable folders (OutputWriteError's callers) skips this one
        raise OutputWriteError(f"{what} {path}: cannot check it: {exc.strerror}") from None
    kind = file_kind(mode)
    if kind == "fifo" and os.path.islink(path) and not os.path.lexists(final_target(path)):
        return "pipe"  # an anonymous pipe behind a /proc fd link, e.g. /dev/stdout of `| cat`
    return kind


def file_kind(mode: int) -> str:
    """What an ``os.stat`` mode is: "file" for a regular file, else "directory", "fifo",
    "socket", "character device", "block device" or "special file"."""
    if stat.S_ISREG(mode):
        return "file"
    return next((name for test, name in _KINDS if test(mode)), "special file")


def _refuse_special(kind: str | None, path: Path, what: str) -> None:
    """Only a regular file may be replaced, --force or not: a directory is a wrong path, and a
    device, fifo or socket replaced by a file breaks whatever uses it."""
    if kind == "directory":
        raise SnapmlaError(f"{what} {path} is a directory, expected a file path")
    if kind not in (None, "file"):
        raise SnapmlaError(f"{what} {path} is a {kind}, not a regular file; "
                           f"not replacing it, even with --force{_stdout_hint(what)}")


def _check_folder(path: Path, target: Path, what: str) -> None:
    """The folder the file lands in must exist and take a new file (the temp file)."""
    folder = target.parent
    via = f" (symlink to {target})" if target != path else ""
    if not folder.exists():
        raise SnapmlaError(f"{what} {path}{via}: folder {folder} does not exist")
    if not folder.is_dir():
        raise SnapmlaError(f"{what} {path}{via}: {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise SnapmlaError(f"{what} {path}{via}: folder {folder} is not writable")


def _same_file(a: Path, b: Path) -> bool:
    """Whether writing ``a`` would change ``b``: same inode when both exist, else the same
    resolved path (an output not written yet)."""
    with suppress(OSError):
        if os.path.exists(a) and os.path.exists(b):
            return os.path.samefile(a, b)
    return os.path.realpath(a) == os.path.realpath(b)


def _replaces_inside(output: Path, folder: Path) -> bool:
    """Whether ``output`` is an existing file somewhere under the input folder ``folder``."""
    if not (folder.is_dir() and os.path.lexists(output)):
        return False
    return Path(os.path.realpath(output)).is_relative_to(os.path.realpath(folder))


def _temp_path(target: Path) -> Path:
    """A fresh hidden name for a temp file or backup next to ``target``."""
    return hidden_sibling(target, f".{secrets.token_hex(4)}.tmp")


def hidden_sibling(target: Path, suffix: str) -> Path:
    """``.NAME`` + ``suffix`` next to ``target``, NAME cut (in bytes) so that the whole stays
    within the folder's limit on a name: an output name of 243-255 bytes is legal, and its temp
    name had been too long, so that the command failed only after all its work."""
    try:
        limit = os.pathconf(target.parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = _DEFAULT_NAME_MAX
    tail = os.fsencode(suffix)
    name = os.fsencode(target.name)[:max(1, limit - 1 - len(tail))]
    return target.parent / os.fsdecode(b"." + name + tail)


def _created(tmp: Path) -> bool:
    """Whether a new empty file ``tmp`` was made (False: the name is taken). Created with
    ``os.open(..., 0o666)`` rather than ``mkstemp`` (always 0600) so that the kernel applies the
    umask (and default ACLs)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    try:
        os.close(os.open(tmp, flags, 0o666))
    except FileExistsError:
        return False
    return True


def _write_error(path: Path, tmp: Path | None, exc: Exception) -> OutputWriteError:
    """One line naming the user's ``path`` and the cause, with the temp path kept out of it."""
    if isinstance(exc, OSError) and exc.strerror:
        cause = exc.strerror
    else:
        cause = " ".join(str(exc).split()) or type(exc).__name__
        if tmp is not None:
            cause = cause.replace(str(tmp), str(path))
    error = OutputWriteError(f"could not write {path}: {cause}")
    error.errno = getattr(exc, "errno", None)
    return error
