"""Start-address checks of the tensors the kernels read or write with vector accesses.

A contiguous view at an odd offset (``buf[3:]`` of a uint8 buffer, a bf16 tensor sliced by one
element) passes every shape, dtype and stride check and then faults in the kernel with a
misaligned address, which leaves the CUDA context unusable for the rest of the process: so the
start address is checked like the shape, with a one-line error naming the argument.
"""

from __future__ import annotations

from typing import NoReturn

import torch

from ..errors import SnapmlaError

VEC_ALIGN = 16  # bytes: the kernels' 16-byte vector accesses (cp.async, uint4 loads, TMA bases)


def misaligned(name: str, ptr: int, align: int = VEC_ALIGN) -> NoReturn:
    raise SnapmlaError(
        f"{name}: data must start on a {align}-byte boundary (got a view at offset "
        f"{ptr % align}); pass a fresh tensor or .clone()"
    )


def require_aligned(name: str, t: torch.Tensor, align: int = VEC_ALIGN) -> None:
    """``t``'s data starts on an ``align``-byte boundary (an empty tensor is never read)."""
    if t.numel() and t.data_ptr() % align:
        misaligned(name, t.data_ptr(), align)


def aligned_up(nbytes: int, align: int = VEC_ALIGN) -> int:
    """``nbytes`` rounded up to a multiple of ``align``: the offset of the next part of a buffer
    carved into several that the kernels read with aligned accesses."""
    return -(-nbytes // align) * align
