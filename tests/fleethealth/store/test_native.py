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


def test_gpu_samples_go_as_one_native_block_with_their_uuids(store) -> None:
    """A poll of telemetry is one Native block (node, rack, model as codes; the GPUs' UUIDs as String),
    and reads back as given; a UUID the writer does not take (another length, not ASCII, a NUL at its
    end) sends the insert through the client, which stores it as given."""
    from fleethealth.schema import Telemetry
    from fleethealth.store.columns import sample_columns, telemetry_columns

    def sample(node: str, ts: float, uuid: tuple[str, ...]) -> Telemetry:
        return Telemetry.from_columns(node, "rack-1", ts, [0, 1], model="H100", uuid=uuid, temp_c=[60.0, 61.5],
                                      power_w=[500.25, np.nan])

    polls = {"native": [sample("a", 1_767_225_600.0, ("GPU-0001", "GPU-0002")),
                        sample("b", 1_767_225_600.5, ("GPU-0003", "GPU-0004")), sample("c", 1_767_225_601.0, ())],
             "client": [sample("d", 1_767_225_602.0, ("GPU-0005", "GPU-06")),
                        sample("e", 1_767_225_602.0, ("GPU-é", "x\x00")),
                        sample("f", 1_767_225_602.0, ("GPU-0007", "GPU-000\x00"))]}
    types = store._table_types("gpu_samples")
    assert encode_native(sample_columns(telemetry_columns(polls["native"][:2])), types) is not None
    assert encode_native(sample_columns(telemetry_columns(polls["native"])), types) is None  # "" beside UUIDs
    assert encode_native(sample_columns(telemetry_columns(polls["native"][2:])), types) is not None
    for name, poll in polls.items():
        assert encode_native(sample_columns(telemetry_columns(poll)), types) is None or name == "native"
        assert store.insert_telemetry(poll, dedup_token=name) == 6
    rows = store.query("SELECT node, gpu, uuid, model, rack, temp_c, power_w FROM gpu_samples ORDER BY node, gpu").rows
    want = [(s.node, g, (s.uuid or ("", ""))[g], "H100", "rack-1", float(s.columns["temp_c"][g]))
            for poll in polls.values() for s in poll for g in (0, 1)]
    assert [(r[0], r[1], r[2], r[3], r[4], float(r[5])) for r in rows] == want
    assert np.isnan(float(rows[1][6])) and float(rows[0][6]) == 500.2  # power to the sensor's 0.1 W
