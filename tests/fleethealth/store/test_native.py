"""Inserts written as one Native block from NumPy columns (``fleethealth.store.native``): the rows
read back are the rows given, steps of blocks and of batches alike, and a column the writer does not
take sends the insert through clickhouse-connect as before."""

from __future__ import annotations

import numpy as np

from fleethealth.schema import StepBatch, StepBlock
from fleethealth.store.columns import Codes, step_columns
from fleethealth.store.native import encode_native


def _batches(job: str, node: int, steps: range) -> list[StepBatch]:
    ranks = np.arange(node * 4, node * 4 + 4, dtype=np.int32)
    return [StepBatch(job=job, step=k, node=f"n{node}", ts=1_767_225_600.0 + 0.1 * k + 0.0004 * node, ranks=ranks,
                      gpus=np.arange(4, dtype=np.int16), compute_s=0.5 + 0.001 * k + 0.01 * ranks,
                      groups=(ranks % 2).astype(np.int32) if node == 2 else None) for k in steps]


def test_steps_of_blocks_and_batches_are_stored_as_given(store) -> None:
    one = _batches("job-a", 0, range(0, 5)) + _batches("job-a", 1, range(0, 5)) + _batches("job-a", 2, range(0, 5))
    items = [StepBlock.of(one[:5]), StepBlock.of(one[5:10]), *one[10:]]  # blocks, and batches with groups
    cols = step_columns(items)
    assert isinstance(cols["job"], Codes) and encode_native(cols, store._table_types("rank_steps")) is not None
    assert store.insert_steps(items, dedup_token="t1") == 60
    back = {(b.node, b.step): b for b in store.steps("job-a")}
    assert len(back) == 15
    for b in one:
        got = back[(b.node, b.step)]
        assert got.ranks.tolist() == b.ranks.tolist() and got.gpus.tolist() == b.gpus.tolist()
        assert got.compute_s.tolist() == b.compute_s.tolist()  # Float64, bit for bit
        assert abs(got.ts - b.ts) < 5e-4  # DateTime64(3)
        assert (got.groups is None) == (b.groups is None)
    assert store.insert_steps(items, dedup_token="t1") == 60  # the same token: stored once
    assert store.query("SELECT count() FROM rank_steps WHERE job = 'job-a'").rows[0][0] == 60


def test_a_column_the_writer_does_not_take_goes_through_the_client(store) -> None:
    types = store._table_types("rank_steps")
    cols = step_columns(_batches("job-b", 0, range(3)))
    cols["node"] = cols["node"].rows()  # an object array of text, not Codes
    assert encode_native(cols, types) is None
    assert store.insert("rank_steps", cols) == 12
    assert {b.step for b in store.steps("job-b")} == {0, 1, 2}
