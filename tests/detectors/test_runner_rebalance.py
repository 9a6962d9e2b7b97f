"""The whole tier's runner releases nothing held while its group has taken every partition away.

During a rebalance the consumer holds no partition: its lag names none, which read as "every partition
read to its end" and released everything the event-time buffer held. The records held are those ahead of
the slowest partition (telemetry fetched minutes of event time ahead of a steps partition): released,
they moved the detectors' clock past the steps still unread, and a healthy rack's ranks were reported
hung (a single-runner demo at load ~15: hang findings on n0024 and on n0025-n0031, every rank of rack r03).
Real broker and chDB store; the decision is the runner's watermark."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from fleethealth.bus import Record
from fleethealth.detectors.runner import Runner
from fleethealth.detectors.snapshot import WHOLE
from fleethealth.schema import Telemetry, Topic

T0 = 1_767_225_600.0


def test_nothing_held_is_released_while_the_group_has_taken_every_partition_away(broker, store) -> None:
    with Runner(broker.dsn, store, group="rebalance", registry=CollectorRegistry()) as runner:
        runner.core.adopt(WHOLE, runner.core.fresh(WHOLE))  # as once the group first gave it partitions
        tel = Telemetry.from_columns("n0024", "r03", T0 + 300.0, [0])
        rec = Record(Topic.TELEMETRY.value, 1, 7, None, tel)
        runner.buffer.push(tel.ts, (rec.topic, rec.partition), rec)
        # a rebalance in progress: nothing assigned, the poll returned nothing
        assert runner._watermark([], {}) == float("-inf")
        steps = (Topic.STEPS.value, 0)
        assert runner._watermark([], {steps: 5}) == float("-inf")  # a partition behind, nothing of it held
        assert runner._watermark([], {steps: 0, (Topic.TELEMETRY.value, 1): 0}) == float("inf")  # read to the end
