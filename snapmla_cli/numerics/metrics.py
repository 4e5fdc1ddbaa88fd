"""Error metrics of SPEC section 6, computed in float64 on flattened tensors.

Non-finite values where the reference is finite make every metric +inf, so a NaN can never
pass a gate by comparing as False.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from ..errors import SnapmlaError
from .finiteness import all_finite


@dataclass(frozen=True)
class ErrorMetrics:
    rmse: float
    cos_diff: float
    rel_l2: float
    max_abs: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def compare(x: torch.Tensor, ref: torch.Tensor) -> ErrorMetrics:
    """Metrics of ``x`` against ``ref``; positions where ``ref`` is non-finite (e.g. lse = +inf of
    empty rows) must match exactly and are then left out of the sums."""
    if x.shape != ref.shape:
        raise SnapmlaError(f"compare: shapes differ, {tuple(x.shape)} vs {tuple(ref.shape)}")
    a = x.detach().to("cpu", torch.float64).reshape(-1)
    r = ref.detach().to("cpu", torch.float64).reshape(-1)
    special_ok = True
    if not all_finite(r):  # a mask and masked copies only when there are special values
        ref_finite = torch.isfinite(r)
        special_ok = bool(torch.all((a[~ref_finite] == r[~ref_finite]) | (a[~ref_finite].isnan() & r[~ref_finite].isnan())))
        a, r = a[ref_finite], r[ref_finite]
    if not special_ok or not all_finite(a):
        inf = math.inf
        return ErrorMetrics(inf, inf, inf, inf)
    if a.numel() == 0:
        return ErrorMetrics(0.0, 0.0, 0.0, 0.0)
    diff = a - r
    rmse = float(torch.sqrt(torch.mean(diff * diff)))
    nr, na = float(torch.linalg.norm(r)), float(torch.linalg.norm(a))
    rel_l2 = float(torch.linalg.norm(diff)) / nr if nr > 0 else (0.0 if na == 0 else math.inf)
    if nr > 0 and na > 0:
        cos_diff = 1.0 - float(torch.dot(a, r)) / (na * nr)
    else:
        cos_diff = 0.0 if nr == na else 1.0
    return ErrorMetrics(rmse, max(cos_diff, 0.0), rel_l2, float(diff.abs().max()))
