"""A job-stage replica reading the node-state table (``fh.nodestate``) does not wait on its group's topics
between two polls of the table while the table still holds records: on a real broker, 600 node states
read 100 a poll with no step traffic at all. Before, each poll of the table came after a group poll
that waited its whole timeout for steps that were not coming (a start-up read 2,000 states a 0.5 s)."""

from __future__ import annotations

import time

import numpy as np
from prometheus_client import CollectorRegistry

from fleethealth.bus import Producer
from fleethealth.detectors.nodestate import node_state
from fleethealth.detectors.runner import Runner
from fleethealth.detectors.stages import Stage
from fleethealth.schema import Telemetry

OWN_BROKER_PARTITIONS = 1
T0 = 1_767_225_600.0
STATES, PER_POLL, WAIT_S = 600, 100, 2.0


def _states() -> list:
    out = []
    for i in range(STATES):
        sample = Telemetry.from_columns(f"gpu-{i // 8:03d}-{i % 8}.dc1", f"dc1-r{i // 40:02d}", T0 + i * 0.01,
                                        np.arange(8), temp_c=np.full(8, 60.0), power_w=np.full(8, 600.0))
        out.append(node_state(sample, None))
    return out


def test_the_table_is_read_without_waiting_on_the_groups_topics(own_broker, store) -> None:
    with Producer(own_broker.dsn, client_id="node-stage", event_time_stamps=True) as producer:
        for state in _states():
            producer.publish(state)
        producer.flush()
    with Runner(own_broker.dsn, store, group="table-read", stage=Stage.JOB, registry=CollectorRegistry(),
                publish=False, max_records=PER_POLL, max_ahead_s=None, max_behind_s=None, session_timeout_s=2.0,
                max_poll_interval_s=30.0, snapshot_every_s=None) as runner:
        waits: list[float] = []
        poll = runner.consumer.poll

        def spy(timeout_s: float, max_records: int) -> list:
            waits.append(timeout_s)
            return poll(timeout_s, max_records)

        runner.consumer.poll = spy  # type: ignore[method-assign]
        table = runner.table
        assert table is not None
        deadline = time.monotonic() + 120.0
        while table.consumed_total + table.passed_over_total < STATES:
            assert time.monotonic() < deadline, f"read {table.consumed_total + table.passed_over_total} of {STATES}"
            runner.process_once(WAIT_S)
    # every state read once, and passed over undecoded: this replica has no job, so it needs no node
    assert (table.consumed_total, table.passed_over_total) == (0, STATES)
    # the group's poll waited only before the table's first records and after its last; in between, none
    assert waits.count(0.0) >= STATES // PER_POLL - 2, waits
    assert waits.count(WAIT_S) <= 2, waits
