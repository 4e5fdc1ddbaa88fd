"""`snapmla quantize` on a GPU writes the same FP8 cache file as on the CPU (issue 3)."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from snapmla_cli.cache.fp8_file import quantize_layer_cache, read_fp8_cache
from snapmla_cli.cli.app import app

pytestmark = pytest.mark.gpu


def test_layer_cache_bytes_equal_on_cpu_and_gpu():
    gen = torch.Generator().manual_seed(11)
    kv = (torch.randn(1000, 576, generator=gen) * torch.logspace(-3, 2, 1000)[:, None]).to(torch.bfloat16)
    assert torch.equal(quantize_layer_cache(kv, "cuda"), quantize_layer_cache(kv, "cpu"))


def test_quantize_command_same_file_on_cpu_and_gpu(tmp_path):
    dump = tmp_path / "d.safetensors"
    runner = CliRunner()
    assert runner.invoke(app, ["synth", "-o", str(dump), "--layers", "2", "--tokens", "1000"]).exit_code == 0
    outs = {}
    for device in ("cpu", "cuda"):
        out = tmp_path / f"{device}.safetensors"
        result = runner.invoke(app, ["quantize", str(dump), "-o", str(out), "--device", device,
                                     "--configs", "snap"])
        assert result.exit_code == 0, result.output
        outs[device] = read_fp8_cache(out)
    for a, b in zip(outs["cpu"].layers, outs["cuda"].layers, strict=True):
        assert torch.equal(a.cache, b.cache)
        assert int(a.seqlen) == int(b.seqlen)
