"""The number checks every module shares."""

import math

import numpy as np
import pytest

from mgkit._numbers import nbytes, real, whole


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


@pytest.mark.parametrize(
    ("good", "expected"),
    [
        ("16GiB", 16 * 2**30),
        ("16 GB", 16 * 10**9),
        ("512MiB", 512 * 2**20),
        ("512 mib", 512 * 2**20),
        ("1.5 KiB", 1536),
        ("2TB", 2 * 10**12),
        ("1e9", 10**9),
        ("4096", 4096),
        ("100 B", 100),
        (2**30, 2**30),
        (np.int64(80), 80),
        (1.5e9, 1_500_000_000),
    ],
)
def test_nbytes_reads_sizes_with_units(good, expected):
    assert nbytes(good, "memory", "simulate") == expected


@pytest.mark.parametrize(
    ("bad", "error", "message"),
    [
        ("16 gigs", ValueError, "simulate: memory='16 gigs' is not a size; memory must be a size in bytes"),
        ("GiB", ValueError, "memory='GiB' is not a size"),
        ("", ValueError, "memory='' is not a size"),
        ("-1GiB", ValueError, "memory='-1GiB' is not a size"),
        (0, ValueError, "simulate: memory=0 is out of range; memory must be a size in bytes above 0"),
        (math.inf, ValueError, "memory=inf is out of range"),
        (True, TypeError, "simulate: memory must be a size in bytes above 0"),
        (None, TypeError, "got NoneType None"),
    ],
)
def test_nbytes_rejects_with_a_message_naming_the_value_and_an_example(bad, error, message):
    with pytest.raises(error) as info:
        nbytes(bad, "memory", "simulate")
    assert message in str(info.value)
    assert "e.g. memory='16GiB'" in str(info.value)
