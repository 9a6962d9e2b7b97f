"""The single-runner demo's detect phase reads every partition to its end and its progress never passes
100 %, when its topics hold more records than the messages published: a batch the probes' delivery
published again after a failed flush is on its topic twice (``issue 28 §5``: "detect 102 % (63712/62308)").
Real broker, real chDB store; the demo's own loop (:func:`fleethealth.demo._detect_all`) and runner, read
after the fleet's side has published everything (here this test's producer)."""

from __future__ import annotations

import pytest

from fleethealth.broker import EmbeddedBroker
from fleethealth.bus import Producer, ensure_topics
from fleethealth.demo import _detect_all, _whole_tier_runner
from fleethealth.schema import Event, EventKind

T0 = 1_767_225_600.0
DISTINCT = 600
AGAIN = 120


def _event(k: int) -> Event:
    return Event(node=f"n{k % 8:04d}", ts=T0 + k, kind=EventKind.PROBE_ERROR, message=f"record {k}")


class _Published:
    """The fleet's side of the demo's loop once it has published everything: what the loop reads of
    :class:`fleethealth.demo_fleet.FleetPublisher`."""

    steps_done = steps_total = 1
    published = DISTINCT

    def poll(self) -> bool:
        return True


@pytest.fixture
def broker():
    """A broker of this test's own: the demo's loop reads its topics whole, and the session's broker holds
    other tests' records (some made to be dead-lettered)."""
    with EmbeddedBroker() as running:
        yield running


def test_the_detect_phase_reads_to_the_end_and_its_progress_stays_within_100_percent(broker, store) -> None:
    ensure_topics(broker.dsn)
    with Producer(broker.dsn, event_time_stamps=True) as producer:
        for k in range(DISTINCT - AGAIN):
            producer.publish(_event(k))
        producer.flush()
        for k in range(AGAIN):  # a delivered batch published again, as after a flush that failed
            producer.publish(_event(k))
        producer.flush()
        for k in range(DISTINCT - AGAIN, DISTINCT):  # the last records: unread if the count stops the run
            producer.publish(_event(k))
        producer.flush()
    seen: list[tuple[str, int, int]] = []
    with _whole_tier_runner(broker.dsn, store) as runner:
        dead = _detect_all(runner, _Published(), lambda what, done, total: seen.append((what, done, total)), {})  # type: ignore[arg-type]
    seen = [entry for entry in seen if entry[0] == "detect"]
    assert dead == 0 and seen
    over = [(done, total) for _, done, total in seen if done > total]
    assert not over, f"progress past 100 %: {over[:3]}"
    assert seen[-1][1] == seen[-1][2] == DISTINCT + AGAIN  # the end: every offset on the topics read
    stored = store.query("SELECT count(DISTINCT id) FROM events").rows[0][0]
    assert stored == DISTINCT, f"{stored} of {DISTINCT} events stored"
