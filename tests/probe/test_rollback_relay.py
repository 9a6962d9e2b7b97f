"""The probe's relay of rollback recommendations on the real broker: the newest rollback of each job
seen on the node lands atomically in RUN_DIR/rollback/JOB.json, where the in-job inbox reads it."""

from __future__ import annotations

import time

import pytest

from fleethealth.bus import Consumer, Producer, ensure_topics
from fleethealth.injob.inbox import RollbackInbox
from fleethealth.payloads.advice import advice_path, read_advice
from fleethealth.probe.rollback import RollbackRelay
from fleethealth.schema import Action, Guard, Recommendation, Topic


def _rollback(job: str, ts: float, target: int | None, failed: int = 70) -> Recommendation:
    return Recommendation(action=Action.ROLLBACK, node="n7", ts=ts, reason="sdc", job=job,
                          guard=Guard.ALLOWED if target is not None else Guard.NEEDS_HUMAN, finding_id=f"f-{job}-{ts}",
                          evidence={"target_step": target, "target_uri": None if target is None else f"ckpt-{target}",
                                    "failed_step": failed, "classification": "transient"})


def _wait(predicate, what: str, timeout_s: float = 30.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def test_relay_writes_the_newest_rollback_of_jobs_on_this_node(broker, tmp_path) -> None:
    ensure_topics(broker.dsn, topics=[Topic.RECOMMENDATIONS.value, Topic.DEADLETTER.value])
    consumer = Consumer(broker.dsn, [Topic.RECOMMENDATIONS.value], "fh-rollback-n1", from_beginning=True)
    relay = RollbackRelay(tmp_path, "n1", consumer=consumer, poll_s=0.1)
    relay.saw_jobs({"train-a", None})
    relay.start()
    try:
        now = time.time()
        with Producer(broker.dsn) as producer:
            producer.publish(_rollback("train-a", now, 40))
            producer.publish(Recommendation(action=Action.QUARANTINE, node="n7", ts=now, reason="sdc", job="train-a"))
            producer.publish(_rollback("train-b", now, 10))          # not on this node (yet)
            producer.publish(_rollback("train-a", now - 60, 20))     # older: never replaces a newer one
            producer.publish(_rollback("train-a", now + 1, 60, 80))
            producer.flush()
        inbox = RollbackInbox("train-a", tmp_path)
        _wait(lambda: (inbox.poll() or inbox.latest) is not None and inbox.latest.target_step == 60,
              "the newest rollback of train-a in its advice file")
        assert inbox.latest.failed_step == 80 and inbox.latest.target_uri == "ckpt-60"
        assert not advice_path(tmp_path, "train-b").exists()
        relay.saw_jobs({"train-b"})  # its first datagram on this node: the held advice is written
        assert read_advice(advice_path(tmp_path, "train-b")).target_step == 10
        assert sorted(p.name for p in (tmp_path / "rollback").iterdir()) == ["train-a.json", "train-b.json"]
        assert relay.errors_total == 0
    finally:
        relay.close()


def test_needs_human_is_relayed_without_a_target(tmp_path) -> None:
    relay = RollbackRelay(tmp_path, "n1")
    relay.saw_jobs({"j"})
    assert relay.handle([_rollback("j", 5.0, None)]) == 1
    advice = RollbackInbox("j", tmp_path).poll()
    assert advice is not None and advice.target_step is None and advice.guard == "needs_human"
    assert relay.handle([_rollback("j", 4.0, 3)]) == 0  # older than what is there


class _OneRecommendation:
    """A consumer double that hands the relay one rollback, then nothing (the broker test above
    covers the real consumer; this one covers the probe's hook)."""

    def __init__(self, rec: Recommendation) -> None:
        from fleethealth.bus import Record

        self.records = [Record(Topic.RECOMMENDATIONS.value, 0, 0, None, rec)]
        self.commits = 0

    def poll(self, timeout_s: float) -> list:
        out, self.records = self.records, []
        if not out:
            time.sleep(timeout_s)
        return out

    def commit(self) -> None:
        self.commits += 1

    def close(self) -> None:
        return None


@pytest.fixture
def replay(recording):  # noqa: ANN001, ANN201 - as tests/probe/test_daemon.py builds it
    from fleethealth.probe.recorded import NvmlReplay

    return NvmlReplay(recording("nvml_h100_faults.json"))


def test_probe_tells_the_relay_which_jobs_run_on_its_node(tmp_path, replay) -> None:
    import orjson

    from fleethealth.probe.daemon import Probe, ProbeConfig
    from fleethealth.probe.delivery import Delivery
    from fleethealth.probe.nvml import NvmlSource
    from fleethealth.probe.spool import Spool

    run = tmp_path / "run"
    sock_path = str(run / "probe.sock")
    relay = RollbackRelay(run, "n0003", consumer=_OneRecommendation(_rollback("job-a", time.time(), 40)), poll_s=0.05)
    config = ProbeConfig(node="n0003", rack="r00", socket_path=sock_path, metrics_port=None)
    probe = Probe(NvmlSource("n0003", "r00", nvml=replay, xid_events=False), config,
                  delivery=Delivery("kafka://127.0.0.1:9", Spool(tmp_path / "spool")), relay=relay)
    probe.open(background_delivery=False)
    import socket

    rank = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        _wait(lambda: relay._consumer.commits == 1, "the relay to take the recommendation")
        assert not advice_path(run, "job-a").exists()  # job-a has not been seen on this node yet
        rank.sendto(orjson.dumps({"t": "e", "event": {"kind": "job_start", "job": "job-a", "rank": 0, "step": 0,
                                                       "data": {}}}), sock_path)
        _wait(lambda: probe.health().datagrams_total >= 1, "the datagram")
        probe.tick()
        assert read_advice(advice_path(run, "job-a")).target_step == 40
    finally:
        rank.close()
        probe.close(drain_timeout_s=0.0)
