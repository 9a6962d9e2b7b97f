"""Live keys reach built detectors without losing their state (``detectors/live.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from fleethealth.commands._settings import schema
from fleethealth.config import LIVE_KEYS
from fleethealth.detectors.live import reconfigure
from fleethealth.detectors.straggler import StragglerDetector
from fleethealth.errors import ConfigError


def test_every_live_key_is_a_key_and_the_shapes_of_state_are_restart_only() -> None:
    assert LIVE_KEYS <= set(schema().keys)
    assert not {"detect.straggler.drifts", "detect.straggler.init_steps", "kafka", "store", "detect.stage"} & LIVE_KEYS


def test_reconfigure_keeps_the_baselines_and_recomputes_the_thresholds() -> None:
    rng = np.random.default_rng(3)
    det = StragglerDetector(persistent_min=0.5)
    ranks = np.arange(64)
    for step in range(40):
        t = 1.0 + 0.005 * rng.standard_normal(64)
        t[9] *= 1.1
        assert det.check(step, ranks, t) == []
    base, h = det.base_.copy(), det.h_.copy()
    reconfigure(det, {"persistent_min": 0.03, "false_rate": 1e-9})
    assert np.array_equal(det.base_, base) and det.log_persistent_ == pytest.approx(np.log1p(0.03))
    assert (det.h_ < h).all()  # a larger false-alarm budget: lower thresholds
    found = []
    for step in range(40, 60):
        t = 1.0 + 0.005 * rng.standard_normal(64)
        t[9] *= 1.1
        found += det.check(step, ranks, t)
    assert [f.rank for f in found] == [9] and found[0].evidence["persistent"]
    with pytest.raises(ConfigError, match="no parameter"):
        reconfigure(det, {"no_such": 1})
