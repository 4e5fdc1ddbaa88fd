"""SPEC section 6's error metrics against answers worked out by hand: every gate (verify's, the GPU
tests') reads them, so a slip in one formula (a missing square root, a wrong norm) would move
every gate at once while each test still compared the code with itself."""

from __future__ import annotations

import math

import pytest
import torch

from snapmla_cli.numerics.finiteness import all_finite
from snapmla_cli.numerics.metrics import compare


def test_each_metric_has_its_hand_worked_value() -> None:
    # x - r = [2, 5]; |x| = 10, |r| = 5, x . r = 48
    metrics = compare(torch.tensor([6.0, 8.0]), torch.tensor([4.0, 3.0]))
    assert metrics.rmse == pytest.approx(math.sqrt(29 / 2), rel=1e-15)
    assert metrics.cos_diff == pytest.approx(1 - 48 / 50, rel=1e-12)
    assert metrics.rel_l2 == pytest.approx(math.sqrt(29) / 5, rel=1e-15)
    assert metrics.max_abs == 5.0


def test_a_scaled_copy_has_no_angle_but_its_full_relative_error() -> None:
    ref = torch.tensor([1.0, -2.0, 0.5])
    metrics = compare(2 * ref, ref)
    assert metrics.cos_diff == pytest.approx(0.0, abs=1e-15)
    assert metrics.rel_l2 == pytest.approx(1.0, rel=1e-15)
    assert metrics.max_abs == 2.0


def test_bf16_inputs_are_compared_in_float64() -> None:
    got = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    ref = torch.tensor([1.0, 2.0078125], dtype=torch.float64)  # one bf16 step above 2 apart
    assert compare(got, ref).max_abs == 0.0078125


@pytest.mark.parametrize(("got", "ref", "finite"), [
    ([1.0, math.nan], [1.0, 2.0], False),  # NaN where the reference is finite: every metric inf
    ([1.0, math.inf], [1.0, 2.0], False),
    ([0.0, math.inf], [0.0, math.inf], True),  # an empty row's lse +inf, matched: left out
    ([0.0, 1.0], [0.0, math.inf], False),  # not matched
])
def test_non_finite_values_pass_only_where_the_reference_has_them(got, ref, finite) -> None:
    metrics = compare(torch.tensor(got), torch.tensor(ref))
    values = (metrics.rmse, metrics.cos_diff, metrics.rel_l2, metrics.max_abs)
    assert all(v == 0.0 for v in values) if finite else all(v == math.inf for v in values)


def test_arrays_of_different_shapes_are_refused_by_name() -> None:
    from snapmla_cli.errors import SnapmlaError

    with pytest.raises(SnapmlaError, match=r"^compare: shapes differ, \(3,\) vs \(4,\)"):
        compare(torch.zeros(3), torch.zeros(4))


@pytest.mark.parametrize(("values", "dtype", "expected"), [
    ([1e308, 1e308], torch.float64, True),  # finite values whose sum overflows: the exact check
    ([1.0, math.nan], torch.float32, False),
    ([math.inf, -math.inf], torch.float64, False),  # the sum is NaN
    ([-math.inf, 2.0], torch.bfloat16, False),
    ([3.0e38, 3.0e38], torch.float32, True),  # (a float32 sum would overflow; the float64 one does not)
    ([], torch.float32, True),
    ([1.0, 448.0], torch.float8_e4m3fn, True),
    ([1.0, math.nan], torch.float8_e4m3fn, False),
    ([3, 4], torch.int64, True),
    ([1.0, 2.0], torch.complex64, True),
    ([1.0, math.nan], torch.complex64, False),
])
def test_all_finite_answers_as_the_element_wise_check(values: list[float], dtype: torch.dtype, expected: bool) -> None:
    """all_finite's float64 sum is a shortcut only: every answer is the element-wise one."""
    x = torch.tensor(values, dtype=torch.float64).to(dtype)
    assert all_finite(x) is expected
    if x.is_floating_point() or x.is_complex():  # (the table itself, against torch)
        assert bool(torch.isfinite(x.to(torch.complex128) if x.is_complex() else x.double()).all()) is expected
