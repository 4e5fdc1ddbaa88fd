"""A GPU the kernels are not built for (an A100, an L40S, a B200) is refused in one line that
names it, before NVRTC runs (whose ptxas log for a Hopper-only instruction on another target is
hundreds of lines); ``verify`` then checks the emulation alone and says so, ``info`` marks the GPU.
The machine is stood in for by monkeypatching torch's device queries, so this runs without a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_checks import assert_one_line_error, invoke

from snapmla_cli import __version__
from snapmla_cli.analysis import verify as verify_analysis
from snapmla_cli.cli import info
from snapmla_cli.cli import verify as verify_cli
from snapmla_cli.runtime import launch
from snapmla_cli.runtime.gpu_arch import (
    UnsupportedGpuError,
    common_archs,
    describe_archs,
    kernels_gpu_problem,
    require_arch,
    supported_archs,
    unsupported_reason,
)
from snapmla_cli.runtime.gpu_facts import GpuFacts, GpuListing
from snapmla_cli.tuning.measure import GpuMeasurer

A100 = ("NVIDIA A100-SXM4-80GB", (8, 0))
L40S = ("NVIDIA L40S", (8, 9))
H200 = ("NVIDIA H200", (9, 0))
B200 = ("NVIDIA B200", (10, 0))


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch):
    """``gpu(name, capability)``: torch reports that GPU as every device of the machine."""
    def install(name: str, capability: tuple[int, int]) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return install


def test_each_source_runs_where_it_is_registered() -> None:
    assert supported_archs("prep.cu") == ("sm_90a", "sm_89")
    for source in ("decode_fp8_wgmma.cu", "decode_bf16_wgmma.cu", "decode_fp8.cu", "combine.cu"):
        assert supported_archs(source) == ("sm_90a",)
    assert supported_archs("diag/wgmma_rate.cu") == ("sm_90a",)  # outside the registry: the default
    assert common_archs() == ("sm_90a",)  # a decode step needs every source


def test_the_reason_names_the_gpu_its_capability_and_what_the_kernel_needs() -> None:
    assert unsupported_reason("prep.cu", ("sm_90a", "sm_89"), 0, *H200) is None
    assert unsupported_reason("prep.cu", ("sm_90a", "sm_89"), 1, *L40S) is None
    assert unsupported_reason("x.cu", ("sm_90a",), 3, *A100) == (
        "cuda:3 (NVIDIA A100-SXM4-80GB, compute capability 8.0) cannot run x.cu: built for compute "
        "capability 9.0 (Hopper: H100, H200, H20, H800, GH200) only")
    reason = unsupported_reason("prep.cu", ("sm_90a", "sm_89"), 0, *B200)
    assert reason is not None and "10.0" in reason and "9.0 (Hopper" in reason and "or 8.9 (Ada" in reason
    assert describe_archs(("sm_100a",)) == "sm_100a"  # a target without a description still reads


@pytest.mark.parametrize("source, machine, refused", [
    ("decode_fp8_wgmma.cu", A100, True), ("decode_fp8_wgmma.cu", L40S, True), ("decode_fp8_wgmma.cu", B200, True),
    ("decode_fp8_wgmma.cu", H200, False), ("prep.cu", L40S, False), ("prep.cu", A100, True),
])
def test_require_arch(gpu, source: str, machine: tuple[str, tuple[int, int]], refused: bool) -> None:
    gpu(*machine)
    if refused:
        with pytest.raises(UnsupportedGpuError, match=f"^cuda:0 \\({machine[0]}, compute capability"):
            require_arch(source, 0)
    else:
        require_arch(source, 0)


def test_a_kernel_load_is_refused_before_nvrtc_runs(gpu, monkeypatch: pytest.MonkeyPatch) -> None:
    gpu(*A100)
    monkeypatch.setattr(launch, "require_gpu", lambda: None)

    def no_compile(*args: object, **kwargs: object) -> None:
        raise AssertionError("compiled for a GPU the kernel is not built for")

    monkeypatch.setattr(launch, "compile_module", no_compile)
    with pytest.raises(UnsupportedGpuError, match="cannot run decode_fp8_wgmma.cu: built for compute capability 9.0"):
        launch.get_kernel("decode_fp8_wgmma.cu", "snapmla_decode_fp8_wgmma", device=0)
    gpu(*H200)  # the same call on a Hopper GPU reaches the compile
    with pytest.raises(AssertionError, match="compiled for"):
        launch.get_kernel("decode_fp8_wgmma.cu", "snapmla_decode_fp8_wgmma", device=0)


def test_the_tuner_refuses_before_its_first_candidate(gpu, monkeypatch: pytest.MonkeyPatch) -> None:
    gpu(*L40S)
    monkeypatch.setattr(launch, "require_gpu", lambda: None)
    with pytest.raises(UnsupportedGpuError, match=r"^cuda:0 \(NVIDIA L40S, compute capability 8.9\) cannot run "
                                                  "snapmla's kernels"):
        GpuMeasurer()


def test_kernels_gpu_problem(gpu) -> None:
    gpu(*H200)
    assert kernels_gpu_problem(0) is None
    gpu(*L40S)  # prep would run, the decode kernels not
    assert "cannot run snapmla's kernels" in str(kernels_gpu_problem(0))


def test_verify_refuses_named_kernels_on_such_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verify_cli, "resolve_device", lambda device: torch.device("cuda", 0))
    monkeypatch.setattr(verify_cli, "kernels_problem", lambda device: "cuda:0 (NVIDIA A100) cannot run them")
    assert_one_line_error(invoke("verify", "--ctx", 256, "--heads", 4, "--mtp", 1, "--fp8-kernel", "v3"),
                          "--fp8-kernel v3: cuda:0 (NVIDIA A100) cannot run them")


def test_verify_checks_the_emulation_alone_and_says_why(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The GPU is stood in for by the CPU (the problems cannot move to a GPU here): what is
    checked is that no kernel runs, the note says why, and the JSON records it."""
    reason = "cuda:0 (NVIDIA A100) cannot run snapmla's kernels"
    monkeypatch.setattr(verify_cli, "kernels_problem", lambda device: reason)
    asked: list[bool] = []
    real = verify_cli.default_implementations

    def recorded(device: torch.device, fp8_kernels: tuple[str, ...], kernels: bool = True):
        asked.append(kernels)
        return real(torch.device("cuda"), fp8_kernels, kernels)  # on a GPU: would it add kernels?

    monkeypatch.setattr(verify_cli, "default_implementations", recorded)
    report = tmp_path / "verify.json"
    result = invoke("verify", "--ctx", 256, "--heads", 4, "--mtp", 1, "--device", "cpu", "--json", report)
    assert result.exit_code == 0, result.output
    assert asked == [False]
    assert f"note: no kernel ran ({reason})" in " ".join(result.stdout.split())
    data = json.loads(report.read_text())
    assert data["kernels_not_run"] == reason
    assert [impl["name"] for case in data["cases"] for impl in case["implementations"]] == ["emul"]


def test_kernels_problem_is_none_on_the_cpu() -> None:
    assert verify_analysis.kernels_problem(torch.device("cpu")) is None


def test_default_implementations_leave_the_kernels_out_when_told() -> None:
    cuda = torch.device("cuda")
    assert [i.name for i in verify_analysis.default_implementations(cuda, ("default",), kernels=False)] == ["emul"]
    names = [i.name for i in verify_analysis.default_implementations(cuda, ("default",))]
    assert names[:3] == ["emul", "fp8-kernel", "bf16-kernel"]


def _facts(index: int, name: str, capability: tuple[int, int]) -> GpuFacts:
    return GpuFacts(index=index, name=name, uuid=f"GPU-{index}", sm_count=132, compute_capability=capability,
                    memory_bytes=80 * 2**30, max_sm_clock_mhz=1980, max_mem_clock_mhz=2619,
                    driver_version="580.00", cuda_driver_version="13.0")


def test_info_marks_the_gpus_the_kernels_do_not_run_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(info, "list_gpus", lambda: GpuListing([_facts(0, *H200), _facts(1, *A100)]))
    monkeypatch.setattr(info, "describe_survey", lambda survey: ["tuning database folders: none"])
    result = invoke("info")
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[2].strip(): line.split("│")[-2].strip()
            for line in result.stdout.splitlines() if line.count("│") > 10 and "NVIDIA" in line}
    assert rows == {"NVIDIA H200": "yes", "NVIDIA A100-SXM4-80GB": "no"}
    assert "snapmla's kernels are built for compute capability 9.0 (Hopper" in " ".join(result.stdout.split())
    monkeypatch.setattr(info, "list_gpus", lambda: GpuListing([_facts(0, *H200)]))
    assert "snapmla's kernels are built for" not in invoke("info").stdout


def test_info_json_holds_the_gpus_the_toolchain_and_the_database(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    monkeypatch.setattr(info, "list_gpus", lambda: GpuListing([_facts(0, *H200), _facts(1, *A100)]))
    path = tmp_path / "info.json"
    result = invoke("info", "--json", path)
    assert result.exit_code == 0, result.output
    data = json.loads(path.read_text())
    assert data["format"] == info.INFO_JSON_FORMAT and data["snapmla_version"] == __version__
    assert [(g["name"], g["compute_capability"], g["sm_count"], g["runs_kernels"]) for g in data["gpus"]] == [
        ("NVIDIA H200", [9, 0], 132, True), ("NVIDIA A100-SXM4-80GB", [8, 0], 132, False)]
    assert data["no_gpu_reason"] is None and data["kernel_archs"] == ["sm_90a"]
    assert data["toolchain"]["torch_version"] == torch.__version__
    assert [g["name"] for g in data["tuning"]["gpus"]] == ["NVIDIA H200", "NVIDIA A100-SXM4-80GB"]
    assert {f["origin"] for f in data["tuning"]["folders"]} <= {"user", "shipped"}
    assert_one_line_error(invoke("info", "--json", path), "--json", "--force")  # never overwritten silently
    assert invoke("info", "--json", path, "--force").exit_code == 0
