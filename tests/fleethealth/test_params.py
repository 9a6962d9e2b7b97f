"""The one parameter check: bounds are stated at every call, messages name the parameter (and the
estimator), and bools, NaN and infinities are refused."""

from __future__ import annotations

import math

import pytest

from fleethealth.errors import ConfigError
from fleethealth.params import check_int, check_number


class Estimator:
    pass


def test_bounds_are_explicit() -> None:
    assert check_number("x", 0, at_least=0) == 0.0
    with pytest.raises(ConfigError, match=r"^x must be > 0, got 0$"):
        check_number("x", 0, above=0)
    assert check_number("x", -5) == -5.0  # no bound: any finite number
    with pytest.raises(ConfigError, match=r"q must be > 0 and <= 1, got 1.5"):
        check_number("q", 1.5, above=0, at_most=1.0)
    with pytest.raises(TypeError):
        check_number("x", 1, above=0, at_least=0)


@pytest.mark.parametrize("bad", [True, "1", math.nan, math.inf, None])
def test_non_numbers_are_refused(bad) -> None:
    with pytest.raises(ConfigError, match="must be a finite number"):
        check_number("x", bad, at_least=0)


def test_integers_and_the_owner_in_the_message() -> None:
    assert check_int("n", 3, at_least=1) == 3
    with pytest.raises(ConfigError, match=r"^Estimator: n must be an integer >= 1, got 0$"):
        check_int("n", 0, at_least=1, owner=Estimator())
    with pytest.raises(ConfigError, match="integer"):
        check_int("n", 2.0)
    with pytest.raises(ConfigError, match=r"^Estimator: z must be > 0, got -1$"):
        check_number("z", -1, above=0, owner=Estimator())
