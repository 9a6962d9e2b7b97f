"""When a consumer group is read to its end: decided for the group from what every member said after its
last poll, never by a member on its own view (which let replicas of ``demo --replicas`` stop between two
generations while a partition they had given up went to a replica that had stopped as well)."""

from __future__ import annotations

import threading
import time

import pytest

from fleethealth.bus import Consumer, Producer, ensure_topics
from fleethealth.bus.consumer import group_read_to_end
from fleethealth.schema import Event, EventKind, Topic

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


def _publish(dsn: str, tag: str) -> None:
    with Producer(dsn) as producer:
        for n in range(64):  # keys spread over every partition
            producer.publish(Event(node=f"host-{n}", ts=1.0, kind=EventKind.XID, code=31, message=tag))
        producer.flush()


def _read_to_end(consumer: Consumer, who: str) -> None:
    deadline = time.monotonic() + 60
    while not (lag := consumer.lag()) or any(v != 0 for v in lag.values()):
        assert time.monotonic() < deadline, f"the {who} member did not read every partition to its end: {lag}"
        consumer.poll(0.2)


@pytest.mark.slow
def test_a_partition_revoked_is_named_and_its_commit_forgotten_unless_given_back_at_this_members_commit(
        broker) -> None:  # noqa: ANN001
    """A member commits every partition; a second joins (the eager protocol revokes every partition from
    the first and gives some back). The first names the ones it lost (``take_moved``: its runner drops
    their pipelines), not the ones given back at its own commit (nobody committed past it: a rebalance
    costs no restore there), and keeps its commits of those only. The second reads what was published
    since, commits past the first's commits and leaves; the first gets those partitions back at the
    second's commit and reports no old commit of its own for them (``committed``), so it never writes a
    snapshot naming offsets its state has not reached. Before, it kept its old commits of partitions it
    had lost, and a snapshot of a partition taken back could name them."""
    import uuid

    ensure_topics(broker.dsn)
    group = f"revoked-{uuid.uuid4().hex[:8]}"
    _publish(broker.dsn, group)
    fast = {"session_timeout_s": 2.0, "max_poll_interval_s": 5.0}
    with Consumer(broker.dsn, [Topic.EVENTS.value], group, **fast) as first:
        first.wait_assigned(timeout_s=30)
        _read_to_end(first, "first")
        first.commit()
        held = first.assignment()
        before = first.committed()
        assert set(before) == held and first.take_moved() == set()
        second = Consumer(broker.dsn, [Topic.EVENTS.value], group, **fast)
        joining = threading.Thread(target=second.wait_assigned, args=(60.0,), daemon=True)
        joining.start()  # each member polls in a thread of its own: the rebalance needs both
        deadline = time.monotonic() + 60
        while joining.is_alive() or not first.assignment() or first.assignment() & second.assignment():
            assert time.monotonic() < deadline, "the group did not split its partitions between two members"
            first.poll(0.1)
        kept, theirs = first.assignment(), second.assignment()
        assert kept and theirs and kept | theirs == held
        assert first.take_moved() == {(t, p) for t, p in theirs}  # given back at its own commit: not named
        assert first.committed() == {tp: off for tp, off in before.items() if tp in kept}
        _publish(broker.dsn, group + "-more")
        _read_to_end(second, "second")
        second.commit()  # past the first member's commits of these partitions
        assert all(off > before[tp] for tp, off in second.committed().items()), (second.committed(), before)
        second.close()  # (it leaves by its session expiring)
        deadline = time.monotonic() + 60
        while first.assignment() != held:
            assert time.monotonic() < deadline, f"the first member did not get all back: {first.assignment()}"
            first.poll(0.1)
        # named when they left (above); back now at the second's commit, which is where it reads them from:
        # none of its own old commits of them is left to name in a snapshot
        assert first.take_moved() == set()
        assert set(first.committed()) == kept


@pytest.mark.slow
def test_a_member_dropped_from_the_group_names_every_partition_it_gets_back(broker) -> None:  # noqa: ANN001
    """A member slower than ``max_poll_interval_s`` is dropped from the group, which gives its partitions
    to another member; that one reads what was published since, commits past the first's commits and
    leaves. The first polls again, joins again and gets them back — to kafka-python a lost membership and
    an assignment within one poll, which looked like partitions given back in the same rebalance. It names
    every one (``take_moved``: its runner restores their snapshots) and keeps none of its old commits.
    Before, it kept them and its state of them: its detectors folded the records from the other member's
    commit on, past a gap (in ``demo --replicas 3``, a failure_risk finding from a history begun anew)."""
    import uuid

    ensure_topics(broker.dsn)
    group = f"lost-{uuid.uuid4().hex[:8]}"
    _publish(broker.dsn, group)
    fast = {"session_timeout_s": 2.0, "max_poll_interval_s": 1.0}
    with Consumer(broker.dsn, [Topic.EVENTS.value], group, **fast) as first:
        first.wait_assigned(timeout_s=30)
        _read_to_end(first, "first")
        first.commit()
        held = first.assignment()
        before = first.committed()
        assert set(before) == held and first.take_moved() == set()
        with Consumer(broker.dsn, [Topic.EVENTS.value], group, **fast) as second:  # the first polls no more
            second.wait_assigned(timeout_s=60)
            deadline = time.monotonic() + 60
            while second.assignment() != held:
                assert time.monotonic() < deadline, f"the second member did not get every partition: " \
                                                    f"{second.assignment()}"
                second.poll(0.1)
            _publish(broker.dsn, group + "-more")
            _read_to_end(second, "second")
            second.commit()
            assert all(off > before[tp] for tp, off in second.committed().items()), (second.committed(), before)
        _publish(broker.dsn, group + "-last")
        deadline, got = time.monotonic() + 60, 0
        while got < 64:  # back in the group (a member between generations fetches nothing): the last 64
            assert time.monotonic() < deadline, f"the first member read {got} of the last 64 records"
            got += len(first.poll(0.1))
        assert first.assignment() == held
        assert first.take_moved() == held
        assert first.committed() == {}
