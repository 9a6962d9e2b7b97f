"""When a consumer group is read to its end: decided for the group from what every member said after its
last poll, never by a member on its own view (which let replicas of ``demo --replicas`` stop between two
generations while a partition they had given up went to a replica that had stopped as well)."""

from __future__ import annotations

import pytest

from fleethealth.bus import Consumer, ensure_topics
from fleethealth.bus.consumer import group_read_to_end
from fleethealth.schema import Topic

STEPS = [(Topic.STEPS.value, p) for p in range(4)]


def test_every_partition_held_once_and_read_to_its_end_is_the_end() -> None:
    members = [({STEPS[0], STEPS[1]}, True), ({STEPS[2]}, True), ({STEPS[3]}, True)]
    assert group_read_to_end(members, STEPS)
    assert group_read_to_end([(set(STEPS), True)], STEPS)  # one member holding everything


def test_a_partition_between_owners_is_not_the_end() -> None:
    """The state the replicas' own rule took for the end: one member between generations holds nothing
    (its own view: nothing left to finish), the others have read what they hold — and partition 2, which
    the first gave up, has no owner yet. Its records past the group's commit are unread."""
    members = [(set(), False), ({STEPS[3]}, True), ({STEPS[0], STEPS[1]}, True)]
    own_rule = [not assigned or caught for assigned, caught in members]  # each member's view: done
    assert all(own_rule)
    assert not group_read_to_end(members, STEPS)


def test_a_member_behind_or_a_stale_report_is_not_the_end() -> None:
    assert not group_read_to_end([({STEPS[0], STEPS[1]}, True), ({STEPS[2], STEPS[3]}, False)], STEPS)
    # two members claim partition 2: one of them said so before the move (its records were dropped there)
    assert not group_read_to_end([({STEPS[0], STEPS[1], STEPS[2]}, True), ({STEPS[2], STEPS[3]}, True)], STEPS)
    assert not group_read_to_end([(set(), False), (set(), False)], STEPS)  # nobody holds anything yet
    assert not group_read_to_end([], [])  # a group over no partition is never taken for done


@pytest.mark.slow
def test_partitions_are_every_partition_of_the_topics_on_the_real_broker(broker) -> None:  # noqa: ANN001
    ensure_topics(broker.dsn, partitions=4)
    with Consumer(broker.dsn, [Topic.STEPS.value, Topic.EVENTS.value], "partitions-of-a-group") as consumer:
        parts = consumer.partitions()
    per_topic = {t: sorted(p for tt, p in parts if tt == t) for t in {t for t, _ in parts}}
    # (the session's broker: a topic another test created first keeps its own partition count)
    assert set(per_topic) == {Topic.STEPS.value, Topic.EVENTS.value}
    assert all(ps and ps == list(range(len(ps))) for ps in per_topic.values()), per_topic
