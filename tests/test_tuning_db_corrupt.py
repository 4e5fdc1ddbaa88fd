"""A corrupt tuning database or database folder is a named warning or a one-line error, never a
traceback: malformed numbers (YAML infinities, NaN, bools, overflowing integers) skip their
entry alone, a deeply nested file is one bad file, a symlink loop or a file given as the folder
is named with where it came from (``$SNAPMLA_TUNING_DIR`` or ``--db-dir``), and ``snapmla tune``
without a GPU points at ``--dry-run``. CPU only and fast."""

from __future__ import annotations

import copy
import re
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from cli_checks import assert_one_line_error, invoke

from snapmla_cli.errors import SnapmlaError
from snapmla_cli.ops.decode_config import heuristic_config
from snapmla_cli.tuning import db as tdb
from snapmla_cli.tuning import describe_database, lookup
from snapmla_cli.tuning.db import DbError, Entry, GpuKey, find_entry, load_file, save_entries
from snapmla_cli.tuning.space import Bucket

GPU = GpuKey("Test GPU X100", 132, (9, 0), 13)
BAD = Bucket(64, 2, (64, 64), (16384, 16384), "fp8")  # the entry the tests corrupt
GOOD = Bucket(64, 2, (64, 64), (65536, 65536), "fp8")  # its neighbour, which must survive
DB_NAME = "Test_GPU_X100.yaml"


@pytest.fixture(autouse=True)
def isolated_db(isolated_tuning_dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
                ) -> tuple[Path, Path]:
    """User and shipped folders under tmp_path; the lookup believes CUDA device 0 is GPU."""
    monkeypatch.setattr(lookup, "_device_key_hook", lambda index: GPU)
    return isolated_tuning_dirs


def make_entry(bucket: Bucket) -> Entry:
    return Entry(bucket=bucket, config=heuristic_config(bucket.rows), time_us=100.0,
                 default_time_us=120.0, date="2026-12-01", snapmla_version="0.1.0",
                 command="snapmla tune", default_config=heuristic_config(bucket.rows),
                 kernels="abc123", timed_at={"batch": 64, "context": bucket.context[0]},
                 candidates=7)


def write_db(folder: Path, mutate: Callable[[dict[str, Any]], None]) -> Path:
    """A database with the BAD and GOOD entries, ``mutate`` applied to BAD's mapping, written
    back by PyYAML (so ``inf`` is stored as ``.inf``, as a hand edit would write it)."""
    path, _ = save_entries(folder, GPU, [make_entry(BAD), make_entry(GOOD)])
    data = yaml.safe_load(path.read_text())
    entries = data["devices"][0]["entries"]
    index = next(i for i, e in enumerate(entries) if e["bucket"]["context"] == list(BAD.context))
    mutate(entries[index])
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def cuda0() -> torch.device:
    return torch.device("cuda", 0)  # never touched: the device key comes from the hook


def setter(*keys: Any, value: Any) -> Callable[[dict[str, Any]], None]:
    """A mutation that sets ``entry[keys[0]][keys[1]]... = value``."""
    def mutate(entry: dict[str, Any]) -> None:
        target = entry
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value
    return mutate


# (label, mutation, what the warning must name)
MALFORMED = [
    ("candidates .inf", setter("candidates", value=float("inf")), "candidates"),
    ("candidates -.inf", setter("candidates", value=float("-inf")), "candidates"),
    ("candidates .nan", setter("candidates", value=float("nan")), "candidates"),
    ("candidates true", setter("candidates", value=True), "candidates"),
    ("candidates 1.5", setter("candidates", value=1.5), "candidates"),
    ("candidates 10**30", setter("candidates", value=10**30), "candidates"),
    ("candidates -1", setter("candidates", value=-1), "candidates"),
    ("timed_at .inf", setter("timed_at", value={"batch": float("inf")}), "timed_at.batch"),
    ("timed_at true", setter("timed_at", "context", value=True), "timed_at.context"),
    ("timed_at list", setter("timed_at", value=[64]), "timed_at"),
    ("time_us 10**400", setter("time_us", value=10**400), "time_us"),
    ("default_time_us .inf", setter("default_time_us", value=float("inf")), "default_time_us"),
    ("h_q .inf", setter("bucket", "h_q", value=float("inf")), "bucket.h_q"),
    ("h_q 10**30", setter("bucket", "h_q", value=10**30), "bucket.h_q"),
    ("context .inf", setter("bucket", "context", value=[1, float("inf")]), "bucket.context"),
    ("batch true", setter("bucket", "batch", value=[True, True]), "bucket.batch"),
    ("stages .inf", setter("config", "stages", value=float("inf")), "config: stages"),
    ("block_n 0", setter("config", "block_n", value=0), "config: block_n"),
    ("batch backwards", setter("bucket", "batch", value=[128, 16]), "bucket.batch"),
    ("time_us 0", setter("time_us", value=0), "time_us"),
    ("row_groups 10**30", setter("config", "row_groups", value=10**30), "config: row_groups"),
    ("qk_promote 1.0", setter("config", "qk_promote", value=1.0), "config: qk_promote"),
    ("split waves .nan", setter("config", "split", "waves", value=float("nan")), "config: waves"),
    ("default stages .inf", setter("default_config", "stages", value=float("inf")),
     "default_config: stages"),
    ("format fp16", setter("bucket", "format", value="fp16"), "bucket: format 'fp16' is not fp8 or bf16"),
    # a structure in a text field: str() of it could recurse thousands deep or expand an alias bomb
    ("command list", setter("command", value=[["snapmla"]]), "command: expected text, got a list"),
    ("date mapping", setter("date", value={"y": 2026}), "date: expected text, got a dict"),
    ("kernels list", setter("kernels", value=["abc"]), "kernels: expected text"),
    # a bucket dimension of a newer snapmla would widen the bucket if it were ignored
    ("bucket dimension", setter("bucket", "page_size", value=64), "bucket: unknown dimension(s) page_size"),
]


@pytest.mark.parametrize("label,mutate,field", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_a_malformed_number_skips_its_entry_alone(isolated_db, label, mutate, field):
    user, _ = isolated_db
    path = write_db(user, mutate)
    loaded = load_file(path)  # no OverflowError: one problem, the neighbour kept
    assert [e.bucket for s in loaded.sections for e in s.entries] == [GOOD]
    assert len(loaded.problems) == 1 and "entries[0]" in loaded.problems[0], loaded.problems
    assert field in loaded.problems[0], loaded.problems
    with pytest.warns(RuntimeWarning) as record:
        assert lookup.lookup_decode_config(rows=128, fp8=True, device=cuda0(), context=65536) \
            == heuristic_config(128)  # the file still answers from its good entry
    messages = [str(w.message) for w in record if "tuning" in str(w.message)]
    assert len(messages) == 1 and str(path) in messages[0] and "skipped 1 bad entry" in messages[0]
    assert field in messages[0] and "\n" not in messages[0]
    # what `snapmla tune` does with the file: no traceback, the good entry is found
    assert find_entry(user, GPU, GOOD) == make_entry(GOOD)
    assert find_entry(user, GPU, BAD) is None


INT_FIELDS = [("candidates",), ("timed_at", "batch"), ("bucket", "s_q"), ("config", "stages"),
              ("config", "split", "ctas_per_sm")]


@pytest.mark.parametrize("keys", INT_FIELDS, ids=[".".join(k) for k in INT_FIELDS])
@pytest.mark.parametrize("value", [float("inf"), float("nan"), True, 2.0, 10**30, 2**31, "7"])
def test_int_fields_raise_the_database_error(keys, value):
    """Every reader raises DbError (the type the loader skips on), never OverflowError, naming
    the field and the value read."""
    data = make_entry(BAD).as_dict()
    setter(*keys, value=value)(data)
    with pytest.raises(DbError, match=f"{keys[-1]}:? (?:must be|expected) an integer in [01]\\.\\.2147483647, "
                                      f"got {re.escape(repr(value))}$"):
        Entry.from_dict(data)


@pytest.mark.parametrize("value", [float("inf"), float("nan"), True, 9.0, 10**30, "9"])
def test_gpu_key_fields_raise_the_database_error(value):
    for field, bad in (("compute_capability", [9, value]), ("compute_capability", [value, 0]),
                       ("sm_count", value), ("cuda_driver_major", value)):
        with pytest.raises(DbError, match=field):
            GpuKey.from_dict({**GPU.as_dict(), field: bad})


def test_an_entry_within_the_bounds_still_loads():
    """The strict readers accept what `snapmla tune` writes, and the largest int32 context."""
    data = make_entry(BAD).as_dict()
    data["bucket"]["context"] = [1, 2**31 - 1]
    del data["candidates"], data["timed_at"]  # missing: 0 and none, as before
    entry = Entry.from_dict(data)
    assert entry.bucket.context == (1, 2**31 - 1) and entry.candidates == 0 and entry.timed_at == {}
    assert Entry.from_dict(make_entry(GOOD).as_dict()) == make_entry(GOOD)


def test_tune_does_not_drop_a_malformed_entry_without_force(isolated_db):
    """Rewriting the file would lose the entry this version cannot read: refused, one line
    naming the file and the entry; --force drops it."""
    user, _ = isolated_db
    path = write_db(user, setter("candidates", value=float("inf")))
    before = path.read_text()
    with pytest.raises(SnapmlaError, match=r"not overwriting") as info:
        save_entries(user, GPU, [make_entry(GOOD)])
    assert str(path) in str(info.value) and "entries[0]: candidates" in str(info.value)
    assert path.read_text() == before
    save_entries(user, GPU, [make_entry(GOOD)], force=True)
    assert [e.bucket for e in load_file(path).sections[0].entries] == [GOOD]


@pytest.fixture
def default_recursion_limit():
    """Python's default recursion limit for the test: mypy, which tests/test_typing.py runs in
    this process, raises it to 16,384, and then 5,000 nested brackets parse without error."""
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    yield
    sys.setrecursionlimit(before)


@pytest.mark.usefixtures("default_recursion_limit")
def test_deeply_nested_yaml_is_one_bad_file(isolated_db):
    user, shipped = isolated_db
    path = user / DB_NAME
    path.write_text("format: snapmla-tuning\nversion: 1\ndevices: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(DbError, match="nested too deeply"):
        tdb.parse_text(path.read_text(), path)
    assert find_entry(user, GPU, BAD) is None
    with pytest.raises(SnapmlaError, match="not overwriting"):
        save_entries(user, GPU, [make_entry(BAD)])
    save_entries(shipped, GPU, [make_entry(BAD)])
    with pytest.warns(RuntimeWarning) as record:
        cfg = lookup.lookup_decode_config(rows=128, fp8=True, device=cuda0())
    messages = [str(w.message) for w in record if "tuning" in str(w.message)]
    assert len(messages) == 1 and str(path) in messages[0] and "nested too deeply" in messages[0]
    assert cfg == heuristic_config(128)  # the shipped entry answers
    assert any(f"tuning file {path}: " in line and "nested too deeply" in line
               for line in describe_database([]))


@pytest.mark.usefixtures("default_recursion_limit")
@pytest.mark.parametrize("depth", [20_000, 60_000])
def test_nesting_past_libyamls_reach_is_one_bad_file_not_a_crash(isolated_db, depth):
    """libyaml's loader has no depth guard (60,000 nested brackets crash the process), so such
    text goes to the Python loader, whose RecursionError is the one-line error: were the guard
    wrong, this test would take pytest down with it."""
    user, _ = isolated_db
    path = user / DB_NAME
    text = "format: snapmla-tuning\nversion: 1\ndevices: " + "[" * depth + "]" * depth + "\n"
    assert tdb.yaml_loader(text) is yaml.SafeLoader
    with pytest.raises(DbError, match="nested too deeply"):
        tdb.parse_text(text, path)


def test_the_shipped_databases_parse_and_dump_alike_with_libyaml():
    """The shipped files take the fast loader where PyYAML has libyaml, it reads them exactly as
    the Python loader does (entries, problems and all), and the fast dumper writes them back
    byte for byte as the Python dumper would."""
    files = sorted((Path(__file__).resolve().parents[1] / "tuning_db").glob("*.yaml"))  # (tests isolate shipped_dir)
    assert files
    for path in files:
        text = path.read_text(encoding="utf-8")
        if getattr(yaml, "CSafeLoader", None) is not None:
            assert tdb.yaml_loader(text) is yaml.CSafeLoader
        assert yaml.load(text, Loader=tdb.yaml_loader(text)) == yaml.load(text, Loader=yaml.SafeLoader)
        loaded = tdb.load_file(path)
        # written back unchanged, and the Python dumper would write the same text
        assert tdb.dump_text(loaded.sections) == text
        data = yaml.load(text, Loader=yaml.SafeLoader)
        assert text.endswith(yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=100))


def test_aliased_sections_and_entries_are_read_once(isolated_db):
    """12 KB whose aliases listed one entry 1,000 times in 300 sections took 15 s and 670 MB to
    read (``snapmla info``, a process's first decode call). A repeated object is now skipped as
    the duplicate it is, after one look; aliases elsewhere (a shared config) still load."""
    user, _ = isolated_db
    loaded = yaml.safe_load(tdb.dump_text([tdb.DeviceSection(GPU, [make_entry(BAD)])]))["devices"][0]
    entries = [loaded["entries"][0]] * 1_000  # (PyYAML's own dumper writes a shared object as &id / *id)
    devices = [{"gpu": loaded["gpu"], "entries": entries} for _ in range(301)]
    path = user / DB_NAME
    path.write_text(yaml.safe_dump({"format": "snapmla-tuning", "version": 1, "devices": devices}))
    assert path.stat().st_size < 30_000
    started = time.perf_counter()
    parsed = load_file(path)
    assert time.perf_counter() - started < 5  # (300,000 entries to check before)
    assert [e.bucket for s in parsed.sections for e in s.entries] == [BAD]
    assert len(parsed.problems) == 999 + 300
    assert parsed.problems[0] == "devices[0].entries[1]: the same YAML object as devices[0].entries[0] (an alias), skipped"
    assert parsed.problems[-1] == "devices[300]: the same YAML object as devices[0].entries (an alias), skipped"
    other = copy.deepcopy(loaded["entries"][0])
    other["bucket"]["h_q"] = 128
    other["config"] = loaded["entries"][0]["config"]  # one config for two entries: an alias, and fine
    text = yaml.safe_dump({"format": "snapmla-tuning", "version": 1,
                           "devices": [{"gpu": loaded["gpu"], "entries": [loaded["entries"][0], other]}]})
    assert "*id" in text
    parsed = tdb.parse_text(text, path)
    assert parsed.problems == [] and [e.bucket.h_q for e in parsed.sections[0].entries] == [64, 128]


def test_the_writer_never_writes_an_alias():
    """One object listed twice (an entry kept in two sections) is written out twice, not as an
    anchor the reader would refuse."""
    shared = make_entry(BAD)
    other = replace(GPU, cuda_driver_major=(GPU.cuda_driver_major or 0) + 1)
    text = tdb.dump_text([tdb.DeviceSection(GPU, [shared]), tdb.DeviceSection(other, [shared])])
    assert "&id" not in text and "*id" not in text
    assert len(tdb.parse_text(text, Path("x.yaml")).sections) == 2


def test_an_integer_past_pythons_digit_limit_is_one_bad_file(isolated_db):
    user, _ = isolated_db
    path = user / DB_NAME
    path.write_text("format: snapmla-tuning\nversion: 1\ndevices: []\nx: " + "1" * 5000 + "\n")
    with pytest.raises(DbError, match="not valid YAML"):
        load_file(path)


# ---------------------------------------------------------------------------------------------
# the folders


@pytest.fixture
def loop(tmp_path: Path) -> Path:
    """A symlink loop: a -> b -> a."""
    a, b = tmp_path / "loop_a", tmp_path / "loop_b"
    a.symlink_to(b)
    b.symlink_to(a)
    return a


def test_a_symlink_loop_as_the_folder_is_a_named_note(isolated_db, loop, monkeypatch):
    _, shipped = isolated_db
    save_entries(shipped, GPU, [make_entry(BAD)])
    monkeypatch.setenv(tdb.TUNING_DIR_ENV, str(loop))
    assert [o for o, _ in tdb.search_dirs()] == ["user", "shipped"]  # resolve() raised here
    assert tdb.folder_problem(loop) == "symlink loop"
    lines = describe_database([])
    assert f"user {loop} (symlink loop: ignored)" in lines[0]
    with pytest.warns(RuntimeWarning, match="symlink loop") as record:
        assert lookup.lookup_decode_config(rows=128, fp8=True, device=cuda0()) == heuristic_config(128)
    assert str(loop) in str(record[0].message)
    result = invoke("info")
    assert result.exit_code == 0, result.output
    assert f"user {loop} (symlink loop: ignored)" in result.output


def test_tune_names_the_env_var_for_a_folder_it_did_not_get_from_db_dir(tmp_path, loop, monkeypatch):
    a_file = tmp_path / "notadir.txt"
    a_file.write_text("x")
    monkeypatch.setenv(tdb.TUNING_DIR_ENV, str(a_file))
    result = invoke("tune", "--dry-run")
    assert_one_line_error(result, "$SNAPMLA_TUNING_DIR", str(a_file), "not a folder")
    assert "--db-dir" not in result.stderr
    monkeypatch.setenv(tdb.TUNING_DIR_ENV, str(loop))
    assert_one_line_error(invoke("tune", "--dry-run"), "$SNAPMLA_TUNING_DIR", "symlink loop")
    monkeypatch.setenv(tdb.TUNING_DIR_ENV, str(a_file / "sub"))
    assert_one_line_error(invoke("tune", "--dry-run"), "$SNAPMLA_TUNING_DIR", "not a folder")
    # the option, when given, is what the message names (and it wins over the variable)
    monkeypatch.setenv(tdb.TUNING_DIR_ENV, str(tmp_path))
    result = invoke("tune", "--dry-run", "--db-dir", str(a_file))
    assert_one_line_error(result, "--db-dir", str(a_file), "not a folder")
    assert "SNAPMLA_TUNING_DIR" not in result.stderr
    assert_one_line_error(invoke("tune", "--dry-run", "--db-dir", str(loop)), "--db-dir", "symlink loop")


def test_an_unknown_home_in_the_env_var_is_a_note_not_a_crash(isolated_db, monkeypatch):
    user = "~snapmla_no_such_user_3141"
    try:
        Path(user).expanduser()
        pytest.skip("this machine expands the made-up user")
    except RuntimeError:
        pass
    monkeypatch.setenv(tdb.TUNING_DIR_ENV, f"{user}/tuning")
    assert "no home folder" in describe_database([])[0]
    assert_one_line_error(invoke("tune", "--dry-run"), "$SNAPMLA_TUNING_DIR", "no home folder")


def test_tune_without_a_gpu_points_at_dry_run(isolated_db, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = invoke("tune", "--heads", "16", "--ctx", "1k")
    assert_one_line_error(result, "no CUDA GPU", "--dry-run")


def test_no_warning_for_clean_folders(isolated_db):
    user, _ = isolated_db
    save_entries(user, GPU, [make_entry(BAD), make_entry(GOOD)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lookup.lookup_decode_config(rows=128, fp8=True, device=cuda0()) is not None


def test_a_compute_capability_of_three_numbers_is_malformed():
    with pytest.raises(DbError, match=r"compute_capability must be \[major, minor\], got \[9, 0, 1\]"):
        GpuKey.from_dict({**GPU.as_dict(), "compute_capability": [9, 0, 1]})


def test_the_gpu_key_of_gpu_facts_takes_the_driver_major():
    from types import SimpleNamespace

    facts = SimpleNamespace(name="NVIDIA H200", sm_count=132, compute_capability=(9, 0),
                            cuda_driver_version="12.8")
    assert GpuKey.from_facts(facts) == GpuKey("NVIDIA H200", 132, (9, 0), 12)
    assert GpuKey.from_facts(SimpleNamespace(**{**vars(facts), "cuda_driver_version": "n/a"})).cuda_driver_major is None


def test_a_user_folder_that_is_the_shipped_one_is_searched_once(isolated_db, monkeypatch):
    user, shipped = isolated_db
    monkeypatch.setenv(tdb.TUNING_DIR_ENV, str(shipped))
    assert tdb.search_dirs() == [("shipped", shipped)]
    monkeypatch.setenv(tdb.TUNING_DIR_ENV, str(user))
    assert tdb.search_dirs() == [("user", user), ("shipped", shipped)]


def test_an_entry_of_zero_candidates_loads():
    """A bucket whose budget ran out after the default stores candidates: 0 and reads it back."""
    entry = replace(make_entry(BAD), candidates=0)
    assert Entry.from_dict(entry.as_dict()) == entry


@pytest.mark.parametrize("text", ["", "\n  \n", "# only a comment\n"])
def test_an_empty_database_file_is_skipped_with_one_warning(isolated_db, text):
    """A 0-byte (or blank) database file was listed silently as a database of no entries: it is
    no database, so it gets a corrupt file's treatment (one warning from the lookup, one line in
    `snapmla info`); a merge still replaces it without --force, as nothing would be dropped."""
    user, shipped = isolated_db
    path = user / DB_NAME
    path.write_text(text)
    with pytest.raises(DbError, match=r"empty, expected a snapmla tuning database \('format: snapmla-tuning'\)"):
        load_file(path)
    save_entries(shipped, GPU, [make_entry(BAD)])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        found = [lookup.lookup_decode_config(rows=rows, fp8=True, device=cuda0()) for rows in (128, 64)]
    assert found[0] == heuristic_config(128)  # the shipped entry answers
    messages = [str(w.message) for w in record if "tuning" in str(w.message)]
    assert len(messages) == 1 and f"ignored: {path}: empty" in messages[0], messages
    assert (f"tuning file {path}: empty, expected a snapmla tuning database ('format: snapmla-tuning')"
            in describe_database([]))
    save_entries(user, GPU, [make_entry(GOOD)])  # no --force needed: nothing would be dropped
    assert find_entry(user, GPU, GOOD) == make_entry(GOOD)


def test_info_names_a_bad_database_file_once(isolated_db):
    """`snapmla info` printed "tuning file P: P: not valid YAML": the loader's message starts
    with the path, and the line named it again."""
    user, _ = isolated_db
    path = user / DB_NAME
    path.write_text("garbage: [\n")
    lines = [line for line in describe_database([]) if line.startswith("tuning file ")]
    assert lines == [f"tuning file {path}: not valid YAML (line 2)"]
    report = user.parent / "info.json"
    result = invoke("info", "--json", report)
    assert result.exit_code == 0, result.output
    assert result.stdout.count(str(path)) == 1, result.stdout
    import json

    skipped = json.loads(report.read_text())["tuning"]["skipped_files"]
    assert skipped == [{"path": str(path), "problem": "not valid YAML (line 2)"}]


def test_entries_that_are_not_a_list_are_one_named_problem(isolated_db):
    user, _ = isolated_db
    path = user / DB_NAME
    path.write_text(yaml.safe_dump({"format": "snapmla-tuning", "version": 1,
                                    "devices": [{"gpu": GPU.as_dict(), "entries": {"a": 1}}]}))
    loaded = load_file(path)
    assert loaded.problems == ["devices[0].entries: expected a list"]
    assert [(s.gpu, s.entries) for s in loaded.sections] == [(GPU, [])]


def test_entries_are_written_in_bucket_order(isolated_db):
    user, _ = isolated_db
    small = Bucket(16, 1, (8, 8), (4096, 4096), "fp8")
    path, _ = save_entries(user, GPU, [make_entry(GOOD), make_entry(small), make_entry(BAD)])
    assert [e.bucket for e in load_file(path).sections[0].entries] == [small, BAD, GOOD]


@pytest.mark.parametrize("bad", [1, 2])
def test_the_refusal_to_drop_malformed_entries_counts_them(isolated_db, bad):
    user, _ = isolated_db
    path = write_db(user, setter("candidates", value=-1))
    if bad == 2:
        data = yaml.safe_load(path.read_text())
        for entry in data["devices"][0]["entries"]:
            entry["candidates"] = -1
        path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(SnapmlaError) as info:
        save_entries(user, GPU, [make_entry(GOOD)])
    words = ("1 malformed entry", "which would drop it (") if bad == 1 else ("2 malformed entries", "drop them (")
    for needle in words:
        assert needle in str(info.value), str(info.value)


def test_a_gpu_name_that_is_not_text_is_malformed():
    for name in (5, None, ["H200"]):
        with pytest.raises(DbError, match="gpu: expected a mapping with a name"):
            GpuKey.from_dict({**GPU.as_dict(), "name": name})


def test_find_entry_wants_exactly_this_gpu_driver_included(isolated_db):
    """A resumed `snapmla tune` skips only buckets stored for this very key: another CUDA
    driver's section (same GPU model) is timed again."""
    user, _ = isolated_db
    older = GpuKey(GPU.name, GPU.sm_count, GPU.compute_capability, 12)
    save_entries(user, older, [make_entry(BAD)])
    assert find_entry(user, older, BAD) == make_entry(BAD)
    assert find_entry(user, GPU, BAD) is None


def test_a_deep_structure_or_an_alias_bomb_in_a_text_field_is_refused(isolated_db):
    """A structure where text belongs is refused, its entry skipped by name: str() of it was
    taken outside the loader's handling, where a few thousand nested brackets (which libyaml
    parses) raised RecursionError and an alias repeated a billion times filled the memory
    (here a million, which str() would still have expanded)."""
    user, _ = isolated_db
    path = write_db(user, lambda entry: None)
    plain = path.read_text()
    path.write_text(plain.replace("command: snapmla tune", "command: " + "[" * 500 + "]" * 500, 1))
    assert "entries[0]: command: expected text, got a list" in load_file(path).problems[0]
    anchors = "".join(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}" if i else "x"] * 10) + "]\n" for i in range(7))
    path.write_text(anchors + plain.replace("command: snapmla tune", "command: *a6", 1))
    loaded = load_file(path)
    assert "entries[0]: command: expected text, got a list" in loaded.problems[0]
    assert [e.bucket for e in loaded.sections[0].entries] == [GOOD]


@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="no fifos here")
def test_a_fifo_in_the_database_folder_is_refused_not_read(isolated_db):
    """A read of a fifo blocks until a writer comes: `snapmla info` and `snapmla tune` hung.
    The file is refused as not a regular file; the lookup warns once and goes on."""
    import os

    user, shipped = isolated_db
    os.mkfifo(user / DB_NAME)
    with pytest.raises(DbError, match="not a regular file"):
        load_file(user / DB_NAME)
    with pytest.raises(SnapmlaError, match="not a regular file; move it away"):
        save_entries(user, GPU, [make_entry(GOOD)])
    save_entries(shipped, GPU, [make_entry(GOOD)])
    with pytest.warns(RuntimeWarning, match="not a regular file"):
        assert lookup.lookup_decode_config(rows=128, fp8=True, device=cuda0(), context=65536) \
            == heuristic_config(128)
    assert find_entry(user, GPU, GOOD) is None


@pytest.mark.parametrize("where", ["entry", "gpu", "section", "file"])
def test_a_merge_does_not_drop_fields_it_does_not_know(isolated_db, where):
    """A newer snapmla's field (or a hand edit's) is read past by the lookup, but a rewrite of
    the file would lose it: refused without --force, naming the field."""
    user, _ = isolated_db
    path, _ = save_entries(user, GPU, [make_entry(BAD)])
    data = yaml.safe_load(path.read_text())
    target = {"entry": data["devices"][0]["entries"][0], "gpu": data["devices"][0]["gpu"],
              "section": data["devices"][0], "file": data}[where]
    target["note"] = "kept by hand"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    loaded = load_file(path)
    assert not loaded.problems and len(loaded.unknown) == 1 and loaded.unknown[0].endswith("note")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the lookup reads the entry as it is
        assert lookup.lookup_decode_config(rows=128, fp8=True, device=cuda0()) == heuristic_config(128)
    # `snapmla info` says so before `tune` refuses the file
    assert any(line.startswith(f"tuning file {path}: 1 field this snapmla does not know")
               and "will not rewrite the file without --force" in line for line in describe_database([]))
    before = path.read_text()
    with pytest.raises(SnapmlaError, match=r"1 field this snapmla does not know \(.*note: .*not overwriting"):
        save_entries(user, GPU, [make_entry(GOOD)])
    assert path.read_text() == before
    save_entries(user, GPU, [make_entry(GOOD)], force=True)
    assert "note" not in path.read_text()


def test_a_symlink_loop_as_the_file_warns_and_a_survey_names_it_once(isolated_db, loop):
    """A database file that is a symlink loop: Path.exists() said no (Python 3.11) and the
    lookup skipped it without a word, while `info` called it unreadable. With a GPU present the
    survey also printed the loader's raw RuntimeWarning beside its own line for a bad file."""
    user, shipped = isolated_db
    save_entries(shipped, GPU, [make_entry(BAD)])
    (user / DB_NAME).symlink_to(loop)
    with pytest.warns(RuntimeWarning, match="tuning database ignored") as record:
        assert lookup.lookup_decode_config(rows=128, fp8=True, device=cuda0()) == heuristic_config(128)
    assert str(user / DB_NAME) in str(record[0].message)
    lookup.clear_cache(reset_warnings=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the survey's lines say it; no warning beside them
        lines = describe_database([GPU])
    assert sum(str(user / DB_NAME) in line for line in lines) == 1, lines


@pytest.mark.parametrize("force", [False, True])
def test_a_folder_in_place_of_the_database_is_refused_before_any_run(isolated_db, force):
    """A folder of the database file's name: the up-front check suggested --force, which passed
    it, and the write failed after the first bucket had been measured."""
    user, _ = isolated_db
    (user / DB_NAME).mkdir()
    with pytest.raises(SnapmlaError, match="not a regular file; move it away \\(--force does not replace it\\)"):
        tdb.sections_to_merge(user / DB_NAME, force=force)


def test_a_database_folder_that_cannot_be_written_is_refused_up_front(tmp_path, monkeypatch):
    """A read-only file system (root's `access` says yes) failed only at the first candidate's
    progress file, after the precompile: the folder is now written to before anything runs."""
    import errno
    import tempfile

    from snapmla_cli.cli.tune import _make_folder

    folder = tmp_path / "db"
    _make_folder(folder, "--db-dir")  # made, and writable
    assert folder.is_dir() and list(folder.iterdir()) == []  # the probe leaves nothing behind

    def read_only(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    with pytest.raises(SnapmlaError, match=rf"^--db-dir: cannot write in the database folder {folder} "
                                           r"\(Read-only file system\)"):
        _make_folder(folder, "--db-dir")


@pytest.mark.parametrize("version", [True, 1.0, "1", 2])
def test_only_the_integer_version_is_read(isolated_db, version):
    """`version: true` and `version: 1.0` compare equal to 1 in Python and were read as it."""
    user, _ = isolated_db
    path = user / DB_NAME
    path.write_text(yaml.safe_dump({"format": "snapmla-tuning", "version": version, "devices": []}))
    with pytest.raises(DbError, match="database version .*, this snapmla reads version 1"):
        load_file(path)
