"""Cheap per-step invariants: non-finite loss, gradient norm above 10 x the running p99."""

from __future__ import annotations

import numpy as np
import pytest

from fleethealth.errors import ConfigError
from fleethealth.injob.invariants import Invariants, NonFiniteAction, NonFiniteLoss, default_on_nonfinite


def _warm(inv: Invariants, n: int = 200, seed: int = 0) -> np.ndarray:
    norms = np.random.default_rng(seed).lognormal(0.0, 0.2, n)
    for step, g in enumerate(norms):
        assert not inv.check(step, 2.0, float(g)).skip_update
    return norms


def test_no_ceiling_during_warmup() -> None:
    inv = Invariants(warmup=50)
    _warm(inv, 49)
    v = inv.check(49, 2.0, 1e6)
    assert v.ceiling is None and not v.skip_update


def test_spike_above_ten_times_p99_is_skipped_and_counted() -> None:
    inv = Invariants(warmup=50, refresh=1)
    norms = _warm(inv)
    p99 = float(np.quantile(norms, 0.99))
    assert inv.ceiling() == pytest.approx(10 * p99)
    assert not inv.check(200, 2.0, 9.5 * p99).skip_update
    v = inv.check(201, 2.0, 11 * p99)
    assert v.skip_update and v.reason == "grad_spike" and inv.spikes_total == 1 and inv.anomalies_total == 1
    # rejected norms never raise their own ceiling: a burst of spikes stays rejected
    for k in range(30):
        assert inv.check(202 + k, 2.0, 50 * p99).skip_update
    assert inv.spikes_total == 31


def test_nonfinite_loss_and_grad() -> None:
    inv = Invariants(warmup=1)
    v = inv.check(7, float("nan"), 1.0)
    assert v.skip_update and v.reason == "nonfinite_loss"
    v = inv.check(8, 1.0, float("inf"))
    assert v.skip_update and v.reason == "nonfinite_grad"
    assert inv.nonfinite_total == 2 and inv.steps_total == 2
    with pytest.raises(NonFiniteLoss, match="loss at step 7.*persistent"):
        default_on_nonfinite(inv.check(7, float("inf"), 1.0), "persistent")


def test_nonfinite_action_is_chosen_per_classification() -> None:
    """A transient fault's update was skipped on every rank: by default training goes on; anything
    else (or nothing known) stops the job; each is configurable."""
    v = Invariants(warmup=1).check(7, float("nan"), 1.0)
    default_on_nonfinite(v, "transient")  # no raise: skip and go on
    for cls in ("persistent", "data_or_code", None):
        with pytest.raises(NonFiniteLoss):
            default_on_nonfinite(v, cls)
    strict = NonFiniteAction(transient="raise", data_or_code="skip")
    with pytest.raises(NonFiniteLoss, match="transient"):
        strict(v, "transient")
    strict(v, "data_or_code")
    assert strict.skipped_total == 1
    with pytest.raises(ConfigError, match="must be one of"):
        NonFiniteAction(transient="ignore")
    with pytest.raises(ConfigError, match="unknown classification"):
        NonFiniteAction(cosmic="skip")


def test_window_forgets_old_norms() -> None:
    inv = Invariants(warmup=10, window=20, refresh=1)
    for step in range(40):
        inv.check(step, 1.0, 100.0 if step < 20 else 1.0)
    assert inv.ceiling() == pytest.approx(10.0)


@pytest.mark.parametrize("kwargs", [{"ceiling_factor": 1.0}, {"quantile": 0.0}, {"warmup": 0},
                                    {"warmup": 10, "window": 5}, {"refresh": 0}])
def test_bad_parameters(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        Invariants(**kwargs)
