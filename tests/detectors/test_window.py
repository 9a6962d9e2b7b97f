"""TimeRows: a window of rows stamped with event time as two arrays, against the deque of rows it replaced."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from fleethealth.detectors.state import StateError, from_state, state_dict
from fleethealth.detectors.window import TimeRows


def test_trimming_matches_the_deque_it_replaced():
    """The same appends and trims leave the same rows as a deque of (ts, row) popped from the left, for
    both trims the detectors use, over random times and windows."""
    rng = np.random.default_rng(11)
    for least in (1, 2):
        rows, ref = TimeRows((3,)), deque()
        ts = 0.0
        for _ in range(2000):
            ts += float(rng.choice([0.5, 1.0, 7.0, 60.0]))
            row = rng.normal(size=3)
            window = float(rng.choice([5.0, 30.0, 300.0]))
            rows.append(ts, row)
            rows.keep_covering(ts - window, least=least)
            ref.append((ts, row))
            while len(ref) > least and ref[1][0] <= ts - window:
                ref.popleft()
            assert rows.ts.tolist() == [t for t, _ in ref]
            np.testing.assert_array_equal(rows.rows, np.stack([r for _, r in ref]))
        assert rows.ts_buf.size <= 2 * max(64, len(rows))  # the buffers stop growing with the window
    rows = TimeRows(())
    for t in range(10):
        rows.append(float(t), float(t))
    rows.drop_before(6.5)
    assert rows.ts.tolist() == [7.0, 8.0, 9.0] and rows.rows.tolist() == [7.0, 8.0, 9.0]


def test_a_state_writes_two_arrays_and_restores_with_room_to_grow():
    rows = TimeRows((8,), dtype=bool)
    for t in range(300):
        rows.append(float(t), np.arange(8) % (t % 5 + 1) == 0)
    state = state_dict(rows)
    assert len(state.arrays) == 2 and state.arrays[1].shape == (300, 8)
    back = from_state(state)
    assert back.ts.tolist() == rows.ts.tolist() and back.rows.dtype == bool
    np.testing.assert_array_equal(back.rows, rows.rows)
    back.append(300.0, np.ones(8, dtype=bool))  # appends after a restore
    assert len(back) == 301 and back.rows[-1].all() and len(rows) == 300


@pytest.mark.parametrize("ts, rows", [
    (np.zeros(3), np.zeros((4, 2))),          # more rows than times
    (np.zeros((3, 1)), np.zeros((3, 2))),     # times not 1-D
    (np.zeros(3, dtype=np.int64), np.zeros((3, 2))),  # times not float
    ([0.0, 1.0], np.zeros((2, 2))),           # times not an array
    (np.zeros(2), np.array([["a", "b"], ["c", "d"]])),  # rows of text
])
def test_a_state_whose_rows_do_not_pair_with_its_times_is_refused(ts, rows):
    good = TimeRows((2,))
    state = state_dict(good)
    forged = TimeRows.__new__(TimeRows)
    forged.ts, forged.rows = ts, rows
    with pytest.raises(StateError, match="do not pair up as numbers"):
        from_state(state_dict(forged))
    assert from_state(state) is not None


def test_a_window_that_does_not_fit_its_nodes_gpus_is_refused():
    """A state (signed, yet forged or from a defect) whose window rows do not fit the node's GPUs is a
    StateError when read, not an exception later in the stream."""
    from fleethealth.detectors.nodestate import NodeStates
    from fleethealth.detectors.predict import GpuFeatures
    from fleethealth.schema import Telemetry

    feats = GpuFeatures()
    feats.check([Telemetry.from_columns("n1", "r1", 60.0 * i, np.arange(2), temp_c=np.full(2, 60.0))
                 for i in range(3)])
    assert from_state(state_dict(feats), like=GpuFeatures()).nodes_["n1"].rows.shape == (2, 10)
    feats.nodes_["n1"].rows = TimeRows((3, 10))  # rows of 3 GPUs on a node of 2
    with pytest.raises(StateError, match="failure-predictor history whose rows"):
        from_state(state_dict(feats), like=GpuFeatures())
    states = NodeStates()
    states.power_cap_["n1"] = TimeRows((8,), dtype=bool)
    states.power_cap_gpu_["n1"] = np.arange(4, dtype=np.int16)
    with pytest.raises(StateError, match="power-cap window of 'n1' does not fit"):
        from_state(state_dict(states))
    states.power_cap_gpu_["n1"] = np.arange(8, dtype=np.int16)
    assert from_state(state_dict(states)).power_cap_["n1"].shape == (8,)
