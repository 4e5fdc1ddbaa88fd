"""One question, asked of whole caches: does a floating-point tensor hold only finite values?

``torch.isfinite(x).all()`` answers it with a boolean temporary of ``x``'s size and, on the CPU
builds snapmla runs on, about 400 ms per 38 M float64 values (the references' keys at 64k
tokens). A float64 sum answers the common case in a tenth of that time with no temporary: a NaN
or inf anywhere makes the sum NaN or inf, so a finite sum proves every value finite. Only a
non-finite sum (a NaN or inf, or finite float64 values whose sum overflows) pays for the exact
element-wise check.
"""

from __future__ import annotations

import torch


def all_finite(x: torch.Tensor) -> bool:
    """True when every value of ``x`` is finite (an empty tensor, or an integer one, is; a complex
    one when both parts of every value are). Float8
    tensors are widened first: torch has neither ``sum`` nor ``isfinite`` for them."""
    if x.is_complex():  # (a complex sum would do, but no cache is complex: the plain check)
        return bool(torch.isfinite(x).all())
    if not x.is_floating_point():
        return True
    if x.element_size() == 1:  # float8
        x = x.float()
    if bool(torch.isfinite(x.sum(dtype=torch.float64))):
        return True
    return bool(torch.isfinite(x).all())
