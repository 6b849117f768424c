"""The shared argument checks: a wrong type is a TypeError (and, as before, a ValueError);
a number out of range only a ValueError; every message names the argument."""

from __future__ import annotations

import numpy as np
import pytest

from jax_grouped_mlp._src import checks


@pytest.mark.parametrize("value", ["1.0", None, [1.0], np.ones(2), True])
def test_positive_float_wrong_type(value):
    with pytest.raises(TypeError, match="coef must be a number"):
        checks.positive_float("coef", value)
    with pytest.raises(ValueError, match="coef"):  # callers that caught ValueError still do
        checks.positive_float("coef", value)


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_positive_float_out_of_range_is_only_a_value_error(value):
    with pytest.raises(ValueError, match="coef") as info:
        checks.positive_float("coef", value)
    assert not isinstance(info.value, TypeError)


def test_positive_float_accepts_numbers():
    assert checks.positive_float("coef", 2) == 2.0
    assert checks.positive_float("coef", np.float32(0.5)) == 0.5
    assert checks.positive_float("coef", 0, allow_zero=True) == 0.0
    assert checks.positive_float("coef", float("inf"), allow_inf=True) == float("inf")
    with pytest.raises(ValueError, match="float32"):
        checks.positive_float("coef", 1e300, float32=True)


@pytest.mark.parametrize("value", [2.5, "3", None, True, np.bool_(True)])
def test_positive_int_wrong_type(value):
    with pytest.raises(TypeError, match="n must be a positive int"):
        checks.positive_int("n", value)
    with pytest.raises(ValueError, match="n must be a positive int"):
        checks.positive_int("n", value)


@pytest.mark.parametrize("value", [0, -3])
def test_positive_int_out_of_range_is_only_a_value_error(value):
    with pytest.raises(ValueError, match="n must be a positive int") as info:
        checks.positive_int("n", value)
    assert not isinstance(info.value, TypeError)
    assert checks.positive_int("n", np.int64(7)) == 7
