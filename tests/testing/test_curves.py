"""fmeg.testing.assert_same_curve fails on curves that differ, explicitly (under python -O too),
and names both lengths when the curves differ in length."""

import math
import subprocess
import sys
from pathlib import Path

import pytest

from fmeg.testing.curves import assert_same_curve, largest_difference


def curve(losses, grad_norms=None):
    return {"losses": losses, "grad_norms": grad_norms or [1.0] * len(losses)}


def test_the_same_curve_passes_and_a_different_one_fails_naming_the_difference():
    assert_same_curve(curve([2.0, 1.5]), curve([2.0, 1.5 * (1 + 1e-6)]))
    with pytest.raises(AssertionError, match=r"the curves differ by 1\.06 \(relative\), beyond"):
        assert_same_curve(curve([9.9]), curve([4.8]))


def test_curves_of_different_lengths_are_refused_naming_both_lengths():
    message = r"^the curves differ in length: got has 2 losses, want has 3$"
    with pytest.raises(AssertionError, match=message):
        assert_same_curve(curve([1.0, 1.0]), curve([1.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match=message):
        largest_difference(curve([1.0, 1.0]), curve([1.0, 1.0, 1.0]))
    with pytest.raises(AssertionError, match=r"got has 1 grad_norms, want has 2$"):
        assert_same_curve(curve([1.0, 1.0], [1.0]), curve([1.0, 1.0]))


@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_a_value_not_finite_on_either_side_differs(value):
    for got, want in ((curve([1.0, value]), curve([1.0, 1.0])), (curve([1.0]), curve([value]))):
        assert largest_difference(got, want) == math.inf
        with pytest.raises(AssertionError, match="the curves differ by inf"):
            assert_same_curve(got, want)


# an assert statement vanishes under -O: the check must raise by itself
SCRIPT = """
import sys
from fmeg.testing.curves import assert_same_curve
if __debug__:
    sys.exit("not running under -O")
try:
    assert_same_curve(
        {"losses": [9.9], "grad_norms": [1.0]}, {"losses": [4.8], "grad_norms": [1.0]}
    )
except AssertionError as e:
    print("raised:", e)
else:
    sys.exit("curves ending at 9.9 and 4.8 passed")
"""


def test_assert_same_curve_raises_under_python_O():
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-O", "-c", SCRIPT], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("raised: the curves differ by 1.06"), proc.stdout
