"""The ``snapmla`` command line, end to end on the CPU (typer's CliRunner)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_checks import SYNTH, assert_one_line_error, invoke
from safetensors.torch import save_file

from snapmla_cli import host_memory
from snapmla_cli.cache.dump_file import DUMP_FORMAT, read_dump
from snapmla_cli.cache.fp8_file import quantize_layer_cache, read_fp8_cache
from snapmla_cli.cli.app import COMMANDS, app
from snapmla_cli.cli.common import one_line, write_json
from snapmla_cli.errors import SnapmlaError
from snapmla_cli.numerics.formats import D_QK
from snapmla_cli.sizes import (
    counted,
    format_size,
    parse_int_list,
    parse_size,
    parse_size_list,
    shorten,
    split_list,
)


@pytest.fixture(scope="module")
def small_dump(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dump") / "dump.safetensors"
    result = invoke("synth", "-o", path, "--layers", 3, "--tokens", "1k", "--queries", 2, "--heads", 4)
    assert result.exit_code == 0, result.output
    return path


def test_synth_writes_a_valid_dump(small_dump: Path) -> None:
    dump = read_dump(small_dump)
    assert [layer.index for layer in dump.layers] == [0, 1, 2]
    assert dump.layers[0].kv.shape == (1024, D_QK) and dump.layers[0].kv.dtype == torch.bfloat16
    assert dump.layers[2].queries.shape == (2, 4, D_QK)
    assert torch.equal(dump.layers[1].positions, torch.arange(1024))


def test_quantize_writes_cache_json_and_plot(small_dump: Path, tmp_path: Path) -> None:
    out, report, plot = tmp_path / "c.safetensors", tmp_path / "r.json", tmp_path / "p.png"
    result = invoke("quantize", small_dump, "-o", out, "--json", report, "--plot", plot)
    assert result.exit_code == 0, result.output
    assert "mean over 3 layers" in result.stdout
    cache = read_fp8_cache(out)
    for layer, original in zip(cache.layers, read_dump(small_dump).layers):
        assert layer.seqlen == 1024
        assert torch.equal(layer.cache, quantize_layer_cache(original.kv))
    data = json.loads(report.read_text())
    assert (data["format"], data["version"]) == ("snapmla-quantize", "1")  # named, as bench's report
    assert data["configs"] == ["snap", "A", "B", "C", "D", "G"]
    assert len(data["layers"]) == 3 and data["layers"][0]["probes"] == "dump"
    assert data["mean"]["output"]["A"]["rel_l2"] > data["mean"]["output"]["snap"]["rel_l2"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_quantize_without_a_dump_uses_the_synthetic_default(tmp_path: Path) -> None:
    out = tmp_path / "c.safetensors"
    result = invoke("quantize", "-o", out, "--layers", 2, "--tokens", 256, "--configs", "snap,A")
    assert result.exit_code == 0, result.output
    assert [layer.seqlen for layer in read_fp8_cache(out).layers] == [256, 256]


def test_refuses_to_overwrite_without_force(small_dump: Path, tmp_path: Path) -> None:
    out = tmp_path / "c.safetensors"
    out.write_bytes(b"keep me")
    assert_one_line_error(invoke("quantize", small_dump, "-o", out), "exists", "--force")
    assert out.read_bytes() == b"keep me"
    report = tmp_path / "r.json"
    report.write_text("{}")
    assert_one_line_error(invoke("quantize", small_dump, "-o", tmp_path / "new.st", "--json", report), "--json")
    assert not (tmp_path / "new.st").exists()
    assert_one_line_error(invoke("synth", "-o", small_dump, "--tokens", 64), "exists")
    result = invoke("quantize", small_dump, "-o", out, "--force", "--configs", "snap")
    assert result.exit_code == 0 and out.read_bytes() != b"keep me"


def test_an_existing_output_is_refused_before_any_work(small_dump: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The outputs are checked first: a run that can only fail at its end must not spend the
    quantization or the synthesis (minutes on a real dump) before saying so."""
    from snapmla_cli.cli import quantize, synth

    def no_work(*args: object, **kwargs: object) -> None:
        raise AssertionError("work started before the outputs were checked")

    monkeypatch.setattr(quantize, "quantize_layer_cache", no_work)
    monkeypatch.setattr(synth, "synth_dump", no_work)
    out = tmp_path / "c.safetensors"
    out.write_bytes(b"keep me")
    assert_one_line_error(invoke("quantize", small_dump, "-o", out), f"--output {out} exists", "--force")
    assert_one_line_error(invoke("synth", "-o", out, *SYNTH), f"--output {out} exists", "--force")
    assert out.read_bytes() == b"keep me"
    fresh = tmp_path / "new.safetensors"
    assert_one_line_error(invoke("quantize", small_dump, "-o", fresh, "--plot", tmp_path / "p.txt"),
                          "--plot", "expected a .png, .pdf, .svg file")
    assert not fresh.exists()


def test_json_reports_write_non_finite_numbers_as_strings(tmp_path: Path) -> None:
    """Standard JSON has no Infinity or NaN (strict parsers, jq, browsers refuse them): the lse of
    an empty row (+inf) and a NaN metric are written as the strings "inf", "-inf", "nan"."""
    path = tmp_path / "r.json"
    write_json(path, {"lse": [math.inf, -math.inf], "rel_l2": math.nan, "rmse": 1.5,
                      "pair": (2.0, math.inf)}, force=False)  # a tuple (a dataclass's asdict) too

    def refuse(constant: str) -> None:
        raise ValueError(f"non-standard JSON constant {constant}")

    data = json.loads(path.read_text(), parse_constant=refuse)
    assert data == {"lse": ["inf", "-inf"], "rel_l2": "nan", "rmse": 1.5, "pair": [2.0, "inf"]}


@pytest.mark.parametrize("option", [("--tokens", "1k"), ("--layers", "2")])
def test_quantize_takes_synthetic_sizes_only_without_a_dump(small_dump: Path, tmp_path: Path, option) -> None:
    out = tmp_path / "never.st"
    assert_one_line_error(invoke("quantize", small_dump, "-o", out, *option),
                          "--layers/--tokens apply only to the synthetic default")
    assert not out.exists()


def test_one_line_joins_lines_and_names_a_silent_exception() -> None:
    assert one_line(OSError("cannot write\n  x.st")) == "cannot write x.st"
    assert one_line(ValueError()) == "ValueError" and one_line(RuntimeError(" \n ")) == "RuntimeError"
    assert one_line("") == "" and one_line(" a \n b ") == "a b"


def _bad_dump(tmp_path: Path, name: str, tensors: dict[str, torch.Tensor]) -> Path:
    path = tmp_path / name
    meta = {"format": DUMP_FORMAT, "version": "1", "kv_lora_rank": "512", "rope_dim": "64", "model": "t"}
    save_file(tensors, str(path), metadata=meta)
    return path


def test_bad_inputs_are_one_line_errors(tmp_path: Path) -> None:
    junk = tmp_path / "junk.safetensors"
    junk.write_text("hello")
    nan = torch.zeros(4, D_QK)
    nan[2, 3] = float("nan")
    cases = [
        (junk, "not a safetensors file"),
        (tmp_path / "missing.safetensors", "no such file"),
        (_bad_dump(tmp_path, "w.st", {"layers.0.kv": torch.zeros(4, 512)}), "layer 0"),
        (_bad_dump(tmp_path, "n.st", {"layers.1.kv": nan}), "layer 1"),
        (_bad_dump(tmp_path, "e.st", {"layers.2.kv": torch.zeros(0, D_QK)}), "layer 2"),
    ]
    for path, needle in cases:
        assert_one_line_error(invoke("quantize", path, "-o", tmp_path / "out.st"), needle)
        assert_one_line_error(invoke("verify", "--dump", path), needle)
    assert not (tmp_path / "out.st").exists()
    assert_one_line_error(invoke("verify", "--ctx", "12q"), "--ctx")
    assert_one_line_error(invoke("verify", "--fp8-kernel", "v4"), "--fp8-kernel")
    assert_one_line_error(invoke("verify", "--fp8-kernel", " "), "--fp8-kernel", "is empty (expected e.g. default,v3)")
    # named kernels on the CPU would silently not run (the JSON said kernels_not_run null)
    assert_one_line_error(invoke("verify", "--device", "cpu", "--fp8-kernel", "v3"), "--fp8-kernel v3", "CUDA GPU")
    assert_one_line_error(invoke("verify", "--heads", "16,x"), "--heads")
    for count in ("16.5", "16k"):  # head and token counts are plain integers, not sizes
        assert_one_line_error(invoke("verify", "--heads", count), "positive integer")
    assert_one_line_error(invoke("verify", "--mtp", "1,two"), "--mtp", "expected e.g. 1,2")  # its own example
    assert_one_line_error(invoke("tune", "--dry-run", "--mtp", "0"), "--mtp", "expected e.g. 1,2")
    assert_one_line_error(invoke("quantize", "-o", tmp_path / "o.st", "--configs", "snap,Q"), "--configs", "'Q'")
    assert_one_line_error(invoke("quantize", "-o", tmp_path / "o.st", "--configs", " "), "--configs", "is empty")
    assert_one_line_error(invoke("quantize", "-o", tmp_path / "o.st", "--layers", "0"), "--layers")
    assert_one_line_error(invoke("verify", "--ctx", "0"), "--ctx")
    for option, value in (("--layers", "0"), ("--heads", "0"), ("--queries", "-1")):
        assert_one_line_error(invoke("synth", "-o", tmp_path / "s.st", option, value), option, "expected at least")
    assert not (tmp_path / "s.st").exists()
    # a NaN limit would pass every case (no comparison with NaN fails)
    for option, value in (("--gate-emul", "nan"), ("--gate-floor-factor", "0"), ("--gate-floor-abs", "-1e-3"),
                          ("--gate-bf16-cos", "inf")):
        assert_one_line_error(invoke("verify", option, value), option, "finite number")
    bad_plot = invoke("quantize", "-o", tmp_path / "p.st", "--layers", "1", "--tokens", "64", "--plot", tmp_path / "p.txt")
    assert_one_line_error(bad_plot, "--plot", ".png, .pdf, .svg")
    assert not (tmp_path / "p.st").exists(), "a bad --plot must be refused before any output is written"
    if not torch.cuda.is_available():
        assert_one_line_error(invoke("quantize", "-o", tmp_path / "o.st", "--device", "cuda"), "no CUDA GPU")


def test_empty_and_special_dump_paths_are_named_as_typed(small_dump: Path, tmp_path: Path) -> None:
    """typer reads ``''`` as ``Path('.')``; the error must show what was typed, not "dump .: is
    a folder". A fifo or symlink loop is said to be one, not "no such file", and the error names
    the argument that gave the path (quantize's ``DUMP``, verify's ``--dump``)."""
    out = tmp_path / "out.st"
    assert_one_line_error(invoke("quantize", "", "-o", out), "DUMP: expected a file path, got ''")
    assert_one_line_error(invoke("verify", "--dump", ""), "--dump: expected a file path, got ''")
    fifo = tmp_path / "fifo.st"
    os.mkfifo(fifo)
    loop = tmp_path / "loop.st"
    loop.symlink_to(loop)
    for path, needle in ((fifo, "is a fifo"), (loop, "is a symlink loop")):
        assert_one_line_error(invoke("quantize", path, "-o", out), f"DUMP {path}: {needle}")
        assert_one_line_error(invoke("verify", "--dump", path), f"--dump {path}: {needle}")
    assert not out.exists()


def test_a_file_that_is_no_dump_names_the_argument(small_dump: Path, tmp_path: Path) -> None:
    """Giving the FP8 cache (quantize's own output) or a foreign safetensors file as the dump is
    the likeliest mistake; its error names the argument (``DUMP``, ``--dump``) as the errors
    about a missing or unreadable file do, not only the path."""
    cache = tmp_path / "c.safetensors"
    assert invoke("quantize", small_dump, "-o", cache, "--configs", "snap").exit_code == 0
    foreign = tmp_path / "weights.safetensors"
    save_file({"w": torch.zeros(2)}, str(foreign))
    out = tmp_path / "out.st"
    for path, needle in ((cache, "not a snapmla-kv-dump file (metadata format='snapmla-fp8-cache')"),
                         (foreign, "not a snapmla-kv-dump file (metadata format=None)")):
        assert_one_line_error(invoke("quantize", path, "-o", out), f"DUMP {path}: {needle}")
        assert_one_line_error(invoke("verify", "--dump", path), f"--dump {path}: {needle}")
    layerless = _bad_dump(tmp_path, "l.st", {"layers.0.kv": torch.zeros(4, 512)})
    assert_one_line_error(invoke("verify", "--dump", layerless), f"--dump {layerless}: layer 0")
    assert not out.exists()


def test_a_layer_number_longer_than_int_reads_is_a_usage_error(tmp_path: Path) -> None:
    """A dump key ``layers.<5,000 digits>.kv`` made int() raise: exit code 3 ("internal error")
    in quantize and verify instead of a one-line error naming the argument."""
    dump = _bad_dump(tmp_path, "long.st", {f"layers.{'1' * 5000}.kv": torch.zeros(4, D_QK)})
    out = tmp_path / "out.st"
    assert_one_line_error(invoke("quantize", dump, "-o", out), f"DUMP {dump}", "5000 digits")
    assert_one_line_error(invoke("verify", "--dump", dump), f"--dump {dump}", "5000 digits")
    assert not out.exists()


def test_a_dump_path_that_is_not_utf8_is_read(small_dump: Path, tmp_path: Path) -> None:
    """safetensors opens UTF-8 paths only: a valid dump at a non-UTF-8 file name (which synth
    writes) was refused as "not a safetensors file", later as "rename the file". It is read
    through /proc/self/fd now, and quantize records its name with the odd byte escaped."""
    named = tmp_path / os.fsdecode(b"kv-\xfe.safetensors")
    shutil.copyfile(small_dump, named)
    out = tmp_path / "out.st"
    quantized = invoke("quantize", named, "-o", out)
    assert quantized.exit_code == 0, quantized.output
    assert read_fp8_cache(out).extra_metadata["source"] == str(tmp_path / "kv-\\xfe.safetensors")
    verified = invoke("verify", "--dump", named, "--ctx", "1k", "--heads", "16")
    assert verified.exit_code == 0, verified.output


def test_quantize_refuses_more_probe_queries_than_the_host_holds(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A dump without queries gets --queries synthetic probes; 10^5 of them (1.6 M rows of 16
    heads) need far more than 1 GiB, and are refused with the sizes before any output."""
    dump, out = tmp_path / "noq.st", tmp_path / "out.st"
    assert invoke("synth", "-o", dump, *SYNTH, "--queries", "0").exit_code == 0
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 2**30)
    assert_one_line_error(invoke("quantize", dump, "-o", out, "--queries", "100000"),
                          "--queries 100000 (1600000 query rows x 64 tokens of layer 0)",
                          "GiB of host memory", "1.0 GiB available")
    assert not out.exists()
    result = invoke("quantize", dump, "-o", out, "--queries", "2", "--configs", "snap")
    assert result.exit_code == 0, result.output


def test_quantize_refuses_a_repeated_config_before_any_work(small_dump: Path, tmp_path: Path) -> None:
    report, out = tmp_path / "r.json", tmp_path / "c.st"
    result = invoke("quantize", small_dump, "-o", out, "--json", report, "--configs", "snap,A,snap")
    assert_one_line_error(result, "--configs: snap given twice")
    assert not out.exists() and not report.exists()


def test_verify_passes_on_cpu(tmp_path: Path) -> None:
    report = tmp_path / "v.json"
    result = invoke("verify", "--ctx", "2k", "--heads", "16", "--mtp", "1,2", "--device", "cpu", "--json", report)
    assert result.exit_code == 0, result.output
    assert "2/2 cases pass" in result.stdout
    data = json.loads(report.read_text())
    assert (data["format"], data["version"]) == ("snapmla-verify", "1")
    assert data["passed"] and [c["mtp"] for c in data["cases"]] == [1, 2]
    assert data["cases"][0]["implementations"][0]["name"] == "emul"
    assert data["kernels_not_run"] == "the run is on the CPU, which checks the emulation"
    assert data["gates"]["lse_max_abs"] == 1e-2


def test_verify_on_a_dump_with_its_queries(small_dump: Path) -> None:
    result = invoke("verify", "--dump", small_dump, "--layer", 1, "--heads", 4, "--mtp", 1, "--batch", 2,
                    "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert "dump layer 1" in result.stdout
    assert_one_line_error(invoke("verify", "--dump", small_dump, "--layer", 9), "--layer 9")
    assert_one_line_error(invoke("verify", "--dump", small_dump, "--ctx", "4k"), "only 1024 tokens")


def test_verify_reads_only_the_layer_it_checks(small_dump: Path, tmp_path: Path) -> None:
    """A NaN in layer 0 stops a check of layer 0, not one of layer 1: verify --dump reads the
    one layer it uses (a model's dump holds 61)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(small_dump))
    with safe_open(str(small_dump), framework="pt") as handle:
        metadata = handle.metadata()
    tensors["layers.0.kv"][5, 9] = float("nan")
    poisoned = tmp_path / "poisoned.safetensors"
    save_file(tensors, str(poisoned), metadata=metadata)
    result = invoke("verify", "--dump", poisoned, "--layer", 1, "--heads", 4, "--mtp", 1, "--batch", 2,
                    "--ctx", 256, "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert_one_line_error(invoke("verify", "--dump", poisoned, "--layer", 0, "--ctx", 256),
                          f"--dump {poisoned}: layer 0: kv holds NaN/inf (first at token 5)")


def test_verify_exits_1_when_a_gate_fails() -> None:
    result = invoke("verify", "--ctx", 256, "--heads", 4, "--mtp", 1, "--device", "cpu",
                    "--gate-floor-factor", "0.5", "--gate-floor-abs", "0")
    assert result.exit_code == 1, result.output
    assert "FAIL" in result.stdout


def test_info_works_without_a_gpu() -> None:
    result = invoke("info")
    assert result.exit_code == 0, result.output
    assert "torch:" in result.stdout and "tuning database" in result.stdout
    assert result.stdout.startswith("snapmla ") and "kernel sources" in result.stdout.splitlines()[0]
    if not torch.cuda.is_available():
        assert "GPU: none" in result.stdout


@pytest.mark.parametrize("command", [name for name, *_ in COMMANDS])
def test_help_for_every_command(command: str) -> None:
    registered = {c.name for c in app.registered_commands}
    assert command in registered  # every command's module ships with the package: none may drop out
    result = invoke(command, "--help")
    assert result.exit_code == 0, result.output
    assert "Usage" in result.stdout


@pytest.mark.parametrize("lines", [1, 5, 10, 20, 30])
def test_a_reader_that_left_ends_the_command_quietly(lines: int) -> None:
    """``snapmla quantize --help | head -N``: stdout's reader leaves after N lines, wherever that
    falls among the command's writes. The command ends quietly: status 0 (it had written
    everything) or rich's 1, and no error line or traceback on stderr (at N = 20 the help used to
    end in "error: [Errno 32] Broken pipe", exit 2)."""
    command = [sys.executable, "-c", "from snapmla_cli.cli.app import main; main()", "quantize", "--help"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        for _ in range(lines):
            proc.stdout.readline()
        proc.stdout.close()
        errors = proc.stderr.read().decode()
        status = proc.wait(timeout=120)
    assert status in (0, 1) and errors == "", (status, errors)


@pytest.mark.parametrize("args", [
    ("info",),
    ("verify", "--ctx", "256", "--heads", "2", "--mtp", "1"),
    ("bench", "--cpu-fake", "--ctx", "1k", "--batch", "1", "--layers", "1", "--quiet"),
], ids=lambda args: args[0])
def test_a_reader_that_left_does_not_cost_the_json_file(args: tuple[str, ...], tmp_path: Path) -> None:
    """``snapmla verify --json r.json | head -1``: the command ends quietly at its first print
    once stdout's reader has left, so the --json file must have been written before the report
    (verify, info and bench wrote it after the tables, and a run of minutes left no file)."""
    report = tmp_path / "r.json"
    command = [sys.executable, "-c", "from snapmla_cli.cli.app import main; main()", *args, "--json", str(report)]
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader has left before the first line
    try:
        done = subprocess.run(command, check=False, stdout=write_end, stderr=subprocess.PIPE, timeout=300)
    finally:
        os.close(write_end)
    assert done.returncode == 1 and b"error" not in done.stderr, done  # rich's exit for a stdout gone
    assert json.loads(report.read_text())["format"].startswith(f"snapmla-{args[0]}")


def test_version_names_the_package_and_the_kernel_sources(monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    from snapmla_cli import __version__
    from snapmla_cli.runtime.nvrtc import KERNEL_DIR_ENV, kernel_dir, product_sources_hash

    result = invoke("--version")
    assert result.exit_code == 0, result.output
    assert result.stdout == f"snapmla {__version__} (kernel sources {product_sources_hash(kernel_dir())})\n"
    # without kernel sources the version still prints, with the reason in place of the hash
    monkeypatch.setenv(KERNEL_DIR_ENV, str(tmp_path / "absent"))
    result = invoke("--version", "info")  # eager: nothing after it runs
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"snapmla {__version__} (kernel sources: folder ")
    assert "absent" in result.stdout and KERNEL_DIR_ENV in result.stdout and "GPU" not in result.stdout
    # a source that cannot be read (root reads any file, so the read is made to fail): the
    # version line names the trouble, no traceback
    from snapmla_cli.runtime import nvrtc

    def unreadable(folder: Path, skip: tuple[str, ...] = ()) -> str:
        raise PermissionError(13, "Permission denied", str(folder / "x.cu"))

    monkeypatch.delenv(KERNEL_DIR_ENV)
    monkeypatch.setattr(nvrtc, "source_tree_hash", unreadable)
    result = invoke("--version")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"snapmla {__version__} (kernel sources: ") and "x.cu" in result.stdout


def test_a_kernel_dir_that_is_a_file_is_named_as_a_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """$SNAPMLA_KERNEL_DIR naming a file said "folder <file> not found": the file is there."""
    from snapmla_cli.runtime.nvrtc import KERNEL_DIR_ENV

    afile = tmp_path / "kernels.tar"
    afile.write_text("x")
    monkeypatch.setenv(KERNEL_DIR_ENV, str(afile))
    result = invoke("--version")
    assert result.exit_code == 0, result.output
    assert f"(kernel sources: {afile} is a file, expected a folder (set {KERNEL_DIR_ENV}" in result.stdout
    assert "not found" not in result.stdout


def test_top_level_help_lists_the_commands() -> None:
    result = invoke("--help")
    assert result.exit_code == 0
    for name in ("synth", "quantize", "verify", "info"):
        assert name in result.stdout


def test_sizes() -> None:
    assert parse_size("32k") == 32768 and parse_size("32768") == 32768 and parse_size("1m") == 1 << 20
    assert parse_size(" 2K ") == 2048 and parse_size_list("16,64,128") == [16, 64, 128]
    assert parse_size_list(" 16k , 64k") == [16384, 65536]  # whitespace around an item is allowed
    with pytest.raises(SnapmlaError, match="^--heads: '0' is not a positive integer"):
        parse_int_list("16,0", "--heads", 128)
    assert format_size(32768) == "32k" and format_size(1000) == "1000"
    assert parse_size("0" * 30 + "32k") == 32768  # leading zeros do not make a size too large
    assert format_size(0) == "0" and format_size(3 << 20) == "3m" and format_size(1536) == "1536"
    assert shorten("7" * 24) == "7" * 24 and shorten("7" * 25) == "7" * 21 + "..."  # at most 24 characters
    for bad in ("", "k", "1.5k", "-3", "4g"):
        with pytest.raises(SnapmlaError, match=f"^--ctx: '{bad}' is not a size \\(expected e.g. 2048, 32k or 1m\\)$"):
            parse_size(bad, "--ctx")
    with pytest.raises(SnapmlaError, match="^--ctx: '0' must be at least 1$"):
        parse_size("0", "--ctx")


def test_a_comma_list_with_an_empty_item_is_refused() -> None:
    """An empty item (``16,,64``, ``1,``, ``,2``, ``8, ,16``) is an error naming the option, the
    item's place and an example, not skipped: it is most often a value left out, and running
    fewer cases than were typed would hide it. Whitespace around an item stays allowed."""
    assert split_list(" 16, 64 ", "--heads", "16,64") == [" 16", " 64 "]
    with pytest.raises(SnapmlaError, match=r"^--heads: '16,,64' has an empty item \(item 2 of 3; expected e\.g\. 16,64\)$"):
        parse_int_list("16,,64", "--heads", 128)
    for text, position in ((",2", "1 of 2"), ("1,", "2 of 2"), ("8, ,16", "2 of 3"), (" , ", "1 of 2")):
        with pytest.raises(SnapmlaError, match=f"^--mtp: .* has an empty item \\(item {position};"):
            parse_int_list(text, "--mtp", 16, example="1,2")
    with pytest.raises(SnapmlaError, match=r"^--ctx: '16k,,32k' has an empty item"):
        parse_size_list("16k,,32k", "--ctx")
    with pytest.raises(SnapmlaError, match=r"^--ctx: '' is empty \(expected e\.g\. 16k,64k\)$"):
        parse_size_list("", "--ctx")


@pytest.mark.parametrize("args", [
    ("verify", "--heads", "16,,64"),
    ("verify", "--mtp", "1,"),
    ("verify", "--fp8-kernel", "default,,v3"),
    ("tune", "--dry-run", "--heads", "16,,64"),
    ("tune", "--dry-run", "--mtp", ",1"),
    ("tune", "--dry-run", "--batch", "1, ,8"),
    ("tune", "--dry-run", "--ctx", "16k,,32k"),
    ("bench", "--cpu-fake", "--ctx", "16k,,32k"),
    ("bench", "--cpu-fake", "--layout", "dp1tp1,"),
    ("quantize", "--configs", "snap,,A"),
    ("dump", "--layers", "0,,5"),
])
def test_list_options_refuse_an_empty_item_in_one_line(args: tuple[str, ...], tmp_path: Path) -> None:
    """Through the CLI: every comma-list option (sizes.split_list) stops at an empty item with one
    `error:` line naming the option, exit code 2 and no traceback, before any work."""
    command, option, value = args[0], args[-2], args[-1]
    extra: tuple[object, ...] = ()
    if command == "quantize":
        extra = ("-o", tmp_path / "o.st")
    elif command == "dump":
        prompts = tmp_path / "p.txt"
        prompts.write_text("hello\n")
        extra = ("--model", tmp_path, "--prompts", prompts, "-o", tmp_path / "d.st")
    assert_one_line_error(invoke(*args, *extra), f"{option}: {value!r} has an empty item")
    assert not any(tmp_path.glob("*.st"))


def test_host_memory_reads_kib_and_allows_exactly_what_is_available(tmp_path: Path, monkeypatch) -> None:
    """/proc/meminfo counts kB as 1024 bytes; a need of exactly the available bytes passes,
    one byte more is refused naming what needed it."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       4000 kB\nMemAvailable:    3000 kB\nCached: 7 kB\n")
    monkeypatch.setattr(host_memory, "MEMINFO", meminfo)
    assert host_memory.available_bytes() == 3000 * 1024
    host_memory.require_host_memory("--batch", 3000 * 1024)
    with pytest.raises(SnapmlaError, match="^--batch: needs about"):
        host_memory.require_host_memory("--batch", 3000 * 1024 + 1)
    with pytest.raises(SnapmlaError, match="^--ctx: needs about 79,473 GiB of host memory"):
        host_memory.require_host_memory("--ctx", 79473 * 2**30)  # not 7.95e+04


def test_the_repeated_queries_note_counts_exactly_the_rows_a_dump_holds() -> None:
    """A dump layer with 4 queries of 8 heads: batch 2 x s_q 2 uses exactly its 4 queries (no
    note); batch 3 repeats them, and h_q 16 repeats its heads."""
    from snapmla_cli.analysis.verify import ProblemSource
    from snapmla_cli.cache.dump_file import LayerDump
    from snapmla_cli.cli.verify import _repeated_queries_note

    gen = torch.Generator().manual_seed(13)
    dump = LayerDump(5, torch.randn(64, 576, generator=gen), queries=torch.randn(4, 8, 576, generator=gen))
    source = ProblemSource(layer=5, dump=dump)
    assert _repeated_queries_note(source, [8], [1, 2], 2) is None
    note = _repeated_queries_note(source, [8, 16], [2], 3)
    assert note is not None and "h_q 16 repeat its 8 heads" in note and "batch x s_q beyond 4" in note


def test_the_large_floor_note_starts_above_a_tenth() -> None:
    """Verify says that FP8 storage alone loses much of the output once the worst case's floor
    rel_l2 passes 0.1 (0.5 is far above the synthetic data's 3-6e-2), naming that case."""
    from types import SimpleNamespace

    from snapmla_cli.cli.verify import _large_floor_note
    from snapmla_cli.numerics.metrics import ErrorMetrics

    def case(rel: float, heads: int) -> SimpleNamespace:
        return SimpleNamespace(floor=ErrorMetrics(0.01, 0.02, rel, 0.3), heads=heads, mtp=2)

    assert _large_floor_note([case(0.04, 16), case(0.1, 64)]) is None  # type: ignore[list-item]
    note = _large_floor_note([case(0.04, 16), case(0.5, 64)])  # type: ignore[list-item]
    assert note is not None and note.startswith("note: FP8 storage alone is 0.5 (rel_l2)") and "h_q 64 s_q 2" in note


def test_the_emulation_missing_the_ref64_gate_is_explained_not_a_kernel_miss() -> None:
    """An emulation (no kernel) over the ref64 gate gets a note naming the worst case and the
    gate's factor (random-normal caches with spread attention: about 1.3x the floor); a short
    context keeps its own reason; a kernel's miss or a pass gets no note."""
    from snapmla_cli.analysis.verify import EMULATION, CaseResult, GateCheck, Gates, ImplResult
    from snapmla_cli.cli.verify import SHORT_CONTEXT, _emulation_miss_note
    from snapmla_cli.numerics.metrics import ErrorMetrics

    def case(name: str, rel: float, floor: float, ctx: int = 32768, heads: int = 16) -> CaseResult:
        limit = 1.1 * floor + 1e-3
        impl = ImplResult(name, "fp8", ErrorMetrics(0.0, 0.0, rel, 0.0), ErrorMetrics(0.0, 0.0, 0.0, 0.0), None,
                          [GateCheck("rel_l2 vs ref64", rel, limit)], 0.1)
        return CaseResult(heads, 1, 1, ctx, True, ErrorMetrics(0.0, 0.0, floor, 0.0), [impl])

    gates = Gates()
    assert _emulation_miss_note([case(EMULATION, 0.026, 0.026)], gates) is None
    assert _emulation_miss_note([case("fp8-kernel", 0.05, 0.026)], gates) is None
    note = _emulation_miss_note([case(EMULATION, 0.030, 0.026), case(EMULATION, 0.035, 0.026, heads=64)], gates)
    assert note is not None and "misses the ref64 gate at h_q 64 s_q 1 (0.035 against a floor of 0.026)" in note
    assert "--gate-floor-factor (1.1)" in note
    short = _emulation_miss_note([case(EMULATION, 0.2, 0.05, ctx=SHORT_CONTEXT - 1)], gates)
    assert short is not None and "averaged over few keys" in short


def test_the_table_shows_each_rows_own_gates_limit_and_lse() -> None:
    """The `limit` beside rel_l2 is rel_l2's (a BF16 row, gated on cos_diff, shows none: its
    5e-6 there read as a failure marked PASS), and `lse max_abs` is the gated value: an FP8
    kernel's against the emulation, not against ref64."""
    from rich.console import Console

    from snapmla_cli.analysis.verify import (
        EMULATION,
        LSE_GATE_PREFIX,
        REL_L2_GATE,
        CaseResult,
        GateCheck,
        Gates,
        ImplResult,
        synthetic_source,
    )
    from snapmla_cli.cli.verify import _render
    from snapmla_cli.numerics.metrics import ErrorMetrics

    def metrics(rel: float, max_abs: float = 0.0) -> ErrorMetrics:
        return ErrorMetrics(1e-3, 1e-7, rel, max_abs)

    emul = ImplResult(EMULATION, "fp8", metrics(0.0261), metrics(0.0, 0.0123), None,
                      [GateCheck(REL_L2_GATE, 0.0261, 0.0297)], 0.1)
    fp8 = ImplResult("fp8-kernel", "fp8", metrics(0.0262), metrics(0.0, 0.0647), metrics(0.0011),
                     [GateCheck(REL_L2_GATE, 0.0262, 0.0297), GateCheck(f"{LSE_GATE_PREFIX}emul", 0.000456, 0.01)], 0.1)
    bf16 = ImplResult("bf16-kernel", "bf16", metrics(0.00167), metrics(0.0, 0.000789), None,
                      [GateCheck("cos_diff vs ref64", 1e-7, 5e-6), GateCheck(f"{LSE_GATE_PREFIX}ref64", 0.000789, 0.01)],
                      0.1)
    case = CaseResult(16, 1, 1, 32768, True, metrics(0.0261), [emul, fp8, bf16])
    out = Console(record=True, width=300)
    _render(out, [case], synthetic_source(None), "cuda", Gates())
    rows = {line.split("│")[3].strip(): [c.strip() for c in line.split("│")[1:-1]]
            for line in out.export_text().splitlines() if line.count("│") > 10 and "impl" not in line}
    limit, lse = 5, 8  # columns: h_q, s_q, impl, rel_l2, floor, limit, cos_diff, rmse, lse max_abs, ...
    assert rows["bf16-kernel"][limit] == "-" and rows["fp8-kernel"][limit] == "2.970e-02"
    assert rows["fp8-kernel"][lse] == "4.560e-04"  # vs emul (its lse vs ref64 is 6.47e-2)
    assert rows["bf16-kernel"][lse] == "7.890e-04" and rows[EMULATION][lse] == "1.230e-02"


def test_counts_take_the_right_number(tmp_path: Path) -> None:
    assert counted(1, "layer") == "1 layer" and counted(0, "layer") == "0 layers"
    assert counted(1, "query", "queries") == "1 query" and counted(3, "query", "queries") == "3 queries"
    result = invoke("synth", "-o", tmp_path / "one.st", "--layers", 1, "--tokens", 64, "--queries", 1, "--heads", 4)
    assert result.exit_code == 0, result.output
    assert "(1 layer x 64 tokens," in result.stdout


def test_verify_explains_a_short_context_miss() -> None:
    """At 50 tokens (one partial block) P's E4M3 rounding alone takes the emulation past the
    ref64 gate in this seeded case; verify fails it and says why."""
    result = invoke("verify", "--ctx", "50", "--seed", "1", "--heads", "64", "--mtp", "1", "--device", "cpu")
    assert result.exit_code == 1, result.output
    assert "FAIL: rel_l2 vs ref64" in result.output and "note: at 50 tokens" in result.output
    long_ctx = invoke("verify", "--ctx", "2k", "--seed", "1", "--heads", "64", "--mtp", "1", "--device", "cpu")
    assert long_ctx.exit_code == 0 and "note:" not in long_ctx.output


def test_quantize_labels_the_synthetic_defaults_probes_synthetic(tmp_path: Path) -> None:
    """Without a DUMP the probes are synthetic (probe_queries), not "the dump's own queries"."""
    report = tmp_path / "r.json"
    result = invoke("quantize", "-o", tmp_path / "c.st", "--json", report, "--layers", "1", "--tokens", "256",
                    "--configs", "snap")
    assert result.exit_code == 0, result.output
    assert [layer["probes"] for layer in json.loads(report.read_text())["layers"]] == ["synthetic"]
    assert "synthetic queries" in " ".join(result.stdout.split())


def test_a_zero_error_layer_is_a_gap_in_the_fidelity_plot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer with zero error (all-zero KV) on the log axes was drawn at 1e-300, stretching
    every panel over 300 decades; it is now a gap, and the panel names the layer."""
    import matplotlib.pyplot as plt

    from snapmla_cli.analysis.fidelity import METRICS, FidelityReport, LayerFidelity
    from snapmla_cli.analysis.plot import plot_fidelity
    from snapmla_cli.numerics.metrics import ErrorMetrics

    def layer(index: int, err: float) -> LayerFidelity:
        metrics = ErrorMetrics(err, err, err, err)
        return LayerFidelity(index, 64, 8, "synthetic", {"output": {"snap": metrics}})

    figures: list = []
    monkeypatch.setattr(plt, "close", figures.append)
    report = FidelityReport(layers=[layer(0, 2e-2), layer(1, 0.0), layer(2, 3e-2)], configs=["snap"])
    plot_fidelity(report, tmp_path / "f.png")
    axes = figures[0].axes
    assert len(axes) == len(METRICS)
    for ax in axes:
        low, high = ax.get_ylim()
        assert low > 1e-4 and high < 1.0, (low, high)
        assert any("0 (not drawn) at layer 1" in t.get_text() for t in ax.texts)
    assert (tmp_path / "f.png").stat().st_size > 0


def test_the_mean_tables_title_names_every_kind_of_probe() -> None:
    """A dump with its own queries in some layers only: the title once named layer 0's probes."""
    from snapmla_cli.analysis.fidelity import LayerFidelity
    from snapmla_cli.cli.quantize import _probe_summary

    def layer(rows: int, probes: str) -> LayerFidelity:
        return LayerFidelity(0, 64, rows, probes, {})

    assert _probe_summary([layer(32, "dump"), layer(32, "dump")]) == "32 probe rows/layer, dump queries"
    assert _probe_summary([layer(32, "dump"), layer(64, "synthetic"), layer(32, "dump")]) == (
        "layers differ: 32 probe rows/layer, dump queries; 64 probe rows/layer, synthetic queries")


def test_a_ctx_past_the_dumps_end_is_named_before_the_memory_estimate(small_dump: Path) -> None:
    """`verify --dump d --ctx 2m` said the batch times the context needed 48.8 GiB, pointing at
    --batch; the dump holds fewer tokens than asked for."""
    result = invoke("verify", "--dump", small_dump, "--ctx", "2m")
    assert_one_line_error(result, "--ctx 2097152: dump layer 2 has only 1024 tokens")
    assert "host memory" not in result.stderr
