"""The number checks every module shares."""

import math

import numpy as np
import pytest

from mgkit._numbers import real, whole


@pytest.mark.parametrize("good", [0.5, 1, np.float32(2.0), np.int64(3)])
def test_real_accepts_numbers(good):
    assert real(good, "tol", "fit", lo=0, above=True) == float(good)


@pytest.mark.parametrize(
    ("bad", "error", "message"),
    [
        (True, TypeError, "fit: tol must be a finite number above 0, got bool True; e.g. tol=0.001"),
        ("1e-3", TypeError, "fit: tol must be a finite number above 0, got str '1e-3'; e.g. tol=0.001"),
        (None, TypeError, "got NoneType None"),
        (0, ValueError, "fit: tol=0 is out of range; tol must be a finite number above 0, e.g. tol=0.001"),
        (-1.0, ValueError, "tol=-1.0 is out of range"),
        (math.nan, ValueError, "tol=nan is out of range"),
        (math.inf, ValueError, "tol=inf is out of range"),
    ],
)
def test_real_rejects_with_a_message_naming_the_value(bad, error, message):
    with pytest.raises(error) as info:
        real(bad, "tol", "fit", lo=0, above=True, example=1e-3)
    assert message in str(info.value)


def test_real_bounds_and_notes():
    assert real(math.inf, "C", "fit", lo=0, above=True, finite=False) == math.inf
    with pytest.raises(ValueError, match="C=nan is out of range"):
        real(math.nan, "C", "fit", lo=0, above=True, finite=False)
    with pytest.raises(ValueError, match=r"rate must be a finite number above 0 and at most 10 \(per s\)"):
        real(11, "rate", "View", lo=0, above=True, hi=10, note="per s")
    assert real(0, "l2", "fit", lo=0) == 0.0


@pytest.mark.parametrize(
    ("bad", "error", "message"),
    [
        (
            2.5,
            TypeError,
            "Ledger: capacity must be a whole number from 1 to 1000, got float 2.5",
        ),
        (True, TypeError, "got bool True"),
        (0, ValueError, "Ledger: capacity=0 is out of range; capacity must be a whole number from 1 to 1000"),
        (1001, ValueError, "capacity=1001 is out of range"),
    ],
)
def test_whole_rejects_with_a_message_naming_the_value(bad, error, message):
    with pytest.raises(error) as info:
        whole(bad, "capacity", "Ledger", lo=1, hi=1000, example=10)
    assert message in str(info.value)


def test_whole_accepts_numpy_integers():
    assert whole(np.int32(7), "n", "simulate", lo=1) == 7
