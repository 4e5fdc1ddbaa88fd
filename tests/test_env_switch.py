"""The environment switches' one parser (``snapmla_cli.env_switch``) and the switches that use it."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

from snapmla_cli import env_switch as env_switch_module
from snapmla_cli.env_switch import env_switch
from snapmla_cli.ops import cluster_fold
from snapmla_cli.runtime import pdl

NAME = "SNAPMLA_TEST_SWITCH"


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", " yes ", "On"])
@pytest.mark.parametrize("default", [False, True])
def test_on_spellings_turn_the_switch_on(monkeypatch: pytest.MonkeyPatch, raw: str, default: bool) -> None:
    monkeypatch.setenv(NAME, raw)
    assert env_switch(NAME, default) is True


@pytest.mark.parametrize("raw", ["0", "false", "False", " no", "OFF"])
@pytest.mark.parametrize("default", [False, True])
def test_off_spellings_turn_the_switch_off(monkeypatch: pytest.MonkeyPatch, raw: str, default: bool) -> None:
    monkeypatch.setenv(NAME, raw)
    assert env_switch(NAME, default) is False


@pytest.mark.parametrize("default", [False, True])
def test_unset_or_empty_keeps_the_default_without_a_warning(monkeypatch: pytest.MonkeyPatch, default: bool) -> None:
    monkeypatch.delenv(NAME, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert env_switch(NAME, default) is default
        monkeypatch.setenv(NAME, "  ")
        assert env_switch(NAME, default) is default


def test_an_unknown_value_keeps_the_default_and_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(env_switch_module, "_warned", set())
    monkeypatch.setenv(NAME, "maybe")
    with pytest.warns(UserWarning, match=f"{NAME}='maybe' is neither on .* taken as off"):
        assert env_switch(NAME, False) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # read per call on the hot path: one warning is enough
        assert env_switch(NAME, False) is False


@pytest.mark.parametrize("raw", ["false", "off", "no"])
def test_pdl_and_the_cluster_merge_turn_off_with_any_off_spelling(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    """Only "0" turned them off before: SNAPMLA_PDL=false left the programmatic launch on."""
    for variable, enabled in (("SNAPMLA_PDL", pdl.enabled), ("SNAPMLA_CLUSTER_FOLD", cluster_fold.enabled)):
        monkeypatch.delenv(variable, raising=False)
        assert enabled(), variable
        monkeypatch.setenv(variable, raw)
        assert not enabled(), (variable, raw)


def test_the_finite_checks_switch_reads_false_as_off() -> None:
    """Anything but "" and "0" turned the checks on before, "false" included: a host read-back on
    every call and CUDA-graph capture refused, the opposite of what was asked."""
    code = "from snapmla_cli.ops.finite import GPU_CHECKS; print(GPU_CHECKS.on)"
    for value, expected in (("false", "False"), ("off", "False"), ("TRUE", "True"), ("yes", "True")):
        env = {**os.environ, "SNAPMLA_CHECK_FINITE": value}
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert result.stdout.strip() == expected, (value, result.stdout, result.stderr)
