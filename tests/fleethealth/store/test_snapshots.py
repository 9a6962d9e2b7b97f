"""Detector snapshots in the store (011): the newest per (group, partition) by seq, bytes exactly as given."""

from __future__ import annotations

import os

import numpy as np
import pytest

from fleethealth.errors import StoreError
from fleethealth.store import Store

OFFSETS = {("fh.steps", 2): 1_234_567, ("fh.events", 2): 89}


def test_the_newest_snapshot_by_seq_is_loaded_whatever_the_order_written(store: Store) -> None:
    store.save_snapshot("fh-job", 2, 7, 1_700_000_100.0, OFFSETS, b"seven")
    store.save_snapshot("fh-job", 2, 9, 1_700_000_300.0, {("fh.steps", 2): 1_300_000}, b"nine")
    store.save_snapshot("fh-job", 2, 8, 1_700_000_200.0, OFFSETS, b"eight")  # late, older: never wins
    store.save_snapshot("fh-job", 3, 1, 1_700_000_000.0, {("fh.steps", 3): 5}, b"other partition")
    store.save_snapshot("fh-node", 2, 50, 1_700_000_000.0, {}, b"other group")
    assert store.load_snapshot("fh-job", 2) == (9, {("fh.steps", 2): 1_300_000}, b"nine")
    store.optimize_final("detector_snapshots")
    assert store.load_snapshot("fh-job", 2) == (9, {("fh.steps", 2): 1_300_000}, b"nine")
    assert store.load_snapshot("fh-job", 3) == (1, {("fh.steps", 3): 5}, b"other partition")
    assert store.load_snapshot("fh-node", 2) == (50, {}, b"other group")
    assert store.load_snapshot("fh-job", 4) is None and store.load_snapshot("nobody", 2) is None
    rows = store.query("SELECT partition, bytes, toFloat64(ts) AS ts, taken > toDateTime64('2020-01-01', 3) AS now "
                       "FROM detector_snapshots FINAL WHERE consumer_group = 'fh-job' ORDER BY partition").rows
    assert rows == [(2, 4, 1_700_000_300.0, 1), (3, 15, 1_700_000_000.0, 1)]


def test_binary_bytes_survive_the_round_trip_exactly(store: Store) -> None:
    rng = np.random.default_rng(16)
    nasty = (b"\x00" * 17 + b"\xff\xfe\xc3\x28\xa0\xa1\xed\xa0\x80\xf8\x88\x80\x80\x80" + "é€😀".encode()
             + b"\r\n\x1a'\\\"" + bytes(range(256)))
    blobs = [nasty, b"", b"\x00", rng.bytes(3_000_000) + nasty, os.urandom(4096)]
    for seq, blob in enumerate(blobs, start=1):
        store.save_snapshot("fh-bin", seq, seq, 1_700_000_000.0, OFFSETS, blob)
    for seq, blob in enumerate(blobs, start=1):
        found = store.load_snapshot("fh-bin", seq)
        assert found is not None and found[0] == seq and found[1] == OFFSETS
        assert type(found[2]) is bytes and found[2] == blob, f"blob {seq} changed ({len(found[2])} vs {len(blob)})"


def test_a_dumped_pipeline_loads_from_the_store(store: Store) -> None:
    from fleethealth.detectors.pipeline import Pipeline
    from fleethealth.detectors.snapshot import Snapshots
    from fleethealth.schema import Telemetry

    snapshots = Snapshots(key=b"store-test-snapshot-key-0123456789")
    pipe = Pipeline()
    pipe.feed([Telemetry.from_columns(f"n{i:04d}", "r00", 1_700_000_000.0, [0, 1]) for i in range(3)])
    store.save_snapshot("fh-job", 0, 1, pipe.now_, OFFSETS, snapshots.dump(pipe, OFFSETS))
    seq, offsets, blob = store.load_snapshot("fh-job", 0)
    restored, inner = snapshots.load(blob, like=Pipeline(), expect=Pipeline)
    assert (seq, offsets, inner) == (1, OFFSETS, OFFSETS) and set(restored.clock_) == set(pipe.clock_)


def test_bad_arguments_are_refused(store: Store) -> None:
    with pytest.raises(StoreError, match="seq must be an int"):
        store.save_snapshot("g", 0, -1, 0.0, {}, b"x")
    with pytest.raises(StoreError, match="partition must be an int"):
        store.save_snapshot("g", True, 1, 0.0, {}, b"x")  # type: ignore[arg-type]
    with pytest.raises(StoreError, match="blob must be bytes"):
        store.save_snapshot("g", 0, 1, 0.0, {}, "text")  # type: ignore[arg-type]


def test_the_snapshot_table_keeps_the_greatest_seq_per_group_and_partition(store: Store) -> None:
    res = store.query("SELECT engine_full, sorting_key FROM system.tables WHERE database = currentDatabase() "
                      "AND name = 'detector_snapshots'")
    engine, key = res.rows[0]
    assert engine.startswith("ReplacingMergeTree(seq)") and key == "consumer_group, partition"
