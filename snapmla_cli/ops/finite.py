"""NaN / inf checks of the floating inputs of the token-preparation and decode calls.

A non-finite value in a query row makes that row's output NaN; in a K row passed to
``append_kv`` it is worse: the token's scale becomes inf or NaN and the cache row stays poisoned
for every later decode of that request. So the inputs are checked, with a one-line error that
names the argument:

- on the CPU paths (the reference numerics, ``snapmla quantize`` and the tests), always;
- on CUDA only when ``SNAPMLA_CHECK_FINITE=1`` is set (or :func:`set_gpu_checks` turns it on):
  the check reads a GPU reduction back to the host, a synchronization per call that an engine's
  decode loop cannot afford and that CUDA-graph capture forbids. It is a debugging switch: turn
  it on to find which call first receives a NaN.
"""

from __future__ import annotations

import os

import torch

from ..errors import SnapmlaError

ENV_VAR = "SNAPMLA_CHECK_FINITE"


class _GpuChecks:
    """Whether CUDA inputs are checked: read from the environment once at import (the hot path
    then pays one attribute read), changed at run time by :func:`set_gpu_checks`."""

    on: bool = os.environ.get(ENV_VAR, "0").strip() not in ("", "0")


GPU_CHECKS = _GpuChecks()


def set_gpu_checks(enabled: bool) -> None:
    """Turn the NaN / inf checks of CUDA inputs on or off for this process. Only a bool: the
    string "false" is truthy, and a switch that reads it as "on" silently does the opposite."""
    if not isinstance(enabled, bool):
        raise SnapmlaError(f"enabled: expected True or False, got {enabled!r}")
    GPU_CHECKS.on = enabled


def check_finite(name: str, t: torch.Tensor) -> None:
    """Raise a one-line :class:`SnapmlaError` when ``t`` holds NaN or inf (see
    :func:`check_all_finite`)."""
    check_all_finite((name, t))


def check_all_finite(*named: tuple[str, torch.Tensor]) -> None:
    """Raise a one-line :class:`SnapmlaError` naming the first of ``named`` that holds NaN or
    inf. CUDA tensors are checked only while :data:`GPU_CHECKS` is on, all of them with one
    read-back (each read-back waits for the GPU), and never inside CUDA-graph capture, where a
    read-back is not allowed: the error says to capture without the switch."""
    tensors = [(name, t) for name, t in named
               if t.is_floating_point() and t.numel() and (GPU_CHECKS.on or not t.is_cuda)]
    if not tensors:
        return
    if any(t.is_cuda for _, t in tensors) and torch.cuda.is_current_stream_capturing():
        raise SnapmlaError(
            f"{tensors[0][0]}: {ENV_VAR}=1 cannot check values during CUDA-graph capture "
            "(it reads them back to the host); capture with the check off")
    alls = [torch.isfinite(t).all() for _, t in tensors]
    flags = torch.stack(alls).tolist() if len({a.device for a in alls}) == 1 else [bool(a) for a in alls]
    for (name, t), ok in zip(tensors, flags):
        if not ok:
            bad = int((~torch.isfinite(t)).sum())
            raise SnapmlaError(f"{name}: {bad} of {t.numel()} values are NaN or inf (expected finite values)")
