"""Sizes and counts out of range, option-parser errors and an unreadable tuning folder: each a
one-line error (or a named note in `info`), never a traceback, a hang or an allocation failure."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import rich.console
import torch
from cli_checks import assert_one_line_error, invoke
from safetensors.torch import save_file

from snapmla_cli import host_memory
from snapmla_cli.cache.synth import SynthSpec, probe_queries, synth_layer_kv
from snapmla_cli.cli import common, info
from snapmla_cli.cli.app import INTERNAL_EXIT, TRACEBACK_ENV
from snapmla_cli.errors import SnapmlaError
from snapmla_cli.sizes import MAX_BATCH, MAX_SIZE, parse_int_list, parse_size
from snapmla_cli.tuning import lookup
from snapmla_cli.tuning.db import GpuKey


@pytest.mark.parametrize(("args", "needles"), [
    (["verify", "--ctx", "99999999999999999999"], ["--ctx", "too large", "at most 2147483647"]),
    (["verify", "--ctx", "1k", "--heads", "99999999999999999999"], ["--heads", "at most 1024"]),
    (["verify", "--ctx", "1k", "--mtp", "17"], ["--mtp", "at most 16"]),
    (["verify", "--ctx", "1k", "--batch", "0"], ["--batch", "at least 1"]),
    (["tune", "--dry-run", "--ctx", "99999999999999999999999"], ["--ctx", "too large"]),
    (["tune", "--dry-run", "--batch", "1-100000"], ["--batch", "at most 4096 requests"]),
    (["synth", "-o", "never.st", "--tokens", "100000000m"], ["--tokens", "too large"]),
    # (no cap once ran a 100,000-head synth out of host memory past an estimate 25% low)
    (["synth", "-o", "never.st", "--heads", "1025"], ["--heads: expected at most 1024, got 1025"]),
    (["verify", "--ctx", "9" * 5000], ["--ctx", "too large"]),
    (["tune", "--dry-run", "--heads", "9" * 5000], ["--heads", "too large"]),
    (["tune", "--dry-run", "--budget", "9" * 5000], ["--budget", "too large", "at most 19 digits"]),
    (["bench", "--cpu-fake", "--kv-mem", "9" * 5000 + "G"], ["--kv-mem", "too large", "at most 19 digits"]),
    # (int() of a dp or tp past 4,300 digits raised: exit code 3, an "internal error")
    (["bench", "--cpu-fake", "--layout", f"dp{'9' * 5000}tp1"], ["--layout", "too large", "at most 19 digits"]),
    (["bench", "--cpu-fake", "--layout", f"dp1tp{'9' * 5000}"], ["--layout", "too large", "at most 19 digits"]),
    (["quantize", "-o", "never.st", "--queries", "0"], ["--queries: expected at least 1, got 0"]),
])
def test_sizes_beyond_the_int32_lengths_or_the_named_maxima(args: list[str], needles: list[str], tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert_one_line_error(invoke(*args), *needles)
    assert not (tmp_path / "never.st").exists()


def test_more_memory_than_the_host_has_is_refused_before_any_work(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 2**30)
    out = tmp_path / "big.st"
    assert_one_line_error(invoke("synth", "-o", str(out), "--layers", "100", "--tokens", "1m"),
                          "synthetic dump of 100 layers x 1048576 tokens", "GiB of host memory", "1.0 GiB available")
    assert not out.exists()
    assert_one_line_error(invoke("verify", "--ctx", "1m", "--batch", "64"), "--batch 64 x --ctx 1048576",
                          "GiB of host memory")
    assert MAX_SIZE == parse_size(str(MAX_SIZE), "--ctx")
    assert parse_int_list("1024", "--heads", 1024) == [1024]


@pytest.mark.parametrize(("args", "needle"), [
    (["synth", "--layers", "abc", "-o", "x.st"], "snapmla synth: Invalid value for '--layers'"),
    # (without pydantic's "Value error, " between the option and the choices)
    (["quantize", "--device", "gpu"],
     "snapmla quantize: Invalid value for '--device': 'gpu' is not one of 'auto', 'cpu', 'cuda'."),
    (["synth"], "snapmla synth: Missing option '--output'"),
    (["info", "extra"], "snapmla info: Got unexpected extra argument"),
    (["info", "--bogus"], "snapmla info: No such option: --bogus"),
    (["bench", "--model", "foo"], "snapmla bench: Invalid value for '--model': 'foo' is not one of"),
    (["verify", "--seed", "99999999999999999999999"], "snapmla verify: Invalid value for '--seed'"),
    (["synth", "-o", "x.st", "--seed", "-1"], "snapmla synth: Invalid value for '--seed'"),
    (["verify", "--heads", "\u00b2"], "--heads: '\u00b2' is not a positive integer"),
    (["tune", "--dry-run", "--mtp", "1,\u0663"], "--mtp: '\u0663' is not a positive integer"),
])
def test_option_parser_errors_are_one_line(args: list[str], needle: str) -> None:
    assert_one_line_error(invoke(*args), needle)


def test_no_command_shows_the_help_without_an_error_line() -> None:
    result = invoke()
    assert result.exit_code == 2 and "Usage: snapmla" in result.output
    assert "error" not in result.stderr


def test_an_unexpected_exception_is_one_line_with_exit_code_3(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug (not a bad input): named in one line, its traceback only on request."""
    def broken(*args: object) -> None:
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(info, "list_gpus", broken)
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    result = invoke("info")
    assert result.exit_code == INTERNAL_EXIT, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.stderr
    assert lines[0].startswith("error: internal error in snapmla (RuntimeError: boom second line)")
    assert f"{TRACEBACK_ENV}=1" in lines[0]
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    result = invoke("info")
    assert isinstance(result.exception, RuntimeError) and str(result.exception) == "boom\nsecond line"


def test_traceback_switch_set_to_0_is_off_and_an_abort_exits_1(monkeypatch: pytest.MonkeyPatch) -> None:
    import typer

    def broken(*args: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(info, "list_gpus", broken)
    monkeypatch.setenv(TRACEBACK_ENV, "0")
    result = invoke("info")
    assert result.exit_code == INTERNAL_EXIT and "internal error in snapmla (RuntimeError: boom)" in result.stderr

    def aborted(*args: object) -> None:
        raise typer.Abort()

    monkeypatch.setattr(info, "list_gpus", aborted)
    result = invoke("info")
    assert result.exit_code == 1 and result.stderr.strip() == "aborted"


def test_help_and_a_good_command_still_exit_zero() -> None:
    result = invoke("verify", "--help")
    assert result.exit_code == 0 and "Usage: snapmla verify" in result.output


def test_one_key_gives_finite_probe_queries() -> None:
    """`verify --ctx 1`: the RoPE gain matched an unbiased std of one sample (NaN)."""
    kv, _ = synth_layer_kv(1, 0.5, 0, 0)
    q = probe_queries(kv, 2, 4, 0)
    assert q.shape == (2, 4, 576) and bool(q.float().isfinite().all())
    result = invoke("verify", "--ctx", "1", "--heads", "16", "--mtp", "1")
    assert result.exit_code == 0, result.output
    assert "1/1 cases pass" in result.output and "Warning" not in result.stderr
    assert SynthSpec(layers=1, tokens=1).tokens == 1


def test_info_names_an_unreadable_tuning_folder_and_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         isolated_tuning_dirs: tuple[Path, Path],
                                                         denied_paths: set[Path]) -> None:
    user, _ = isolated_tuning_dirs
    (user / "X.yaml").write_text("garbage: [\n")
    result = invoke("info")
    assert result.exit_code == 0
    assert f"tuning file {user / 'X.yaml'}:" in result.output and "not valid YAML" in result.output
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    monkeypatch.setenv("SNAPMLA_TUNING_DIR", str(not_a_folder))
    lookup.clear_cache(reset_warnings=True)
    assert f"user {not_a_folder} (not a folder: ignored)" in invoke("info").output
    monkeypatch.setenv("SNAPMLA_TUNING_DIR", str(tmp_path / "missing"))
    assert "(missing: ignored)" in invoke("info").output
    # a folder that cannot be listed looked usable and held no entries (root lists any folder:
    # the permission is taken away by os.access)
    unlistable = tmp_path / "unlistable"
    unlistable.mkdir()
    denied_paths.add(unlistable)
    monkeypatch.setenv("SNAPMLA_TUNING_DIR", str(unlistable))
    lookup.clear_cache(reset_warnings=True)
    assert f"user {unlistable} (Permission denied: ignored)" in " ".join(invoke("info").output.split())
    denied_paths.clear()
    monkeypatch.setenv("SNAPMLA_TUNING_DIR", str(not_a_folder))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lookup.load_located(GpuKey("NVIDIA H200", 132, (9, 0), 13))
    assert any("not a folder" in str(w.message) for w in caught)


def test_counts_beyond_what_a_dump_holds_are_refused_not_clamped(tmp_path: Path) -> None:
    dump = tmp_path / "a.st"
    assert invoke("synth", "-o", str(dump), "--layers", "1", "--tokens", "1k", "--queries", "4").exit_code == 0
    out = tmp_path / "q.st"
    assert_one_line_error(invoke("quantize", str(dump), "-o", str(out), "--queries", "100"),
                          "--queries 100: layer 0 of the dump holds 4 queries")
    assert not out.exists()


def test_a_late_layer_short_of_queries_is_refused_before_any_analysis(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer holding fewer queries than --queries, last in the dump, was found only after every
    layer before it had been quantized and analysed (minutes on a 61-layer 32k dump)."""
    from snapmla_cli.analysis import fidelity
    from snapmla_cli.cache.dump_file import KVDump, LayerDump, write_dump
    from snapmla_cli.cli import quantize

    gen = torch.Generator().manual_seed(5)
    layers = [LayerDump(i, torch.randn(70, 576, generator=gen).to(torch.bfloat16),
                        queries=torch.randn(n, 2, 576, generator=gen).to(torch.bfloat16))
              for i, n in enumerate((8, 8, 2))]
    dump = tmp_path / "short_last.safetensors"
    write_dump(KVDump(layers=layers, model="test"), dump)
    analysed: list[int] = []
    real = fidelity.analyze_layer
    monkeypatch.setattr(quantize, "analyze_layer", lambda layer, *a, **k: analysed.append(layer.index) or real(layer, *a, **k))
    out = tmp_path / "q.st"
    assert_one_line_error(invoke("quantize", str(dump), "-o", str(out), "--queries", "4"),
                          "--queries 4: layer 2 of the dump holds 2 queries")
    assert analysed == [] and not out.exists()
    assert invoke("quantize", str(dump), "-o", str(out), "--queries", "2").exit_code == 0
    assert analysed == [0, 1, 2]


@pytest.mark.parametrize(("args", "needle"), [
    (["--decode", "-1"], "--decode -1: expected >= 0"),
    (["--queries", "-2"], "--queries -2: expected >= 0"),
    (["--model", ""], "--model: expected a checkpoint folder or a Hugging Face id"),
])
def test_dump_options_are_named_one_by_one(args: list[str], needle: str, tmp_path: Path) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    base = {"--model": str(tmp_path), "--prompts": str(prompts)}
    base.update(dict(zip(args[::2], args[1::2])))
    flat = [x for kv in base.items() for x in kv]
    assert_one_line_error(invoke("dump", *flat, "-o", str(tmp_path / "d.st")), needle)


def test_no_empty_line_before_an_error_off_a_terminal(tmp_path: Path) -> None:
    """rich's transient progress bar printed a newline on stop even when it drew nothing, so an
    error raised under the bar came second on stderr."""
    dump = tmp_path / "a.st"
    assert invoke("synth", "-o", str(dump), "--layers", "1", "--tokens", "1k", "--queries", "2").exit_code == 0
    result = invoke("quantize", str(dump), "-o", str(tmp_path / "q.st"), "--queries", "3")
    assert result.exit_code == 2 and result.stderr.startswith("error: --queries 3"), repr(result.stderr)


def test_verify_says_when_a_dumps_queries_are_repeated(tmp_path: Path) -> None:
    dump = tmp_path / "a.st"
    assert invoke("synth", "-o", str(dump), "--layers", "1", "--tokens", "1k", "--queries", "2").exit_code == 0
    result = invoke("verify", "--dump", str(dump), "--heads", "16,32", "--mtp", "1")
    assert result.exit_code == 0, result.output
    assert "note: the dump's layer 0 holds 2 queries of 16 heads; h_q 32 repeat its 16 heads" in result.output
    assert "note:" not in invoke("verify", "--dump", str(dump), "--heads", "16", "--mtp", "1").output


def test_verify_says_when_fp8_storage_itself_loses_the_output(tmp_path: Path) -> None:
    """Values that E4M3 flushes to zero (around 1e-30) make the floor 1.0; the gates, relative to
    the floor, still pass, so verify must say what the floor means."""
    dump = tmp_path / "tiny.st"
    kv = torch.randn(200, 576, generator=torch.Generator().manual_seed(0)) * 1e-30
    save_file({"layers.0.kv": kv}, str(dump), metadata={"format": "snapmla-kv-dump", "version": "1",
                                                         "kv_lora_rank": "512", "rope_dim": "64", "model": "test"})
    result = invoke("verify", "--dump", str(dump), "--heads", "2", "--mtp", "1")
    assert result.exit_code == 0, result.output
    assert "note: FP8 storage alone is 1 (rel_l2) from float64 at h_q 2 s_q 1, above 0.1" in " ".join(result.output.split())
    synthetic = invoke("verify", "--ctx", "256", "--heads", "2", "--mtp", "1")
    assert synthetic.exit_code == 0 and "FP8 storage alone" not in synthetic.output


def test_bench_takes_the_largest_seed_the_option_allows(tmp_path: Path) -> None:
    """The per-rank seed (seed x 1,000,003 + DP index) stays within torch's 64 bits."""
    import json
    from types import SimpleNamespace

    from snapmla_cli.bench.worker import rank_seed

    result = invoke("bench", "--cpu-fake", "--ctx", "1k", "--seed", str(2**63 - 1), "--json", tmp_path / "b.json")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "b.json").read_text())["plan"]["seed"] == 2**63 - 1
    # (2^63 - 1) x 1,000,003 + dp wraps modulo 2^63: -1,000,003 + dp, distinct per DP group
    largest = SimpleNamespace(seed=2**63 - 1)
    assert [rank_seed(largest, dp) for dp in (0, 1)] == [2**63 - 1_000_003, 2**63 - 1_000_002]  # type: ignore[arg-type]


@pytest.mark.parametrize("command", [["synth", "-o", "never.st"], ["quantize", "-o", "never.st"],
                                     ["verify", "--ctx", "1k"]])
def test_synthetic_data_commands_refuse_seeds_that_repeat_smaller_ones(command: list[str], tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The synthetic data's generator mixes seeds modulo 2^62: `--seed 2^62` made seed 0's tensors.
    The commands that make such data take seeds below it; bench (other generators) keeps 2^63 - 1."""
    from snapmla_cli.cache.synth import MAX_SYNTH_SEED, SEED_MODULUS

    monkeypatch.chdir(tmp_path)
    assert MAX_SYNTH_SEED == SEED_MODULUS - 1 == 2**62 - 1
    assert_one_line_error(invoke(*command, "--seed", str(SEED_MODULUS)), "--seed", str(MAX_SYNTH_SEED))
    assert not (tmp_path / "never.st").exists()


def test_synth_takes_the_largest_seed_below_the_modulus(tmp_path: Path) -> None:
    from snapmla_cli.cache.synth import MAX_SYNTH_SEED

    out = tmp_path / "s.st"
    result = invoke("synth", "-o", out, "--layers", "1", "--tokens", "128", "--seed", str(MAX_SYNTH_SEED))
    assert result.exit_code == 0, result.output
    assert out.exists()


@pytest.mark.parametrize("columns", ["0", "1", "20"])
def test_a_tiny_terminal_width_still_shows_the_tables(columns: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """$COLUMNS of 0 printed nothing in a terminal, 1 a column of letters: the console is made at
    least 80 wide there (a pipe keeps its fixed width)."""
    monkeypatch.setenv("COLUMNS", columns)
    monkeypatch.setattr(rich.console.Console, "is_terminal", property(lambda self: True))
    assert common.console().width == 80


def test_the_synthetic_default_takes_more_probe_queries_than_its_own(tmp_path: Path) -> None:
    """Without a DUMP, --queries sizes the synthetic default's probes; it used to fail with "layer
    0 of the dump holds 4 queries" although no dump was given."""
    out = tmp_path / "c.st"
    result = invoke("quantize", "-o", out, "--layers", "1", "--tokens", "128", "--queries", "6",
                    "--configs", "snap", "--json", tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    assert out.exists() and "dump holds" not in result.output
    import json

    from snapmla_cli.analysis.fidelity import PROBE_HEADS, PROBE_QUERIES

    assert PROBE_QUERIES != 6  # (else the default, not --queries, could be what the rows show)
    layer = json.loads((tmp_path / "r.json").read_text())["layers"][0]
    assert (layer["query_rows"], layer["probes"]) == (6 * PROBE_HEADS, "synthetic")  # 6 queries probed



def test_figure_tables_right_align_figures_and_left_align_text_columns() -> None:
    from snapmla_cli.tables import figure_table

    table = figure_table("t", ("layout", "kernel", "ms"), left=("kernel",))
    assert [(c.header, c.justify, c.overflow) for c in table.columns] == [
        ("layout", "right", "fold"), ("kernel", "left", "fold"), ("ms", "right", "fold")]


@pytest.mark.parametrize(("args", "message"), [
    (["verify", "--heads", "16,64,64"], "--heads: 64 given twice"),
    (["verify", "--mtp", "1,2,01"], "--mtp: 1 given twice ('1' and '01')"),
    (["verify", "--fp8-kernel", "default,v2, v2"], "--fp8-kernel: v2 given twice"),
    (["bench", "--cpu-fake", "--ctx", "16k,32k,16384"], "--ctx: 16384 given twice ('16k' and '16384')"),
    (["bench", "--cpu-fake", "--layout", "dp1tp1,DP1/TP1"], "--layout: dp1tp1 given twice ('dp1tp1' and 'DP1/TP1')"),
    (["tune", "--dry-run", "--heads", "16,16"], "--heads: 16 given twice"),
    (["tune", "--dry-run", "--batch", "64,64-64"], "--batch: 64 given twice ('64' and '64-64')"),
    (["tune", "--dry-run", "--ctx", "16k-32k,16384-32k"], "--ctx: 16384-32768 given twice ('16k-32k' and '16384-32k')"),
    (["quantize", "-o", "never.st", "--configs", "snap,A,snap"], "--configs: snap given twice"),
    (["dump", "--model", ".", "--prompts", "p.txt", "-o", "never.st", "--layers", "0,1,1"], "--layers: 1 given twice"),
])
def test_a_list_value_given_twice_is_one_line_naming_it(args: list[str], message: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A repeat, in any spelling, was silently dropped (so fewer cases ran than were typed, and a
    typo for another value went unnoticed): now refused before any work."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.txt").write_text("hello\n")
    result = invoke(*args)
    assert_one_line_error(result, message)
    assert result.stderr.strip().endswith(message), result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.txt"]


def test_overlapping_ranges_are_distinct_buckets() -> None:
    from snapmla_cli.tuning.space import parse_ranges

    assert parse_ranges("16-128,64-128,64", "--batch") == [(16, 128), (64, 128), (64, 64)]


@pytest.mark.parametrize("args", [
    ["verify", "--ctx", "1", "--heads", "16", "--mtp", "1", "--batch"],
    ["bench", "--cpu-fake", "--ctx", "1k", "--batch"],
])
@pytest.mark.parametrize("batch", [MAX_BATCH + 1, 10**9, 10**30])
def test_a_batch_beyond_max_batch_is_refused_before_any_work(args: list[str], batch: int,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """`verify --ctx 1 --batch 100000` passed the memory check (which counts tokens, not the
    per-request work) and ran for minutes while its memory grew; bench timed a fake batch of
    10^23. Both now stop at MAX_BATCH, named in the message."""
    from snapmla_cli.analysis import verify as analysis

    def no_work(*args: object) -> None:
        raise AssertionError("the cases were built")

    monkeypatch.setattr(analysis, "synth_layer_kv", no_work)
    assert_one_line_error(invoke(*args, batch), f"--batch: {batch} is too large (expected at most {MAX_BATCH} requests)")


def test_max_batch_itself_is_accepted_and_shared_with_tune() -> None:
    from snapmla_cli.bench.plan import make_plan
    from snapmla_cli.tuning.space import MAX_TUNE_BATCH, parse_ranges

    assert make_plan(contexts=[1024], batch=MAX_BATCH).batch == MAX_BATCH
    assert MAX_TUNE_BATCH == MAX_BATCH and parse_ranges(f"1-{MAX_BATCH}", "--batch") == [(1, MAX_BATCH)]
    with pytest.raises(SnapmlaError, match=f"at most {MAX_BATCH} requests"):
        make_plan(contexts=[1024], batch=MAX_BATCH + 1)


@pytest.mark.parametrize("command", [["verify", "--ctx", "1k"], ["tune", "--dry-run"], ["bench", "--cpu-fake", "--ctx", "1k"]],
                         ids=lambda c: c[0])
def test_every_command_takes_the_same_mtp_range_and_says_it(command: list[str]) -> None:
    """verify, tune and bench accept --mtp 1..MAX_QUERY_TOKENS (bench stopped at 4 while the others
    took 16), refuse the next value in one line, and their --help states the range."""
    from snapmla_cli.sizes import MAX_QUERY_TOKENS

    help_text = " ".join(invoke(command[0], "--help").stdout.split())
    assert f"1..{MAX_QUERY_TOKENS}" in help_text
    assert_one_line_error(invoke(*command, "--mtp", str(MAX_QUERY_TOKENS + 1)), "--mtp", str(MAX_QUERY_TOKENS))


def test_an_mtp_longer_than_the_context_fails_before_any_case_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The largest --mtp is checked against the requests before the first case: the check used to
    sit in each case's problem, so `--mtp 1,2` ran the whole --mtp 1 column before refusing 2."""
    from snapmla_cli.cli import verify as verify_cli

    cases_run: list[int] = []

    def counted(*args: object, **kwargs: object) -> object:
        cases_run.append(1)
        raise AssertionError("a case ran")

    monkeypatch.setattr(verify_cli, "run_case", counted)
    assert_one_line_error(invoke("verify", "--ctx", "1", "--mtp", "1,2", "--heads", "16"),
                          "--mtp 2 exceeds the context of 1 tokens")
    assert cases_run == []


@pytest.mark.parametrize("option", ["--layers", "--queries"])
def test_a_count_of_hundreds_of_digits_is_a_memory_error_not_an_internal_one(tmp_path: Path, option: str) -> None:
    """The memory estimate's GiB went through a float: 320 nines overflowed it, exit 3."""
    result = invoke("synth", "-o", tmp_path / "x.st", option, "9" * 320)
    assert_one_line_error(result, "needs about 10^318 GiB of host memory")


def test_messages_stay_one_bounded_line_whatever_the_caller_passed() -> None:
    """A caller's value in a message (a million-character string, a tensor's repr over many lines,
    an int past Python's digit limit for str(), which raised ValueError while the message was
    being built) gave errors of megabytes, of many lines, or no SnapmlaError at all."""
    import numpy as np

    from snapmla_cli.errors import MAX_MESSAGE_CHARS, SnapmlaError
    from snapmla_cli.numerics.decode_args import checked_flag
    from snapmla_cli.ops.decode import get_mla_metadata

    lengths = torch.tensor([100, 10], dtype=torch.int32)
    for call in (lambda: checked_flag("causal", "x" * 10**6), lambda: checked_flag("causal", torch.ones(6, 6)),
                 lambda: get_mla_metadata(lengths, 10**5000, 1), lambda: get_mla_metadata(lengths, 16, 1, s_q=10**5000),
                 lambda: get_mla_metadata(lengths, np.array([16, 16]), 1),
                 lambda: get_mla_metadata(lengths, 16, 1, num_heads_q=np.array([4]))):
        with pytest.raises(SnapmlaError) as caught:
            call()
        message = str(caught.value)
        assert "\n" not in message and len(message) <= MAX_MESSAGE_CHARS, message[:200]
    long = SnapmlaError("head " + "x" * 5000 + " tail")
    assert str(long).startswith("head x") and str(long).endswith("x tail") and "chars cut" in str(long)
