"""The runner's failure rule on the real broker and chDB: a record that fails deterministically
downstream is dead-lettered after bounded retries and the stream moves on past it; a store that
cannot be reached is waited out without loss; an event time far from the broker timestamp is
dead-lettered naming ``ts``.

Before: ``Runner._write`` re-raised any store error, so ``fleethealth detect`` exited and every
restart replayed the same record.
"""

from __future__ import annotations

import time
import uuid

import numpy as np
import orjson
import pytest
from prometheus_client import CollectorRegistry

from fleethealth.bus import Consumer, DeadLetter, Producer
from fleethealth.detectors.pipeline import Pipeline
from fleethealth.detectors.retry import Retry
from fleethealth.detectors.runner import INPUT_TOPICS, Runner
from fleethealth.errors import StoreUnavailable
from fleethealth.schema import Event, EventKind, FindingKind, StepBatch, Topic

T0 = 1_795_900_000.0



def _no_wait() -> Retry:
    return Retry(attempts=3, sleep=lambda s: None)


def _xid(tag: str, k: int, message: str = "") -> Event:
    return Event(node=f"{tag}-n{k % 4}", ts=T0 + k, kind=EventKind.XID, gpu=0, code=79, message=message or f"{tag}-{k}")


def _steps(tag: str, n: int) -> list[StepBatch]:
    return [StepBatch(job=f"{tag}-job", step=s, node=f"{tag}-s{half}", ts=T0 + s, ranks=np.arange(4, dtype=np.int32)
                      + 4 * half, gpus=np.arange(4, dtype=np.int16), compute_s=np.full(4, 1.0))
            for s in range(n) for half in (0, 1)]


def _run_until(runner: Runner, total: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while runner.consumer.consumed_total + runner.consumer.dead_lettered_total < total or len(runner.buffer):
        assert time.monotonic() < deadline, "the runner stopped taking input"
        runner.process_once(0.2)
    runner.drain()


def _letters(dsn: str, tag: str, want: int, timeout_s: float = 30.0) -> list[DeadLetter]:
    got: list[DeadLetter] = []
    with Consumer(dsn, [Topic.DEADLETTER], f"letters-{tag}", session_timeout_s=2.0, max_poll_interval_s=2.0) as c:
        deadline = time.monotonic() + timeout_s
        while len(got) < want and time.monotonic() < deadline:
            got += [r.msg for r in c.poll(0.2) if isinstance(r.msg, DeadLetter) and tag in r.msg.raw]
    return got


def _committed_to_the_end(dsn: str, group: str) -> bool:
    """Whether ``group``'s committed offsets reach the end of every input partition (a member that
    joins it starts with nothing left to read)."""
    with Consumer(dsn, INPUT_TOPICS, group, session_timeout_s=2.0, max_poll_interval_s=2.0) as again:
        again.wait_assigned(30.0)
        return again.poll(1.0) == [] and all(v == 0 for v in again.lag().values())


def test_a_record_the_store_refuses_is_dead_lettered_and_the_stream_moves_past_it(own_broker, store):
    """A real ClickHouse constraint makes the insert of one event fail every time (a fault injector in
    the store itself). The batch is retried, then written in halves down to that one record, which is
    dead-lettered with the store's error; every other event is stored and scored (its Xid finding and
    drain), and the group's offsets are committed past the poison."""
    tag = uuid.uuid4().hex[:8]
    poison = f"{tag}-poison"
    store.command(f"ALTER TABLE events ADD CONSTRAINT fault_injected CHECK message != '{poison}'")
    events = [_xid(tag, k) for k in range(12)]
    events.insert(6, Event(node=f"{tag}-bad", ts=T0 + 5.5, kind=EventKind.PROBE_ERROR, message=poison))
    with Producer(own_broker.dsn, event_time_stamps=True) as producer:
        for e in events:
            producer.publish(e)
        producer.flush()
    group = f"poison-insert-{tag}"
    with Runner(own_broker.dsn, store, group=group, retry=_no_wait(), registry=CollectorRegistry()) as runner:
        _run_until(runner, len(events))
        assert runner.retry.failed_total >= 3  # the whole batch three times, then its halves
    letters = _letters(own_broker.dsn, poison, 1)
    assert len(letters) == 1
    assert letters[0].topic == Topic.EVENTS.value and letters[0].reason.startswith("store: ")
    assert "fault_injected" in letters[0].reason
    stored = store.query("SELECT message FROM events FINAL WHERE startsWith(message, {t:String})", {"t": tag}).rows
    assert sorted(m for (m,) in stored) == sorted(e.message for e in events if e.message != poison)
    xids = [f for f in store.findings(kind=FindingKind.XID.value) if f.node.startswith(tag)]
    assert len(xids) == 4  # one episode per node, scored as if the poison had never been there
    assert {r.node for r in store.recommendations(action="drain") if r.node.startswith(tag)} == {f.node for f in xids}
    assert _committed_to_the_end(own_broker.dsn, group)


class UnreachableStoreFaultInjector:
    """The real store, except that its first ``failures`` step inserts raise :class:`StoreUnavailable`
    (the server went away for a while); everything else is passed through."""

    def __init__(self, real: object, failures: int) -> None:
        self._real = real
        self.failures = failures
        self.refused = 0

    def insert_steps(self, batches, *, dedup_token=None):
        if self.refused < self.failures:
            self.refused += 1
            raise StoreUnavailable("insert into rank_steps failed on chdb://…: Connection refused")
        return self._real.insert_steps(batches, dedup_token=dedup_token)

    def __getattr__(self, name: str):
        return getattr(self._real, name)


def test_an_unreachable_store_is_waited_out_without_loss_or_commit(own_broker, store):
    """The store refuses the first five step inserts as unreachable: the runner backs off and tries
    the same write again (it does not count towards the deterministic attempts, nothing is
    dead-lettered and nothing is committed meanwhile), then stores every row once."""
    tag = uuid.uuid4().hex[:8]
    batches = _steps(tag, 30)
    with Producer(own_broker.dsn, event_time_stamps=True) as producer:
        for b in batches:
            producer.publish(b)
        producer.flush()
    flaky = UnreachableStoreFaultInjector(store, failures=5)
    sleeps: list[float] = []
    group = f"unreachable-{tag}"
    commits: list[tuple[int, int]] = []  # (step records committed, step batches stored) at each commit
    with Runner(own_broker.dsn, flaky, group=group, retry=Retry(attempts=2, sleep=sleeps.append),  # type: ignore[arg-type]
                registry=CollectorRegistry()) as runner:
        real_commit = runner.consumer.commit

        def commit(hold=None):
            real_commit(hold)
            committed = sum(off for tp, off in runner.consumer._committed.items() if tp.topic == Topic.STEPS.value)
            rows = store.query("SELECT count() FROM rank_steps FINAL WHERE job = {j:String}",
                               {"j": f"{tag}-job"}).rows[0][0]
            commits.append((committed, rows // 4))

        runner.consumer.commit = commit  # type: ignore[method-assign]
        _run_until(runner, len(batches))
        assert runner.retry.transient_total == 5 and runner.retry.failed_total == 0
        assert runner.consumer.dead_lettered_total == 0
    assert flaky.refused == 5 and sleeps[:5] == [0.5, 1.0, 2.0, 4.0, 8.0]  # exponential backoff
    assert all(committed <= stored for committed, stored in commits)  # never past what is not stored
    assert commits[-1] == (len(batches), len(batches))
    rows = store.query("SELECT count(), uniqExact(step, rank) FROM rank_steps FINAL WHERE job = {j:String}",
                       {"j": f"{tag}-job"}).rows
    assert rows[0] == (4 * len(batches), 4 * len(batches))
    assert _committed_to_the_end(own_broker.dsn, group)


class RaisingPipelineFaultInjector(Pipeline):
    """The real pipeline, raising on any batch holding an event with the marked message."""

    def __init__(self, marked: str) -> None:
        super().__init__()
        self.marked = marked

    def feed(self, messages):
        if any(isinstance(m, Event) and m.message == self.marked for m in messages):
            raise ValueError("a detector cannot handle this record")
        return super().feed(messages)


def test_a_record_a_detector_raises_on_is_dead_lettered_and_the_rest_is_scored(own_broker, store):
    tag = uuid.uuid4().hex[:8]
    marked = f"{tag}-raises"
    events = [_xid(tag, k) for k in range(8)]
    events.insert(3, Event(node=f"{tag}-odd", ts=T0 + 2.5, kind=EventKind.PROBE_ERROR, message=marked))
    with Producer(own_broker.dsn, event_time_stamps=True) as producer:
        for e in events:
            producer.publish(e)
        producer.flush()
    with Runner(own_broker.dsn, store, group=f"raises-{tag}", pipeline=lambda: RaisingPipelineFaultInjector(marked),
                retry=_no_wait(), registry=CollectorRegistry()) as runner:
        _run_until(runner, len(events))
    letters = _letters(own_broker.dsn, marked, 1)
    assert len(letters) == 1 and letters[0].reason.startswith("detector: ValueError")
    stored = store.query("SELECT count() FROM events FINAL WHERE startsWith(message, {t:String})", {"t": tag}).rows
    assert stored[0][0] == len(events) - 1
    assert len([f for f in store.findings(kind=FindingKind.XID.value) if f.node.startswith(tag)]) == 4


def test_event_time_far_from_the_broker_timestamp_is_dead_lettered_naming_ts(own_broker, store):
    """Published with the sender's clock as the record timestamp (a probe's way): an event time an
    hour ahead and one two days behind are dead-lettered naming ``ts``; now is stored. A timeline
    stamped with its own event times (a replay) passes the same bounds, and a runner without them
    takes everything."""
    tag = uuid.uuid4().hex[:8]
    now = time.time()
    ahead = Event(node=f"{tag}-a", ts=now + 3600.0, kind=EventKind.PROBE_ERROR, message=f"{tag}-ahead")
    behind = Event(node=f"{tag}-b", ts=now - 2 * 86_400.0, kind=EventKind.PROBE_ERROR, message=f"{tag}-behind")
    fine = Event(node=f"{tag}-c", ts=now - 10.0, kind=EventKind.PROBE_ERROR, message=f"{tag}-now")
    replayed = Event(node=f"{tag}-d", ts=T0 - 30 * 86_400.0, kind=EventKind.PROBE_ERROR, message=f"{tag}-replay")
    with Producer(own_broker.dsn) as wall, Producer(own_broker.dsn, event_time_stamps=True) as replay:
        for e in (ahead, behind, fine):
            wall.publish(e)
        replay.publish(replayed)
        wall.flush()
        replay.flush()
    with Runner(own_broker.dsn, store, group=f"skew-{tag}", registry=CollectorRegistry()) as runner:
        _run_until(runner, 4)
    letters = {orjson.loads(d.raw)["message"].removeprefix(f"{tag}-"): d for d in _letters(own_broker.dsn, tag, 2)}
    assert set(letters) == {"ahead", "behind"}
    assert letters["ahead"].reason.startswith("ts: ") and "ahead of the record timestamp" in letters["ahead"].reason
    assert "max_ahead_s=300" in letters["ahead"].reason
    assert letters["behind"].reason.startswith("ts: ") and "max_behind_s=86400" in letters["behind"].reason
    stored = {m for (m,) in store.query("SELECT message FROM events FINAL WHERE startsWith(message, {t:String})",
                                        {"t": tag}).rows}
    assert stored == {f"{tag}-now", f"{tag}-replay"}
    with Runner(own_broker.dsn, store, group=f"unbounded-{tag}", max_ahead_s=None, max_behind_s=None,
                registry=CollectorRegistry()) as runner:
        _run_until(runner, 4)
        assert runner.consumer.dead_lettered_total == 0


# ---------------------------------------------------------------- a restart re-detects a fault
class Killed(BaseException):
    """The process dying (SIGKILL) at a chosen write: no handler in the runner sees it."""


class KillBeforePolicyStateFaultInjector:
    """The real store, except that once ``armed`` the first save of the policy state kills the
    runner: findings, recommendations and the outbox of that batch are written, the policy state that
    remembers the decisions and the offsets are not. Keeps a copy of every finding written."""

    def __init__(self, real: object) -> None:
        self._real = real
        self.armed = False
        self.findings: list = []

    def insert_findings(self, findings, *, dedup_token=None):
        self.findings += list(findings)
        return self._real.insert_findings(findings, dedup_token=dedup_token)

    def write_policy_state(self, *args, **kwargs):
        if self.armed:
            raise Killed("killed before the policy state was saved")
        return self._real.write_policy_state(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._real, name)


def _step_ts(s: int) -> float:
    """Slow steps first (40 s), then 20 s: a detector that saw the start estimates a longer step timeout."""
    return T0 + (40.0 * s if s < 10 else 400.0 + 20.0 * (s - 10))


def _hang_stream(tag: str, first: int, last: int, *, stuck_from: int | None, until: float | None = None) -> list:
    from fleethealth.schema import Telemetry

    job, out = f"{tag}-job", []
    for s in range(first, last + 1):
        for n in range(3):
            if stuck_from is not None and s >= stuck_from and n == 1:
                continue
            out.append(StepBatch(job=job, step=s, node=f"{tag}-n{n}", ts=_step_ts(s),
                                 ranks=np.arange(4, dtype=np.int32) + 4 * n, gpus=np.arange(4, dtype=np.int16),
                                 compute_s=np.full(4, 1.0)))
            out.append(Telemetry.from_columns(f"{tag}-n{n}", "r00", _step_ts(s), [0, 1, 2, 3], temp_c=[60.0] * 4))
    t = _step_ts(last) + 10.0
    while until is not None and t <= until:
        out += [Telemetry.from_columns(f"{tag}-n{n}", "r00", t, [0, 1, 2, 3], temp_c=[60.0] * 4) for n in range(3)]
        t += 10.0
    return out


def test_a_restart_that_re_detects_a_hang_makes_no_second_drain(own_broker, store):
    """The runner is killed after it stored the hang finding, its drain and the outbox, before the
    policy state and the offsets. The restarted one starts with empty detectors and replays from the
    last commit: it has not seen the job's slow early steps, so it estimates a shorter step timeout
    and concludes the same stall at another time — with the same finding id (the episode began at
    the job's last progress), hence the same drain id: one finding row, one drain recommendation, and
    on ``fh.recommendations`` only copies of that one id (which ``fleethealth act`` drops)."""
    from fleethealth.schema import Recommendation

    tag = uuid.uuid4().hex[:8]
    stall = 30
    history = _hang_stream(tag, 0, stall - 2, stuck_from=None)
    tail = _hang_stream(tag, stall - 1, stall, stuck_from=stall, until=_step_ts(stall) + 400.0)
    group = f"restart-{tag}"
    injector = KillBeforePolicyStateFaultInjector(store)
    with Producer(own_broker.dsn, event_time_stamps=True) as producer:
        for m in history:
            producer.publish(m)
        producer.flush()
        with Runner(own_broker.dsn, injector, group=group, registry=CollectorRegistry()) as first:  # type: ignore[arg-type]
            deadline = time.monotonic() + 60
            while not first.caught_up(first.process_once(0.3)):
                assert time.monotonic() < deadline
            injector.armed = True
            for m in tail:
                producer.publish(m)
            producer.flush()
            with pytest.raises(Killed):
                while time.monotonic() < deadline + 60:
                    first.process_once(0.3)
    [before] = [f for f in injector.findings if f.kind is FindingKind.HANG]

    with Runner(own_broker.dsn, store, group=group, registry=CollectorRegistry()) as second:
        deadline = time.monotonic() + 60
        # caught up on every input partition: until the killed member has left the group, the
        # coordinator may hand this one only part of them
        while not (second.caught_up(second.process_once(0.3))
                   and len(second.consumer.lag()) == len(INPUT_TOPICS) * 2):
            assert time.monotonic() < deadline
        second.drain()
        replayed = second.consumer.consumed_total
    assert replayed < len(history) + len(tail)  # it replayed from the last commit, not from the start

    [after] = store.findings(kind=FindingKind.HANG.value, job=f"{tag}-job")
    assert after.node == before.node == f"{tag}-n1"
    assert after.ts != before.ts  # concluded again, at another time
    assert after.id == before.id and after.episode_ts == before.episode_ts == _step_ts(stall)
    drains = [r for r in store.recommendations(action="drain") if r.node == f"{tag}-n1"]
    assert len(drains) == 1 and drains[0].finding_id == before.id

    published: list[Recommendation] = []
    with Consumer(own_broker.dsn, [Topic.RECOMMENDATIONS], f"recs-{tag}", session_timeout_s=2.0,
                  max_poll_interval_s=2.0) as recs:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (not published or recs.lag() and any(recs.lag().values())):
            published += [r.msg for r in recs.poll(0.3) if isinstance(r.msg, Recommendation)]
    mine = [r for r in published if r.node == f"{tag}-n1" and r.action.value == "drain"]
    assert mine and {r.id for r in mine} == {drains[0].id}
