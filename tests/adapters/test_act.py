"""The actor: guard, replay, rate limit, dry-run and the journal; and ``fh.recommendations`` end to end.

Rate-limit and journal tests use the real :class:`SlurmAdapter` under dry-run, which plans the
``scontrol`` command without running it. The end-to-end test publishes recommendations on the
real broker (``broker`` fixture), lets :func:`run_act` drain the real single-node Slurm
(``slurm_cluster``) and reads the ``scheduler_action`` events back from ``fh.events``.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from fleethealth.adapters import Actor, Journal, Outcome, SlurmAdapter, run_act
from fleethealth.adapters.base import ActionRecord
from fleethealth.errors import ConfigError
from fleethealth.schema import Action, Event, EventKind, Guard, Recommendation


def _rec(node: str, *, ts: float = 100.0, action: Action = Action.EVICT, guard: Guard = Guard.ALLOWED,
         job: str = "train-1") -> Recommendation:
    return Recommendation(action=action, node=node, ts=ts, reason="thermal straggler", guard=guard, job=job,
                          finding_id=f"f-{node}-{ts}-{action.value}")


class _Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_rate_limit_is_the_adapters_own():
    clock = _Clock()
    actor = Actor(SlurmAdapter(), dry_run=True, max_actions=3, window_s=600.0, clock=clock)
    outcomes = [actor.handle(_rec(f"n{i:04d}")).outcome for i in range(6)]
    assert outcomes == [Outcome.DRY_RUN] * 3 + [Outcome.RATE_LIMITED] * 3
    clock.now += 601.0  # the window has passed
    assert actor.handle(_rec("n0010")).outcome is Outcome.DRY_RUN
    assert actor.counts_[Outcome.RATE_LIMITED] == 3


def test_one_action_per_node_per_window_and_replays_are_silent():
    emitted: list[ActionRecord] = []
    actor = Actor(SlurmAdapter(), dry_run=True, emit=emitted.append, clock=_Clock())
    first = actor.handle(_rec("n0005"))
    assert first.outcome is Outcome.DRY_RUN
    assert first.operations == ("scontrol update NodeName=n0005 State=DRAIN "
                                f"Reason=fleethealth: evict {first.recommendation_id}: thermal straggler",)
    second = actor.handle(_rec("n0005", action=Action.QUARANTINE))
    assert second.outcome is Outcome.SKIPPED_ALREADY and first.recommendation_id in second.detail
    assert actor.handle(_rec("n0005")) is None  # the same recommendation again
    assert actor.replays_ == 1 and [e.outcome for e in emitted] == [Outcome.DRY_RUN, Outcome.SKIPPED_ALREADY]


def test_bad_node_names_fail_without_a_command():
    actor = Actor(SlurmAdapter(), clock=_Clock())
    record = actor.handle(_rec("n[0000-0999]"))
    assert record.outcome is Outcome.FAILED and "refusing node name" in record.detail
    assert record.operations == ()


def test_journal_survives_a_restart_and_a_torn_line(tmp_path):
    path = tmp_path / "act-slurm.jsonl"
    rec = _rec("n0007")
    Actor(SlurmAdapter(), journal=Journal(path), dry_run=True, clock=_Clock()).handle(rec)
    with path.open("ab") as fh:
        fh.write(b'{"recommendation_id": "torn')  # a crash mid-write
    restarted = Actor(SlurmAdapter(), journal=Journal(path), dry_run=True, clock=_Clock())
    assert restarted.handle(rec) is None
    assert restarted.handle(_rec("n0007", ts=200.0)).outcome is Outcome.SKIPPED_ALREADY
    assert len(path.read_text().splitlines()) == 3


def test_record_as_event_round_trips_through_the_schema():
    from fleethealth.schema import decode, encode

    record = Actor(SlurmAdapter(), dry_run=True, clock=_Clock(5.0)).handle(_rec("n0003"))
    event = decode(Event, encode(record.to_event()))
    assert event.kind is EventKind.SCHEDULER_ACTION and event.node == "n0003" and event.ts == 5.0
    assert ActionRecord.from_obj(event.data) == record


def test_invalid_rate_limit_is_a_config_error():
    from fleethealth.errors import ConfigError

    with pytest.raises(ConfigError):
        Actor(SlurmAdapter(), max_actions=0)


class _OnlyJob:
    """The real consumer, narrowed to this test's job (the session broker is shared by tests)."""

    def __init__(self, consumer, job: str) -> None:
        self.consumer = consumer
        self.job = job

    def poll(self, timeout_s: float = 1.0, max_records: int = 5000):
        return [r for r in self.consumer.poll(timeout_s, max_records) if getattr(r.msg, "job", None) == self.job]

    def commit(self) -> None:
        self.consumer.commit()


def test_act_consumes_the_topic_and_drains_real_slurm(broker, slurm_cluster):
    from fleethealth.bus import Consumer, Producer, ensure_topics

    ensure_topics(broker.dsn)
    job = f"act-{uuid.uuid4().hex[:8]}"
    node = slurm_cluster.node
    recs = [_rec(node, job=job, guard=Guard.NEEDS_HUMAN, ts=1.0), _rec(node, job=job, ts=2.0),
            _rec("n0999", job=job, action=Action.DRAIN, ts=3.0), _rec(node, job=job, action=Action.PAGE, ts=4.0)]
    adapter = SlurmAdapter(env=slurm_cluster.env)
    with Producer(broker.dsn) as producer:
        for rec in (*recs, recs[1]):  # the allowed one twice: a replay on the topic
            producer.publish(rec)
        producer.flush()
        with Consumer(broker.dsn, ["fh.recommendations"], f"g-{job}", producer=producer) as consumer:
            actor = Actor(adapter, emit=lambda r: producer.publish(r.to_event()), clock=lambda: 50.0)
            stop = threading.Event()
            made = 0
            for _ in range(40):
                made += run_act(_OnlyJob(consumer, job), actor, stop, poll_s=0.5, max_polls=1)
                if made + actor.replays_ >= 5:
                    break
        producer.flush()
    try:
        assert made == 4 and actor.replays_ == 1
        assert actor.counts_[Outcome.DONE] == 1 and actor.counts_[Outcome.SKIPPED_GUARD] == 1
        assert actor.counts_[Outcome.FAILED] == 1 and actor.counts_[Outcome.SKIPPED_UNSUPPORTED] == 1
        assert adapter.drain_reasons()[node].startswith(f"fleethealth: evict {recs[1].id}")
    finally:
        adapter.resume(node)
    with Consumer(broker.dsn, ["fh.events"], f"e-{job}") as events:
        seen: list[Event] = []
        for _ in range(40):
            seen += [r.msg for r in events.poll(0.5) if r.msg.job == job]
            if len(seen) >= 4:
                break
    assert {e.kind for e in seen} == {EventKind.SCHEDULER_ACTION}
    assert sorted(e.data["outcome"] for e in seen) == ["done", "failed", "skipped_guard", "skipped_unsupported"]
    failed = next(e for e in seen if e.data["outcome"] == "failed")
    assert "n0999" in failed.data["detail"]


def test_public_surface():
    import fleethealth.adapters as adapters

    assert set(adapters.__all__) == {"ActionRecord", "Actor", "Journal", "KubernetesAdapter", "LeftAlone", "Outcome",
                                     "SchedulerAdapter", "SchedulerError", "SlurmAdapter", "UnknownNode",
                                     "check_node_name", "run_act"}
    assert all(hasattr(adapters, name) for name in adapters.__all__)
    assert isinstance(SlurmAdapter(), adapters.SchedulerAdapter)


def test_cli_act_dry_run_journals_and_publishes(broker, tmp_path):
    """``fleethealth act`` as a process: consume, journal, leave the scheduler alone, then exit when idle."""
    import os
    import subprocess
    import sys

    import orjson

    from fleethealth.bus import Producer, ensure_topics

    ensure_topics(broker.dsn)
    job = f"cli-{uuid.uuid4().hex[:8]}"
    rec = _rec("n0042", job=job, action=Action.QUARANTINE, ts=time.time())
    old = _rec("n0043", job=job, ts=time.time() - 3600.0)  # an hour old: beyond the default bound
    with Producer(broker.dsn) as producer:
        producer.publish(rec)
        producer.publish(old)
        producer.flush()
    done = subprocess.run([sys.executable, "-m", "fleethealth", "act", "--scheduler", "slurm", "--dry-run",
                           "--kafka", broker.dsn, "--group", f"g-{job}", "--data", str(tmp_path), "--idle-exit", "1",
                           "--metrics-port", "0"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PATH": "/nonexistent"})
    assert done.returncode == 0, done.stderr
    journal = [orjson.loads(line) for line in (tmp_path / "act-slurm.jsonl").read_text().splitlines()]
    mine, stale = sorted((r for r in journal if r["job"] == job), key=lambda r: r["node"])
    assert mine["outcome"] == "dry_run" and mine["recommendation_id"] == rec.id
    assert stale["outcome"] == "skipped_stale" and stale["recommendation_id"] == old.id
    assert mine["operations"] == [f"scontrol update NodeName=n0042 State=DRAIN "
                                  f"Reason=fleethealth: quarantine {rec.id}: thermal straggler"]
    assert "dry_run" in done.stderr


def test_cli_act_without_a_bus_is_a_clear_error(monkeypatch, capsys):
    from fleethealth.commands import main

    monkeypatch.delenv("FLEETHEALTH_KAFKA", raising=False)
    assert main(["act", "--scheduler", "slurm", "--dry-run"]) == 2
    assert "give --kafka DSN" in capsys.readouterr().err


def test_stale_recommendations_are_recorded_not_acted_on():
    clock = _Clock(10_000.0)
    actor = Actor(SlurmAdapter(), dry_run=True, max_age_s=900.0, clock=clock)
    stale = actor.handle(_rec("n0001", ts=clock.now - 901.0))
    assert stale.outcome is Outcome.SKIPPED_STALE and "901 s old" in stale.detail
    assert actor.handle(_rec("n0001", ts=clock.now - 10.0)).outcome is Outcome.DRY_RUN


def _flaky_slurm(tmp_path, failures: int) -> tuple[SlurmAdapter, object]:
    """Real ``sinfo``/``scontrol`` executables (shell scripts) for one node ``n0007``: ``sinfo``
    fails the first ``failures`` calls as an unreachable slurmctld does; ``scontrol`` logs its argv."""
    calls = tmp_path / "scontrol.log"
    count = tmp_path / "sinfo.count"
    sinfo = tmp_path / "sinfo"
    sinfo.write_text(f"""#!/bin/sh
n=$(cat {count} 2>/dev/null || echo 0); echo $((n + 1)) > {count}
if [ "$n" -lt {failures} ]; then echo "slurm_load_node: Unable to contact slurm controller" >&2; exit 1; fi
echo n0007
""")
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    for tool in (sinfo, scontrol):
        tool.chmod(0o755)
    return SlurmAdapter(scontrol=str(scontrol), sinfo=str(sinfo)), calls


def test_failed_action_is_retried_when_delivered_again(tmp_path):
    """A failed scheduler call must not make the redelivered recommendation a replay."""
    adapter, calls = _flaky_slurm(tmp_path, failures=1)
    journal_path = tmp_path / "journal.jsonl"
    actor = Actor(adapter, journal=Journal(journal_path), clock=_Clock())
    rec = _rec("n0007")
    first = actor.handle(rec)
    assert first.outcome is Outcome.FAILED and "attempt 1 of 3" in first.detail and not calls.exists()
    # the topic redelivers it (or the actor restarts on the same journal): tried again, drained
    again = Actor(adapter, journal=Journal(journal_path), clock=_Clock()).handle(rec)
    assert again is not None and again.outcome is Outcome.DONE
    assert calls.read_text().startswith("update NodeName=n0007 State=DRAIN")
    # now it is handled: a further delivery is a replay
    assert Actor(adapter, journal=Journal(journal_path), clock=_Clock()).handle(rec) is None


def test_failed_action_stays_pending_and_is_retried_with_backoff(tmp_path):
    """A controller that is down: one clear line, the recommendation stays pending, and the actor
    tries it again after 60 s, then 120 s, never marking it done until Slurm took the drain."""
    adapter, calls = _flaky_slurm(tmp_path, failures=2)
    clock = _Clock()
    actor = Actor(adapter, clock=clock)
    rec = _rec("n0007")
    first = actor.handle(rec)
    assert first.outcome is Outcome.FAILED and "Unable to contact slurm controller" in first.detail
    assert "retried in 60 s" in first.detail and rec.id in actor.pending_
    assert actor.retry_due() == []  # not yet
    clock.now += 60.0
    (second,) = actor.retry_due()
    assert second.outcome is Outcome.FAILED and "retried in 120 s" in second.detail
    clock.now += 119.0
    assert actor.retry_due() == []
    clock.now += 1.0
    (third,) = actor.retry_due()
    assert third.outcome is Outcome.DONE and actor.pending_ == {}
    assert calls.read_text().startswith("update NodeName=n0007 State=DRAIN")
    assert actor.retry_due() == [] and actor.handle(rec) is None


def test_retries_are_bounded(tmp_path):
    adapter, calls = _flaky_slurm(tmp_path, failures=100)
    actor = Actor(adapter, max_attempts=2, clock=_Clock())
    rec = _rec("n0007")
    assert actor.handle(rec).outcome is Outcome.FAILED
    last = actor.handle(rec)
    assert last.outcome is Outcome.FAILED and "giving up" in last.detail and actor.pending_ == {}
    assert actor.handle(rec) is None and actor.replays_ == 1 and not calls.exists()
    with pytest.raises(ConfigError, match="max_attempts"):
        Actor(adapter, max_attempts=0)


def test_cli_act_bounds_staleness_by_default():
    """Without --max-age-s, ``fleethealth act`` skips a recommendation older than twice the policy
    engine's staleness bound (it used to act on any age)."""
    from fleethealth.adapters.act import DEFAULT_MAX_AGE_S
    from fleethealth.commands import build_parser
    from fleethealth.policy.engine import PolicyEngine

    assert DEFAULT_MAX_AGE_S == 2 * PolicyEngine().stale_after_s
    args = build_parser().parse_args(["act", "--scheduler", "slurm"])
    assert args.max_age_s == DEFAULT_MAX_AGE_S
    assert build_parser().parse_args(["act", "--scheduler", "slurm", "--max-age-s", "0"]).max_age_s == 0
    help_text = build_parser()._subparsers._group_actions[0].choices["act"].format_help()
    assert "default: 1800" in help_text
