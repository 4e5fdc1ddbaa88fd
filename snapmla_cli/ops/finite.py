"""NaN / inf checks of the floating inputs of the token-preparation and decode calls.

A non-finite value in a query row makes that row's output NaN; in a K row passed to
``append_kv`` it is worse: the token's scale becomes inf or NaN and the cache row stays poisoned
for every later decode of that request. So the inputs are checked, with a one-line error that
names the argument:

- on the CPU paths (the reference numerics, ``snapmla quantize`` and the tests), always;
- on CUDA only when ``SNAPMLA_CHECK_FINITE=1`` (or true / yes / on) is set (or :func:`set_gpu_checks` turns it on):
  the check reads a GPU reduction back to the host, a synchronization per call that an engine's
  decode loop cannot afford and that CUDA-graph capture forbids. It is a debugging switch: turn
  it on to find which call first receives a NaN.
"""

from __future__ import annotations

import torch

from ..env_switch import env_switch
from ..errors import SnapmlaError, show
from ..numerics.formats import D_CONTENT, D_QK
from ..numerics.quant import row_scale

ENV_VAR = "SNAPMLA_CHECK_FINITE"


class _GpuChecks:
    """Whether CUDA inputs are checked: read from the environment once at import (the hot path
    then pays one attribute read), changed at run time by :func:`set_gpu_checks`."""

    on: bool = env_switch(ENV_VAR, False)


GPU_CHECKS = _GpuChecks()


def set_gpu_checks(enabled: bool) -> None:
    """Turn the NaN / inf checks of CUDA inputs on or off for this process. Only a bool: the
    string "false" is truthy, and a switch that reads it as "on" silently does the opposite."""
    if not isinstance(enabled, bool):
        raise SnapmlaError(f"enabled: expected True or False, got {show(enabled)}")
    GPU_CHECKS.on = enabled


def capturing(t: torch.Tensor) -> bool:
    """True when ``t`` is on a GPU whose current stream is being captured into a CUDA graph, where
    reading values back to the host is not allowed; False for a CPU tensor without asking CUDA
    (a CPU-only torch cannot answer)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def check_finite(name: str, t: torch.Tensor) -> None:
    """Raise a one-line :class:`SnapmlaError` when ``t`` holds NaN or inf (see
    :func:`check_all_finite`)."""
    check_all_finite((name, t))


def check_all_finite(*named: tuple[str, torch.Tensor]) -> None:
    """Raise a one-line :class:`SnapmlaError` naming the first of ``named`` that holds NaN or
    inf. CUDA tensors are checked only while :data:`GPU_CHECKS` is on, all of them with one
    read-back (each read-back waits for the GPU), and never inside CUDA-graph capture, where a
    read-back is not allowed: the error says to capture without the switch."""
    # (a tensor without data, on 'meta', has no values to read: the device checks name it)
    tensors = [(name, t) for name, t in named
               if t.is_floating_point() and t.numel() and t.device.type in ("cpu", "cuda")
               and (GPU_CHECKS.on or not t.is_cuda)]
    if not tensors:
        return
    if any(capturing(t) for _, t in tensors):
        raise SnapmlaError(
            f"{tensors[0][0]}: {ENV_VAR}=1 cannot check values during CUDA-graph capture "
            "(it reads them back to the host); capture with the check off")
    alls = [torch.isfinite(t).all() for _, t in tensors]
    flags = torch.stack(alls).tolist() if len({a.device for a in alls}) == 1 else [bool(a) for a in alls]
    for (name, t), ok in zip(tensors, flags):
        if not ok:
            bad = int((~torch.isfinite(t)).sum())
            raise SnapmlaError(f"{name}: {bad} of {t.numel()} values are NaN or inf (expected finite values)")


def check_quantizable(name: str, t: torch.Tensor, written: torch.Tensor | None = None) -> None:
    """:func:`check_finite`, then the one overflow SPEC section 3's quantizer can produce from
    finite rows: the RoPE part is divided by the content's scale ``max(amax / 448, 2^-32)``, so
    a row whose content is (near) zero and whose RoPE is huge (beyond about 7.9e28 at the scale's
    floor) pre-scales to an inf bf16 RoPE, and every logit of that query row or cached token
    becomes inf or NaN. Refused like a NaN input, under the same switch on CUDA.

    ``written``: a mask of the rows that will be quantized (``append_kv`` skips padding slots,
    whose rows may hold anything); the error names the row's index in ``t``."""
    check_finite(name, t if written is None else t[written])
    if not t.numel() or not t.is_floating_point() or (t.is_cuda and not GPU_CHECKS.on):
        return
    rows = t.reshape(-1, D_QK).float()
    scale = row_scale(rows[:, :D_CONTENT])
    fits = torch.isfinite((rows[:, D_CONTENT:] / scale[:, None]).to(torch.bfloat16)).all(dim=-1)
    if written is not None:
        fits |= ~written.reshape(-1)
    if bool(fits.all()):
        return
    first = int((~fits).nonzero()[0, 0])
    index = list(torch.unravel_index(torch.tensor(first), tuple(t.shape[:-1]))) if t.dim() > 1 else []
    where = f"[{', '.join(str(int(i)) for i in index)}]" if index else ""
    rope_max = float(rows[first, D_CONTENT:].abs().max())
    raise SnapmlaError(
        f"{name}{where}: its RoPE part (|x| up to {rope_max:.3g}) divided by its content's scale "
        f"({float(scale[first]):.3g}, SPEC section 3) overflows bf16; expected |RoPE| / scale "
        "within bf16's range")
