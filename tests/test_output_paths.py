"""Output paths of every command (``cache.atomic``): what may be replaced (regular files only, with
--force), symlinks (written through, dangling ones count as existing), outputs that collide with
each other or an input, write failures (one line naming the user's path, no temp file left) and
the permission bits of new and replaced files. CPU only; never touches /dev."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_checks import SYNTH, assert_one_line_error, invoke, umask
from safetensors import SafetensorError

from snapmla_cli.cache.atomic import (
    OutputWriteError,
    check_distinct,
    check_writable,
    committed_together,
    naming,
    write_atomic,
    write_text_atomic,
)
from snapmla_cli.errors import SnapmlaError


@pytest.fixture(scope="module")
def dump(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("in") / "d.st"
    result = invoke("synth", "-o", path, *SYNTH)
    assert result.exit_code == 0, result.output
    return path


@pytest.fixture
def umask_027() -> Iterator[None]:
    with umask(0o027):
        yield


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# --- what is at the output path -------------------------------------------------------------


def test_fifo_is_refused_even_with_force(tmp_path: Path) -> None:
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    for extra in ((), ("--force",)):
        assert_one_line_error(invoke("synth", "-o", fifo, *SYNTH, *extra), "--output", "fifo", "not a regular file")
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    with pytest.raises(SnapmlaError, match="fifo"):  # the writer refuses on its own too
        write_text_atomic(fifo, "x")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and listing(tmp_path) == ["f"]


def test_directory_is_refused_at_once(tmp_path: Path) -> None:
    folder = tmp_path / "d"
    folder.mkdir()
    for extra in ((), ("--force",)):
        result = invoke("synth", "-o", folder, *SYNTH, *extra)
        assert_one_line_error(result, "--output", "is a directory, expected a file path")
        assert "--force" not in result.stderr
    assert listing(folder) == []


def test_paths_without_a_file_name_and_under_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert_one_line_error(invoke("synth", "-o", "", *SYNTH), "--output: expected a file path, got ''")
    afile = tmp_path / "afile"
    afile.write_text("x")
    result = invoke("synth", "-o", afile / "x", *SYNTH)
    assert_one_line_error(result, "--output", "afile", "is not a folder")
    assert ".tmp" not in result.stderr and listing(tmp_path) == ["afile"]
    with pytest.raises(SnapmlaError, match="does not exist"):
        check_writable(tmp_path / "no" / "x.st", force=True, what="--output")


# every output option of every command: pathlib drops the trailing slash of "out/"
FOLDER_NAMED_OUTPUTS = [
    ("synth", "-o", "{out}", *SYNTH),
    ("quantize", "{dump}", "-o", "{out}"),
    ("quantize", "{dump}", "-o", "{tmp}/c.st", "--json", "{out}"),
    ("quantize", "{dump}", "-o", "{tmp}/c.st", "--plot", "{out}"),
    ("verify", "--json", "{out}"),
    ("info", "--json", "{out}"),
    ("bench", "--cpu-fake", "--json", "{out}"),
    ("bench", "--cpu-fake", "--plot", "{out}"),
    ("dump", "--model", "{tmp}", "--prompts", "{dump}", "-o", "{out}"),
]


@pytest.mark.parametrize("args", FOLDER_NAMED_OUTPUTS, ids=lambda args: f"{args[0]} {args[args.index('{out}') - 1]}")
@pytest.mark.parametrize("tail", ["/", "/."])
def test_an_output_path_naming_a_folder_is_refused_as_typed(args: tuple[str, ...], tail: str, dump: Path,
                                                            tmp_path: Path) -> None:
    """``-o new/`` (or ``new/.``) named a folder; pathlib dropped the slash and a file ``new`` was
    written (``x.st/ --force`` replaced the file x.st). Refused before any work, showing the
    path as typed, with or without --force."""
    existing = tmp_path / "x.st"
    existing.write_bytes(b"keep me")
    for name in ("new", "x.st"):
        out = f"{tmp_path / name}{tail}"
        typed = [a.format(out=out, dump=dump, tmp=tmp_path) for a in args]
        for extra in ((), ("--force",)):
            result = invoke(*typed, *extra)
            assert_one_line_error(result, f"{out}: expected a file path, not a folder")
    assert existing.read_bytes() == b"keep me" and listing(tmp_path) == ["x.st"]


@pytest.mark.parametrize("args", [("verify", "--dump", "{path}"), ("quantize", "{path}", "-o", "{tmp}/c.st"),
                                  ("dump", "--model", "{tmp}", "--prompts", "{path}", "-o", "{tmp}/c.st")],
                         ids=["verify --dump", "quantize DUMP", "dump --prompts"])
def test_an_input_file_named_with_a_trailing_slash_is_not_a_directory(args: tuple[str, ...], dump: Path,
                                                                      tmp_path: Path) -> None:
    """``--dump d.safetensors/`` read the file: the OS says "Not a directory" for such a path,
    and so does snapmla, naming the option and the path as typed."""
    typed = [a.format(path=f"{dump}/", tmp=tmp_path) for a in args]
    assert_one_line_error(invoke(*typed), f"{dump}/: not a directory")
    assert listing(tmp_path) == []


def test_a_folder_that_takes_no_new_file_is_refused_up_front(tmp_path: Path, denied_paths: set[Path]) -> None:
    """The temp file lands next to the output, so a read-only folder is refused before any work.
    The permission answer is stubbed: a chmod stops no one when the tests run as root."""
    folder = tmp_path / "ro"
    folder.mkdir()
    denied_paths.add(folder)
    with pytest.raises(SnapmlaError, match=f"--output {folder / 'x.st'}: folder {folder} is not writable"):
        check_writable(folder / "x.st", force=True, what="--output")
    check_writable(tmp_path / "x.st", force=False, what="--output")  # a writable folder next to it


def test_a_path_ending_in_dot_dot_is_no_file_name(tmp_path: Path) -> None:
    """``x/..`` names a folder, not a file: refused as having no file name, also where ``x`` does
    not exist (there the folder check would only say that ``x`` is missing)."""
    for path in (tmp_path / "missing" / "..", tmp_path / ".."):
        with pytest.raises(SnapmlaError, match=r"--output: expected a file path, got '.*\.\.'"):
            check_writable(path, force=True, what="--output")


def test_a_socket_is_refused_even_with_force(tmp_path: Path) -> None:
    """Not only fifos: any special file (a socket here; devices alike) is never replaced."""
    import socket

    path = tmp_path / "s"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
        for force in (False, True):
            with pytest.raises(SnapmlaError, match="is a socket, not a regular file"):
                check_writable(path, force=force, what="--output")
        assert stat.S_ISSOCK(os.lstat(path).st_mode)


def test_the_file_standard_output_goes_to_is_refused_as_an_output(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``--json /dev/stdout --force > report.json`` (or the output named again in the shell's
    redirection): the atomic write would replace the file by rename and cut the stream off from
    it. A file opened as the stream stands in for fd 1: refused by name, also through a
    symlink, with the `--json -` hint for --json; another file is fine."""
    from snapmla_cli.cache import atomic

    report = tmp_path / "report.json"
    report.write_text("{}")
    stream = os.open(report, os.O_WRONLY)
    try:
        monkeypatch.setattr(atomic, "_STREAMS", ((stream, "standard output"),))
        link = tmp_path / "stdout"
        link.symlink_to(report)
        for path in (report, link):
            with pytest.raises(SnapmlaError, match=f"^--json {path} is the file this command's standard output "
                                                   r"goes to .*; `--json -` prints the report on standard output$"):
                atomic.check_writable(path, True, "--json")
        with pytest.raises(SnapmlaError, match=r"^--output .* goes to .*give another path$"):
            atomic.check_writable(report, True, "--output")
        other = tmp_path / "other.json"
        other.write_text("{}")
        atomic.check_writable(other, True, "--json")
    finally:
        os.close(stream)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc's fd links")
def test_a_pipe_behind_a_proc_fd_link_is_refused_up_front(tmp_path: Path) -> None:
    """``--json /dev/stdout | cat``: /dev/stdout leads through /proc/self/fd/1 to ``pipe:[N]``, a
    name that exists nowhere. The resolved path called it a dangling symlink, and with --force
    the command did all its work, then failed to write. A link to this process's own pipe
    stands in for /dev/stdout: refused as a pipe before any work, --force or not."""
    read_end, write_end = os.pipe()
    try:
        link = tmp_path / "stdout"
        link.symlink_to(f"/proc/self/fd/{write_end}")
        for extra in ((), ("--force",)):
            for args in (("synth", "-o", link, *SYNTH), ("info", "--json", link)):
                result = invoke(*args, *extra)
                assert_one_line_error(result, f"{link} is a pipe, not a regular file; "
                                              "not replacing it, even with --force")
                assert "dangling" not in result.stderr and result.stdout == ""
        assert link.is_symlink() and listing(tmp_path) == ["stdout"]
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_symlink_into_a_missing_folder_names_its_target(tmp_path: Path) -> None:
    link = tmp_path / "out.st"
    link.symlink_to("missing-folder/x.st")
    with pytest.raises(SnapmlaError) as caught:
        check_writable(link, force=True, what="--output")
    message = str(caught.value)
    assert f"--output {link} (symlink to {tmp_path / 'missing-folder' / 'x.st'})" in message
    assert "does not exist" in message


def test_plot_formats_are_matched_whatever_their_case() -> None:
    from snapmla_cli.plot_files import check_plot_output, check_plot_path

    for name in ("f.png", "f.PNG", "f.Pdf", "f.svg"):
        check_plot_path(Path(name))
    assert check_plot_output(Path("f.SVG")).__name__ == "matplotlib.pyplot"
    for name in ("f.txt", "f", "f.png.bak"):
        with pytest.raises(SnapmlaError, match=f"--plot {name}: expected a .png, .pdf, .svg file"):
            check_plot_path(Path(name))


def test_symlink_to_a_file_is_written_through(tmp_path: Path) -> None:
    target, link = tmp_path / "target.json", tmp_path / "link.json"
    target.write_text("old")
    target.chmod(0o640)
    link.symlink_to(target.name)
    with pytest.raises(SnapmlaError, match="exists; pass --force"):
        check_writable(link, force=False)
    check_writable(link, force=True)
    write_text_atomic(link, "new")
    assert link.is_symlink() and os.readlink(link) == "target.json"
    assert target.read_text() == "new" and stat.S_IMODE(target.stat().st_mode) == 0o640
    assert listing(tmp_path) == ["link.json", "target.json"]


def test_dangling_symlink_counts_as_existing(tmp_path: Path) -> None:
    link = tmp_path / "out.st"
    link.symlink_to("elsewhere.st")
    result = invoke("synth", "-o", link, *SYNTH)
    assert_one_line_error(result, "--output", "dangling symlink", "--force")
    assert not (tmp_path / "elsewhere.st").exists()
    result = invoke("synth", "-o", link, *SYNTH, "--force")
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and (tmp_path / "elsewhere.st").stat().st_size > 0
    nowhere = tmp_path / "nowhere.st"
    nowhere.symlink_to("missing-folder/x.st")
    assert_one_line_error(invoke("synth", "-o", nowhere, *SYNTH, "--force"), "--output", "missing-folder", "does not exist")


# --- outputs that collide ------------------------------------------------------------------


def test_quantize_outputs_must_differ_from_each_other_and_the_input(dump: Path, tmp_path: Path) -> None:
    before = dump.read_bytes()
    q = tmp_path / "q.png"
    cases = [
        (("-o", q, "--json", q), ("--output", "--json", "same file")),
        (("-o", q, "--plot", q), ("--output", "--plot", "same file")),
        (("-o", tmp_path / "c.st", "--json", q, "--plot", tmp_path / "sub" / ".." / "q.png"), ("--json", "--plot")),
        (("-o", dump, "--force"), ("--output", "DUMP", "same file")),
        (("-o", tmp_path / "c.st", "--json", dump, "--force"), ("--json", "DUMP")),
    ]
    (tmp_path / "sub").mkdir()
    for args, needles in cases:
        assert_one_line_error(invoke("quantize", dump, *args, "--configs", "snap"), *needles)
    assert dump.read_bytes() == before and listing(tmp_path) == ["sub"]


def test_verify_json_must_not_replace_its_dump(dump: Path, tmp_path: Path) -> None:
    before = dump.read_bytes()
    link = tmp_path / "link.st"
    link.symlink_to(dump)
    for path in (dump, link):
        result = invoke("verify", "--dump", dump, "--json", path, "--force", "--ctx", "64", "--heads", "1", "--mtp", "1")
        assert_one_line_error(result, "--json and --dump name the same file")
    assert dump.read_bytes() == before


def test_hard_links_and_symlinks_are_the_same_file(tmp_path: Path) -> None:
    a = tmp_path / "a"
    a.write_text("x")
    os.link(a, tmp_path / "hard")
    (tmp_path / "soft").symlink_to("a")
    for other in ("hard", "soft"):
        with pytest.raises(SnapmlaError, match="--json and --plot name the same file"):
            check_distinct([("--json", a), ("--plot", tmp_path / other)])
    check_distinct([("--json", a), ("--plot", None), ("--output", tmp_path / "b")], [("DUMP", None)])


def test_a_new_output_inside_an_input_folder_is_allowed(tmp_path: Path) -> None:
    """Only an existing file of an input folder is protected: a new file written into it (a dump
    next to the checkpoint's files) replaces nothing."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    check_distinct([("--output", model / "new.st")], [("--model", model)])
    with pytest.raises(SnapmlaError, match="would replace a file inside --model"):
        check_distinct([("--output", model / "config.json")], [("--model", model)])


def test_bench_json_and_plot_must_differ(tmp_path: Path) -> None:
    same = tmp_path / "x.png"
    assert_one_line_error(invoke("bench", "--cpu-fake", "--json", same, "--plot", same), "--json", "--plot", "same file")
    assert listing(tmp_path) == []


def test_dump_output_must_not_replace_its_inputs(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    weights = model / "model.safetensors"
    weights.write_bytes(b"weights")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n")
    result = invoke("dump", "--model", model, "--prompts", prompts, "-o", prompts, "--force")
    assert_one_line_error(result, "--output", "--prompts", "same file")
    result = invoke("dump", "--model", model, "--prompts", prompts, "-o", weights, "--force")
    assert_one_line_error(result, "--output", "--model")
    # the model folder itself: a folder, not "the same file" as --model
    result = invoke("dump", "--model", model, "--prompts", prompts, "-o", model, "--force")
    assert_one_line_error(result, f"--output {model} is a directory, expected a file path")
    assert prompts.read_text() == "hello\n" and weights.read_bytes() == b"weights"


# --- write failures ------------------------------------------------------------------------


@pytest.mark.parametrize("failure", [
    SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
    OSError(errno.ENOSPC, "No space left on device"),
])
def test_full_disk_is_one_error_naming_the_path(tmp_path: Path, failure: Exception) -> None:
    path = tmp_path / "out.st"
    path.write_text("previous")

    def half_then_fail(tmp: Path) -> None:
        tmp.write_text("half")
        if isinstance(failure, OSError):
            failure.filename = str(tmp)  # what open()/write() report: the temp path
        raise failure

    with pytest.raises(OutputWriteError) as caught:
        write_atomic(path, half_then_fail)
    message = str(caught.value)
    assert str(path) in message and "No space left on device" in message
    assert ".tmp" not in message and "\n" not in message
    assert isinstance(caught.value, OSError)  # callers that skip an unwritable folder still do
    assert path.read_text() == "previous" and listing(tmp_path) == ["out.st"]


def test_a_writer_error_naming_the_temp_file_names_the_output(tmp_path: Path) -> None:
    """A writer's own exception (not an OSError) that quotes the temp path it was given is
    reported with the user's path in its place."""
    path = tmp_path / "out.st"

    def fail(tmp: Path) -> None:
        raise ValueError(f"cannot serialize into {tmp}")

    with pytest.raises(OutputWriteError) as caught:
        write_atomic(path, fail)
    assert str(caught.value) == f"could not write {path}: cannot serialize into {path}"
    assert listing(tmp_path) == []


def test_interrupt_is_not_swallowed_and_leaves_no_temp(tmp_path: Path) -> None:
    def interrupted(tmp: Path) -> None:
        tmp.write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomic(tmp_path / "out", interrupted)
    assert listing(tmp_path) == []


def test_full_disk_through_the_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(*args: object, **kwargs: object) -> None:
        raise SafetensorError("Error while serializing: No space left on device (os error 28)")

    monkeypatch.setattr("snapmla_cli.cache.dump_file.save_file", full)
    out = tmp_path / "d.st"
    assert_one_line_error(invoke("synth", "-o", out, *SYNTH), "--output", str(out), "No space left")
    assert listing(tmp_path) == []


def test_a_late_plot_failure_names_plot(dump: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from matplotlib.figure import Figure

    def full(self: Figure, fname: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(fname))

    monkeypatch.setattr(Figure, "savefig", full)
    plot = tmp_path / "p.png"
    result = invoke("quantize", dump, "-o", tmp_path / "c.st", "--plot", plot, "--configs", "snap")
    assert_one_line_error(result, "error: --plot:", str(plot), "No space left on device")
    assert ".tmp" not in result.stderr and "p.png" not in listing(tmp_path)
    # the outputs land together: the cache and the JSON written before the plot did not land
    assert "c.st" not in listing(tmp_path) and not any(name.endswith(".tmp") for name in listing(tmp_path))
    result = invoke("quantize", dump, "-o", tmp_path / "c.st", "--json", tmp_path / "r.json", "--plot", plot,
                    "--configs", "snap")
    assert result.exit_code == 2 and {"c.st", "r.json"}.isdisjoint(listing(tmp_path)), listing(tmp_path)


def test_outputs_written_together_land_only_at_the_end(tmp_path: Path) -> None:
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    b.write_text("old")
    with committed_together():
        write_text_atomic(a, "A")
        write_text_atomic(b, "B")
        assert not a.exists() and b.read_text() == "old"
    assert a.read_text() == "A" and b.read_text() == "B"
    with pytest.raises(RuntimeError), committed_together():
        write_text_atomic(a, "A2")
        raise RuntimeError("late failure")
    assert a.read_text() == "A" and sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt"]


def test_naming_prefixes_once() -> None:
    with pytest.raises(SnapmlaError, match="^--plot: could not write x$"), naming("--plot"):
        raise SnapmlaError("could not write x")
    with pytest.raises(SnapmlaError, match="^--plot needs matplotlib$"), naming("--plot"):
        raise SnapmlaError("--plot needs matplotlib")


# --- permission bits -----------------------------------------------------------------------


def test_new_files_follow_the_umask(tmp_path: Path, umask_027: None) -> None:
    path = tmp_path / "new.json"
    write_text_atomic(path, "{}")
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    result = invoke("synth", "-o", tmp_path / "d.st", *SYNTH)
    assert result.exit_code == 0, result.output
    assert stat.S_IMODE((tmp_path / "d.st").stat().st_mode) == 0o640


def test_replaced_files_keep_their_mode(tmp_path: Path, umask_027: None) -> None:
    path = tmp_path / "d.st"
    path.write_text("old")
    path.chmod(0o604)
    result = invoke("synth", "-o", path, *SYNTH, "--force")
    assert result.exit_code == 0, result.output
    assert stat.S_IMODE(path.stat().st_mode) == 0o604 and path.stat().st_size > 3


def test_verify_refuses_an_existing_json_before_any_case_runs(dump: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --force an existing --json is refused up front: not after minutes of cases, when
    the late check would only say the file appeared while snapmla was working."""
    from snapmla_cli.cli import verify as verify_cli

    existing = tmp_path / "report.json"
    existing.write_text("mine")
    monkeypatch.setattr(verify_cli, "run_case", lambda *a, **k: pytest.fail("a case ran"))
    result = invoke("verify", "--dump", dump, "--json", existing, "--ctx", "64", "--heads", "1", "--mtp", "1")
    assert_one_line_error(result, f"--json {existing} exists; pass --force to overwrite it")
    assert "PASS" not in result.stdout and existing.read_text() == "mine"


# --- `--json -`: standard output --------------------------------------------------------------


JSON_TO_STDOUT = [
    ("info", "--json", "-"),
    ("verify", "--ctx", "256", "--heads", "2", "--mtp", "1", "--json", "-"),
    ("quantize", "{dump}", "-o", "{tmp}/c.st", "--configs", "snap", "--json", "-"),
    ("bench", "--cpu-fake", "--ctx", "1k", "--quiet", "--json", "-"),
]


@pytest.mark.parametrize("args", JSON_TO_STDOUT, ids=lambda args: args[0])
def test_json_dash_prints_the_document_alone_on_stdout(args: tuple[str, ...], dump: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`--json -` is the JSON document on stdout and nothing else there (the tables go to stderr),
    no file named `-` is written, and a file `-` already there needs no --force and is kept."""
    import json

    monkeypatch.chdir(tmp_path)
    Path("-").write_text("keep me")
    result = invoke(*(a.format(dump=dump, tmp=tmp_path) for a in args))
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)  # the whole of stdout is one document
    assert isinstance(document, dict) and document
    assert Path("-").read_text() == "keep me"
    assert "wrote -" not in result.stderr and result.stderr.strip(), "the report goes to stderr"


@pytest.mark.parametrize("args", JSON_TO_STDOUT, ids=lambda args: args[0])
def test_every_json_report_names_its_layout_and_what_produced_it(args: tuple[str, ...], dump: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Every report opens alike: its own format name, the layout's version, the package's version
    and the kernel sources' hash (the tuning database's stamp), so an archived report says which
    kernels it judged; unreadable kernel sources give a null hash, not a failed command."""
    import json

    from snapmla_cli import __version__
    from snapmla_cli.runtime import nvrtc

    command = args[0]
    result = invoke(*(a.format(dump=dump, tmp=tmp_path) for a in args))
    assert result.exit_code == 0, result.output
    header = {k: json.loads(result.stdout)[k] for k in ("format", "version", "snapmla_version", "kernel_sources")}
    assert header == {"format": f"snapmla-{command}", "version": "1", "snapmla_version": __version__,
                      "kernel_sources": nvrtc.kernel_sources_stamp()[0]}
    assert header["kernel_sources"] is not None and len(header["kernel_sources"]) == 16
    from snapmla_cli.cli import info

    for module in (nvrtc, info):  # info reads the stamp once for its lines and its JSON
        monkeypatch.setattr(module, "kernel_sources_stamp", lambda: (None, "kernel sources: no folder"))
    again = invoke(*(a.format(dump=dump, tmp=tmp_path) for a in args), "--force")
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["kernel_sources"] is None


def test_json_dash_holds_what_the_file_would(dump: Path, tmp_path: Path) -> None:
    import json

    report = tmp_path / "r.json"
    args = ("verify", "--ctx", "256", "--heads", "2", "--mtp", "1", "--json")
    to_file, to_stdout = invoke(*args, report), invoke(*args, "-")
    assert to_file.exit_code == to_stdout.exit_code == 0
    assert "cases pass" in to_file.stdout and "cases pass" in to_stdout.stderr
    assert "cases pass" not in to_stdout.stdout
    seconds = ("seconds",)

    def timeless(value: object) -> object:
        if isinstance(value, dict):
            return {k: timeless(v) for k, v in value.items() if k not in seconds}
        return [timeless(v) for v in value] if isinstance(value, list) else value

    assert timeless(json.loads(to_stdout.stdout)) == timeless(json.loads(report.read_text()))


def test_json_dot_slash_dash_is_a_file_named_dash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only `-` as typed means standard output: `./-` is the file, refused without --force. The
    messages name it by its full path: pathlib shortens `./-` to `-`, and "wrote -" or "--json -
    exists" would read as standard output."""
    import json

    monkeypatch.chdir(tmp_path)
    result = invoke("info", "--json", "./-")
    assert result.exit_code == 0, result.output
    assert json.loads(Path("-").read_text())["format"] == "snapmla-info"
    assert f"wrote {tmp_path / '-'}" in result.stdout
    assert_one_line_error(invoke("info", "--json", "./-"), f"--json {tmp_path / '-'} exists", "--force")
    assert_one_line_error(invoke("synth", "-o", "./-", *SYNTH), f"--output {tmp_path / '-'} exists")


@pytest.mark.parametrize("args", [
    ("synth", "-o", "-", *SYNTH),
    ("quantize", "-o", "-"),
    ("quantize", "-o", "{tmp}/c.st", "--plot", "-"),
    ("bench", "--cpu-fake", "--plot", "-"),
    ("dump", "--model", "{tmp}", "--prompts", "{tmp}/p.txt", "-o", "-"),
    ("tune", "--dry-run", "--db-dir", "-"),
], ids=lambda args: f"{args[0]} {args[args.index('-') - 1]}")
def test_dash_is_refused_for_outputs_other_than_json(args: tuple[str, ...], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A safetensors file, an image or a database folder on stdout is garbage; a file named `-`
    is not what was meant either: one line naming the option, and nothing written."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.txt").write_text("hello\n")
    option = {"-o": "--output"}.get(args[args.index("-") - 1], args[args.index("-") - 1])
    assert_one_line_error(invoke(*(a.format(tmp=tmp_path) for a in args)),
                          f"{option} -: '-' (standard output) is only supported for --json")
    assert listing(tmp_path) == ["p.txt"]


def test_json_dash_prints_nothing_when_a_late_output_fails(dump: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The document is printed after the files landed: a failed --plot leaves stdout empty, as it
    leaves no --json file."""
    from matplotlib.figure import Figure

    def full(self: Figure, fname: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(fname))

    monkeypatch.setattr(Figure, "savefig", full)
    result = invoke("quantize", dump, "-o", tmp_path / "c.st", "--plot", tmp_path / "p.png", "--configs", "snap",
                    "--json", "-")
    assert_one_line_error(result, "error: --plot:", "No space left on device")
    assert result.stdout == "" and listing(tmp_path) == []
