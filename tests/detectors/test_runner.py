"""The detector runner on the real broker and chDB: SIGKILLed at random points it neither loses nor
duplicates a row, and a flood of malformed input is dead-lettered with reasons while valid input
keeps flowing.

The runner consumes every input topic from the beginning, so each of these tests starts a broker of
its own (the same Tansu binary as the session ``broker`` fixture, ~0.3 s): messages other tests left
in shared topics would otherwise be consumed too, and the counts checked here would not be exact.
"""

from __future__ import annotations

import math
import os
import queue
import random
import runpy
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from fleethealth.broker import EmbeddedBroker
from fleethealth.bus import Consumer, DeadLetter, Producer
from fleethealth.detectors.runner import Runner
from fleethealth.detectors.stages import Stage, takes_event
from fleethealth.schema import GPU_FIELDS, Event, EventKind, StepBatch, Telemetry, Topic
from fleethealth.sim import FleetSim, Scenario
from fleethealth.store import open_store

WORKER = Path(__file__).with_name("_runner_worker.py")


OWN_BROKER_PARTITIONS = 4  # own_broker (tests/detectors/conftest.py)


def _uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


# ---------------------------------------------------------------------------------------- crash test
class _Worker:
    """One runner process; its output lines are read by a thread into a queue."""

    def __init__(self, dsn: str, store_dir: Path, group: str, max_records: int, kill_at: str | None = None,
                 store_every_s: float = 0.0) -> None:
        extra = [] if kill_at is None else [kill_at]
        self.proc = subprocess.Popen([sys.executable, str(WORKER), dsn, str(store_dir), group, str(max_records),
                                      *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "FH_STORE_EVERY_S": str(store_every_s)})
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put("<eof>")

    def wait_for(self, predicate, timeout_s: float) -> str | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.05)
            except queue.Empty:
                continue
            self.seen.append(line)
            if predicate(line) or line == "<eof>":
                return line
        return None

    @property
    def polled(self) -> int:
        return sum(int(line.split()[1]) for line in self.seen if line.startswith("polled "))


def _published_scenario(dsn: str, job: str, steps: int) -> tuple[dict[tuple[int, int], float], int, int]:
    """Publish a small fleet's run; return ``{(step, rank): compute_s}``, telemetry rows and events."""
    scenario = Scenario.from_obj({
        "seed": 11, "fleet": {"racks": 2, "nodes_per_rack": 2, "gpus_per_node": 4},
        "job": {"id": job, "steps": steps, "step_time_s": 1.0},
        "faults": [{"kind": "thermal_straggler", "node": "n0001", "gpu": 2, "start_step": 40, "slowdown": 0.3}],
    })
    expected: dict[tuple[int, int], float] = {}
    gpu_rows = events = 0
    with Producer(dsn, client_id="crash-fleet", event_time_stamps=True) as producer:
        for tick in FleetSim(scenario).run():
            for msg in (*tick.telemetry, *tick.batches, *tick.events):
                producer.publish(msg)
            for b in tick.batches:
                expected.update(zip(((b.step, int(r)) for r in b.ranks), b.compute_s.tolist(), strict=True))
            gpu_rows += sum(t.gpu.size for t in tick.telemetry)
            events += len(tick.events)
        producer.flush()
    return expected, gpu_rows, events


@pytest.mark.parametrize("store_every_s", [0.0, 0.3], ids=["every-poll", "held-0.3s"])
def test_sigkilled_runner_restarts_and_every_rank_step_is_stored_exactly_once(own_broker: EmbeddedBroker,
                                                                               tmp_path: Path,
                                                                               store_every_s: float) -> None:
    """Kill the runner (SIGKILL, no cleanup) at three random points, restart it in the same consumer
    group each time, let the last one finish: every published (job, step, rank) row is in
    ``rank_steps`` exactly once, with the value that was published; telemetry and events likewise.
    The same with the sample rows of several polls held for one insert (``store_every_s``; 25 records a
    poll, a poll about every 0.05 s): a kill then also loses rows held and not written, which the
    restarted runner reads again from the commit, since no offset was committed past them.

    Rows are counted with ``FINAL``: a replay after a crash may write a block again under a different
    deduplication token (the records a restarted runner polls together differ from the killed one's),
    so exactly-once is what ReplacingMergeTree on the natural key (job, step, rank) makes of it — one
    row per key after a merge, and with ``FINAL`` before one. Inserts repeated with the same token
    (offsets covered) are dropped at insert time. The test also checks that the kills did replay
    records (more records polled over all runs than were published), so the path is exercised.
    """
    job = _uid("crash")
    steps = 400
    expected, gpu_rows, n_events = _published_scenario(own_broker.dsn, job, steps)
    store_dir = tmp_path / "store"
    group = _uid("crash-group")
    rng = random.Random(20261129)
    polled_total = kills = 0
    for _ in range(3):  # (test_stage_crash.py kills three replicas of a stage ten times)
        worker = _Worker(own_broker.dsn, store_dir, group, max_records=25, store_every_s=store_every_s)
        got = worker.wait_for(lambda line: line.startswith("polled ") and line != "polled 0", timeout_s=30.0)
        assert got is not None and got != "<eof>", f"the runner made no progress: {worker.seen[-5:]}"
        time.sleep(rng.uniform(0.0, 0.5))
        worker.proc.send_signal(signal.SIGKILL)
        assert worker.proc.wait(timeout=10) == -signal.SIGKILL
        worker.wait_for(lambda line: False, timeout_s=0.2)  # collect what it printed before dying
        assert "done" not in worker.seen, "the runner finished before it was killed: nothing left to crash on"
        kills += 1
        polled_total += worker.polled
    final = _Worker(own_broker.dsn, store_dir, group, max_records=25, store_every_s=store_every_s)
    assert final.wait_for(lambda line: line == "done", timeout_s=240.0) == "done", final.seen[-5:]
    assert final.proc.wait(timeout=10) == 0
    polled_total += final.polled
    assert kills == 3
    published = len(expected) // 4 + gpu_rows // 4 + n_events  # 4 ranks / GPUs per message
    assert polled_total > published, "no record was delivered twice: the kills never interrupted a batch"

    with open_store(f"chdb://{store_dir}") as store:
        res = store.query("SELECT step, rank, compute_s FROM rank_steps FINAL WHERE job = {job:String} "
                          "ORDER BY step, rank", {"job": job})
        keys = [(int(s), int(r)) for s, r, _ in res.rows]
        assert len(keys) == len(set(keys)) == len(expected) == steps * 16
        assert {k: c for (k, (_, _, c)) in zip(keys, res.rows, strict=True)} == expected
        assert store.query("SELECT count() FROM gpu_samples FINAL").rows[0][0] == gpu_rows
        assert store.query("SELECT count() FROM events FINAL").rows[0][0] == n_events
        dup = store.query("SELECT id, count() AS c FROM findings FINAL GROUP BY id HAVING c > 1")
        assert dup.rows == []
        stragglers = store.findings(kind="straggler", job=job)
        assert {(f.node, f.gpu) for f in stragglers} == {("n0001", 2)}


def _topic_records(dsn: str, topic: Topic, expected: int = 0, timeout_s: float = 120.0) -> list:
    """Every record on ``topic``, read from the beginning to its end by a group of its own: until every
    partition the group assigned is read to its end (as its last fetch knows it) and at least ``expected``
    distinct ids were read. Published before this is called, so the end does not move; the bound is for
    a broker that stops answering, not a guess at how long reading takes on a loaded machine."""
    records: list = []
    with Consumer(dsn, [topic.value], _uid("read")) as consumer:
        consumer.wait_assigned(timeout_s=timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            records += consumer.poll(0.5)
            lag = consumer.lag()
            if lag and all(v == 0 for v in lag.values()) and len({r.msg.id for r in records}) >= expected:
                return records
            if time.monotonic() > deadline:
                raise AssertionError(f"{topic.value} was not read to its end within {timeout_s} s: lag {lag}, "
                                     f"{len({r.msg.id for r in records})} of at least {expected} ids read")


def _topic_ids(dsn: str, topic: Topic, expected: int, timeout_s: float = 120.0) -> list[str]:
    """The ids of every record on ``topic`` (republished copies included), read to its end."""
    return [r.msg.id for r in _topic_records(dsn, topic, expected, timeout_s)]


def test_killed_between_every_write_and_publish_no_recommendation_is_lost(own_broker: EmbeddedBroker,
                                                                         tmp_path: Path) -> None:
    """Kill the runner right after each step of its write/publish path in turn — findings stored,
    recommendations stored, outbox rows stored pending, policy state saved, one message queued, the
    broker's acknowledgement, the outbox marked published — restarting it each time; the last run
    finishes. Then every stored recommendation that asks for an action is on ``fh.recommendations``,
    each id once after dropping republished copies (what ``fleethealth act`` does by id), every copy
    identical; nothing else is there (no ``none``), and the outbox has nothing pending. Before the
    outbox, a kill after the policy state left such recommendations stored and never published."""
    KILL_POINTS = runpy.run_path(str(WORKER))["KILL_POINTS"]  # noqa: N806 - the worker's constant
    job = _uid("outbox")
    scenario = Scenario.from_obj({
        "seed": 5, "fleet": {"racks": 2, "nodes_per_rack": 2, "gpus_per_node": 4},
        "job": {"id": job, "steps": 260, "step_time_s": 1.0},
        "checks": {"selfcheck_every": 20, "replay_every": 40, "checkpoint_every": 10},
        "faults": [{"kind": "thermal_straggler", "node": "n0001", "gpu": 2, "start_step": 30, "slowdown": 0.3},
                   {"kind": "xid", "node": "n0002", "gpu": 1, "step": 60, "code": 79},
                   {"kind": "sdc_transient", "node": "n0003", "gpu": 0, "start_step": 90}],
    })
    with Producer(own_broker.dsn, client_id="outbox-fleet", event_time_stamps=True) as producer:
        for tick in FleetSim(scenario).run():
            for msg in (*tick.telemetry, *tick.batches, *tick.events):
                producer.publish(msg)
        producer.flush()
    store_dir = tmp_path / "store"
    group = _uid("outbox-group")
    killed: list[str] = []
    for point in KILL_POINTS:
        worker = _Worker(own_broker.dsn, store_dir, group, max_records=40, kill_at=f"{point}:1")
        end = worker.wait_for(lambda line: line.startswith("killed at") or line == "done", timeout_s=240.0)
        assert end is not None and end != "<eof>", f"no kill at {point}: {worker.seen[-5:]}"
        if end == "done":
            assert worker.proc.wait(timeout=10) == 0
            break
        assert worker.proc.wait(timeout=10) == -signal.SIGKILL
        killed.append(point)
    assert killed == list(KILL_POINTS), f"the input ran out before every kill point was reached: {killed}"
    final = _Worker(own_broker.dsn, store_dir, group, max_records=40)  # (a bound, not a wait: on a loaded
    # machine the last run replays the whole input in batches of 40 for minutes)
    assert final.wait_for(lambda line: line == "done", timeout_s=240.0) == "done", final.seen[-5:]
    assert final.proc.wait(timeout=10) == 0

    with open_store(f"chdb://{store_dir}") as store:
        stored = store.query("SELECT id, action FROM recommendations FINAL").rows
        pending = store.pending_outbox()
        payloads = dict(store.query("SELECT id, payload FROM outbox FINAL WHERE topic = {t:String}",
                                    {"t": Topic.RECOMMENDATIONS.value}).rows)
    actionable = {i for i, action in stored if action != "none"}
    assert {"evict", "drain", "quarantine", "rollback"} <= {a for _, a in stored}, stored
    assert pending == []
    on_topic = _topic_ids(own_broker.dsn, Topic.RECOMMENDATIONS, expected=len(actionable))
    assert set(on_topic) == actionable
    assert {i for i, a in stored if a == "none"}.isdisjoint(on_topic)
    copies = _topic_records(own_broker.dsn, Topic.RECOMMENDATIONS, len(actionable))
    assert len(copies) >= len(actionable)
    assert all(orjson.loads(payloads[r.msg.id]) == r.msg.to_obj() for r in copies)


def test_a_failed_publish_keeps_the_decisions_in_the_outbox_until_the_broker_takes_them(
        own_broker: EmbeddedBroker, tmp_path: Path) -> None:
    """The broker refuses every publish for a while (the producer's flush raises): the runner keeps
    consuming, storing and committing, counts the failures and keeps the findings and recommendations
    pending in the outbox; once the broker takes them again every one is published and marked."""
    from fleethealth.errors import BusError

    _published_scenario(own_broker.dsn, "refused-bus", 200)
    with open_store(f"chdb://{tmp_path}/store") as store:
        store.migrate()
        with Runner(own_broker.dsn, store, group=_uid("refused"), registry=CollectorRegistry(),
                    session_timeout_s=2.0, max_poll_interval_s=30.0) as runner:
            real_flush = runner.producer.flush
            broken = {"on": True, "failed": 0}

            def flush(timeout_s: float = 10.0) -> None:
                if broken["on"]:
                    broken["failed"] += 1
                    raise BusError("broker refused the batch")
                real_flush(timeout_s)

            runner.producer.flush = flush  # type: ignore[method-assign]
            deadline = time.monotonic() + 60
            while not store.pending_outbox() and time.monotonic() < deadline:
                runner.process_once(0.5)
            while time.monotonic() < deadline and runner.consumer.consumed_total < 200 * 4:
                runner.process_once(0.5)
            pending = store.pending_outbox()
            assert pending and broken["failed"] > 0 and runner.pending_
            assert {t for t, *_ in pending} <= {Topic.FINDINGS.value, Topic.RECOMMENDATIONS.value}
            broken["on"] = False
            runner.drain()
            runner.process_once(0.2)
            assert store.pending_outbox() == [] and runner.pending_ == []
        outbox = store.query("SELECT topic, id FROM outbox FINAL").rows
    on_topic = set(_topic_ids(own_broker.dsn, Topic.FINDINGS, 1)) | set(_topic_ids(
        own_broker.dsn, Topic.RECOMMENDATIONS, 1))
    assert {i for _, i in outbox} == on_topic and {i for _, i, *_ in pending} <= on_topic


def test_refused_step_batches_are_not_stored(own_broker: EmbeddedBroker, tmp_path: Path) -> None:
    """A forged batch naming another node's ranks for a step it already reported, and one claiming an
    implausible step, are refused by the assembler and so never reach ``rank_steps``: the real rows
    stay as they were published."""
    def batch(node: str, step: int, ranks: list[int], value: float) -> StepBatch:
        return StepBatch(job="forged", step=step, node=node, ts=1000.0 + min(step, 100),
                         ranks=np.array(ranks, dtype=np.int32), gpus=np.arange(len(ranks), dtype=np.int16),
                         compute_s=np.full(len(ranks), value))

    with Producer(own_broker.dsn, event_time_stamps=True) as producer:
        for step in range(20):
            producer.publish(batch("n0001", step, [0, 1], 1.0))
            producer.publish(batch("n0002", step, [2, 3], 1.0))
            if step >= 5:  # after the ranks' owners are known
                producer.publish(batch("n6666", step, [0, 3], 9.0))
        producer.publish(batch("n6666", 2**63 - 1, [0, 1], 9.0))
        producer.flush()
    with open_store(f"chdb://{tmp_path}/store") as store:
        store.migrate()
        with Runner(own_broker.dsn, store, group=_uid("forged"), publish=False, registry=CollectorRegistry(),
                    session_timeout_s=2.0, max_poll_interval_s=30.0) as runner:
            deadline = time.monotonic() + 60
            while runner.consumer.consumed_total < 20 * 2 + 15 + 1 and time.monotonic() < deadline:
                runner.process_once(0.5)
            runner.drain()
            asm = runner.pipeline.assembler
            refused = asm.foreign_total + asm.implausible_total + asm.duplicate_total
        rows = store.query("SELECT node, compute_s FROM rank_steps FINAL WHERE job = 'forged'").rows
    assert refused >= 16
    assert len(rows) == 20 * 4 and {n for n, _ in rows} == {"n0001", "n0002"} and {c for _, c in rows} == {1.0}


# ---------------------------------------------------------------------------------------- fuzz test
T0 = 1_767_225_600.0
_STR_FIELDS = {"job", "node", "rack"}
_REQUIRED = {
    Topic.STEPS: ("job", "step", "node", "ts", "ranks", "gpus", "compute_s"),
    Topic.TELEMETRY: ("node", "rack", "ts", "gpu"),
    Topic.EVENTS: ("node", "ts", "kind"),
}
_DATA_KEYS = ("check", "passed", "classification", "digests", "duration_s", "peer_ranks", "culprit_rank",
              "tolerance", "stacks", "last_collective", "timeout_s", "suite", "verdict", "step", "uri",
              "last_verified_step", "cause", "detected_by", "lost_steps", "restart_s", "detection_s",
              "isolation_s", "reconfiguration_s", "reload_s", "severity")
_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**6), st.text(max_size=4),
                     st.floats(allow_nan=False, allow_infinity=False, width=32))
_NOT_A_STRING = st.one_of(st.none(), st.just(""), st.integers(), st.booleans(), st.lists(st.integers(), max_size=2))
_NOT_AN_ARRAY = st.one_of(st.none(), st.integers(), st.text(max_size=3), st.booleans(),
                          st.dictionaries(st.text(max_size=2), st.integers(), max_size=2))
_NOT_A_TIME = st.one_of(st.floats(max_value=-1e-6, allow_nan=False, allow_infinity=False),
                        st.integers(max_value=-1), st.text(max_size=3), st.booleans(), st.none(),
                        st.lists(st.floats(0, 1), max_size=2))
_NOT_A_COUNT = st.one_of(st.integers(max_value=-1), st.integers(2**63, 2**64 - 1), st.text(max_size=3), st.booleans(),
                         st.floats(allow_nan=False, allow_infinity=False), st.none())
_BAD_COMPUTE = st.one_of(st.floats(max_value=-1e-6, allow_nan=False, allow_infinity=False),
                         st.floats(min_value=86_400.5, allow_nan=False, allow_infinity=False),
                         st.none(), st.text(max_size=3), st.booleans())


def _good(topic: Topic, tag: str, i: int) -> dict:
    if topic is Topic.STEPS:
        return {"v": 1, "job": f"{tag}-bad", "step": i, "node": "n0", "ts": T0 + i, "ranks": [0, 1, 2],
                "gpus": [0, 1, 2], "compute_s": [1.0, 1.1, 0.9]}
    if topic is Topic.TELEMETRY:
        return {"v": 1, "node": f"{tag}-bad", "rack": "r0", "ts": T0 + i, "gpu": [0, 1],
                "columns": {"temp_c": [60.0, 61.0]}}
    return {"v": 1, "node": f"{tag}-bad", "ts": T0 + i, "kind": "xid", "code": 79}


def _dumps(obj: object) -> bytes:
    """stdlib JSON, which (unlike orjson) writes NaN / Infinity literals and integers above 2**64."""
    import json

    return json.dumps(obj).encode()


@st.composite
def _malformed(draw, tag: str, i: int) -> tuple[Topic, bytes, str]:
    """One malformed value for one input topic and the field its dead-letter reason must name."""
    topic = draw(st.sampled_from(list(_REQUIRED)))
    obj = _good(topic, tag, i)
    case = draw(st.sampled_from(["bytes", "not_object", "version", "missing", "wrong_type", "non_finite",
                                 "topic_specific"]))
    if case == "bytes":
        raw = draw(st.binary(max_size=48))
        try:
            parsed = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return topic, raw, "<message>"
        return topic, raw, "v" if isinstance(parsed, dict) else "<message>"
    if case == "not_object":
        return topic, _dumps(draw(st.one_of(_SCALARS, st.lists(st.integers(), max_size=3)))), "<message>"
    if case == "version":
        obj["v"] = draw(st.one_of(st.integers().filter(lambda v: v != 1), st.text(max_size=3), st.none()))
        return topic, _dumps(obj), "v"
    if case == "missing":
        name = draw(st.sampled_from(_REQUIRED[topic]))
        del obj[name]
        return topic, _dumps(obj), name
    if case == "non_finite":
        name = "compute_s" if topic is Topic.STEPS else "ts"
        value = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
        obj[name] = [1.0, value, 1.0] if name == "compute_s" else value
        return topic, _dumps(obj), "<message>"  # NaN / Infinity are not JSON: the parser refuses them
    if case == "wrong_type":
        name = draw(st.sampled_from(_REQUIRED[topic]))
        if name in _STR_FIELDS:
            obj[name] = draw(_NOT_A_STRING)
        elif name == "step":
            obj[name] = draw(_NOT_A_COUNT)
        elif name == "ts":
            obj[name] = draw(_NOT_A_TIME)
        elif name == "kind":
            obj[name] = draw(st.one_of(st.text(max_size=8).filter(lambda k: k not in set(EventKind)), _NOT_A_COUNT))
        else:
            obj[name] = draw(_NOT_AN_ARRAY)
        return topic, _dumps(obj), name
    # topic_specific: values of the right type that are still wrong
    if topic is Topic.STEPS:
        problem = draw(st.sampled_from(["compute", "empty", "duplicate", "negative_rank", "short_gpus",
                                        "groups"]))
        if problem == "compute":
            obj["compute_s"][draw(st.integers(0, 2))] = draw(_BAD_COMPUTE)
            return topic, _dumps(obj), "compute_s"
        if problem == "empty":
            obj.update(ranks=[], gpus=[], compute_s=[])
            return topic, _dumps(obj), "ranks"
        if problem == "duplicate":
            obj["ranks"] = [4, 4, 5]
            return topic, _dumps(obj), "ranks"
        if problem == "negative_rank":
            obj["ranks"] = [0, -draw(st.integers(1, 100)), 2]
            return topic, _dumps(obj), "ranks"
        if problem == "short_gpus":
            obj["gpus"] = obj["gpus"][: draw(st.integers(0, 2))]
            return topic, _dumps(obj), "gpus"
        obj["groups"] = draw(st.one_of(st.just([0, 1]), st.just([0, 1.5, 2]), _NOT_AN_ARRAY.filter(
            lambda g: g is not None)))
        return topic, _dumps(obj), "groups"
    if topic is Topic.TELEMETRY:
        problem = draw(st.sampled_from(["unknown_column", "short_column", "bad_value", "negative_gpu"]))
        if problem == "unknown_column":
            name = draw(st.text(min_size=1, max_size=6).filter(lambda c: c not in GPU_FIELDS))
            obj["columns"][name] = [1.0, 2.0]
            return topic, _dumps(obj), f"columns.{name}"
        if problem == "short_column":
            obj["columns"]["power_w"] = [500.0] * draw(st.sampled_from([0, 1, 3]))
            return topic, _dumps(obj), "power_w"
        if problem == "bad_value":
            obj["columns"]["temp_c"] = [60.0, draw(st.one_of(st.text(max_size=2), st.booleans(),
                                                              st.lists(st.integers(), max_size=1)))]
            return topic, _dumps(obj), "temp_c"
        obj["gpu"] = [0, -draw(st.integers(1, 8))]
        return topic, _dumps(obj), "gpu"
    problem = draw(st.sampled_from(["kind", "data", "message", "optional_int"]))
    if problem == "kind":
        obj["kind"] = draw(st.text(min_size=1, max_size=12).filter(lambda k: k not in set(EventKind)))
        return topic, _dumps(obj), "kind"
    if problem == "data":
        obj["data"] = draw(st.one_of(st.lists(st.integers(), max_size=2), st.integers(), st.text(max_size=3)))
        return topic, _dumps(obj), "data"
    if problem == "message":
        obj["message"] = draw(st.one_of(st.integers(), st.booleans(), st.lists(st.text(max_size=2), max_size=2)))
        return topic, _dumps(obj), "message"
    name = draw(st.sampled_from(["gpu", "rank", "step", "code"]))
    obj[name] = draw(_NOT_A_COUNT.filter(lambda v: v is not None))
    return topic, _dumps(obj), name


@st.composite
def _valid(draw, tag: str, i: int):
    """A schema-valid message; events carry arbitrary ``data`` for their kind (the pipeline must cope)."""
    which = draw(st.sampled_from(["steps", "telemetry", "event"]))
    ts = T0 + draw(st.floats(0.0, 3600.0))
    if which == "steps":
        n = draw(st.integers(1, 8))
        compute = draw(st.lists(st.floats(0.0, 86_400.0), min_size=n, max_size=n))
        groups = draw(st.one_of(st.none(), st.lists(st.integers(0, 3), min_size=n, max_size=n)))
        # each node owns its own ranks (a batch naming another node's ranks is refused, not stored)
        return StepBatch(job=f"{tag}-ok", step=i, node=f"{tag}-n{i % 3}", ts=ts,
                         ranks=np.arange(n, dtype=np.int32) + 8 * (i % 3), gpus=np.arange(n, dtype=np.int16),
                         compute_s=np.asarray(compute), groups=None if groups is None else np.asarray(groups, np.int32))
    if which == "telemetry":
        g = draw(st.integers(1, 8))
        temp = draw(st.lists(st.one_of(st.floats(0.0, 120.0), st.just(math.nan)), min_size=g, max_size=g))
        return Telemetry.from_columns(f"{tag}-t{i}", "r0", ts, np.arange(g), temp_c=temp,
                                      clock_reasons=[float(draw(st.integers(0, 511)))] * g)
    kind = draw(st.sampled_from(list(EventKind)))
    data = draw(st.dictionaries(st.sampled_from(_DATA_KEYS), _SCALARS, max_size=4))
    opt = st.one_of(st.none(), st.integers(0, 10_000))
    return Event(node=f"{tag}-e{i}", ts=ts, kind=kind, job=draw(st.one_of(st.none(), st.just(f"{tag}-ok"))),
                 gpu=draw(opt), rank=draw(opt), step=draw(opt), code=draw(opt), message=draw(st.text(max_size=8)),
                 data=data)


_MALFORMED_PER_EXAMPLE = 110
_EXAMPLES = 12


def test_malformed_input_is_dead_lettered_with_reasons_while_valid_input_keeps_flowing(
        own_broker: EmbeddedBroker, store) -> None:
    """Hypothesis generates >= 1,000 malformed values over ``fh.steps``, ``fh.telemetry`` and
    ``fh.events`` — random bytes, JSON that is not an object, wrong or missing versions, missing
    fields, wrong types, NaN / infinite / negative / absurd compute times, unknown enum values,
    arrays of the wrong length — interleaved with valid messages (events with arbitrary ``data`` for
    their kind). One runner processes them all: each malformed value is in ``fh.deadletter`` once,
    with a reason naming the field that is wrong; every valid message is in the store; the runner
    never raises. Each example publishes a batch and checks it, so a failure shrinks to a small one.
    """
    tag = _uid("fuzz")
    counter = iter(range(10**9))
    seen_malformed: list[int] = []
    with Runner(own_broker.dsn, store, group=_uid("fuzz-runner"), registry=CollectorRegistry()) as runner, \
            Consumer(own_broker.dsn, [Topic.DEADLETTER], _uid("fuzz-dl"), session_timeout_s=2.0,
                     max_poll_interval_s=2.0) as letters, \
            Producer(own_broker.dsn, client_id="fuzz", event_time_stamps=True) as producer:
        taken = 0

        @settings(max_examples=_EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(st.data())
        def one_batch(data: st.DataObject) -> None:
            nonlocal taken
            bad = [data.draw(_malformed(tag, next(counter))) for _ in range(_MALFORMED_PER_EXAMPLE)]
            good = [data.draw(_valid(tag, next(counter))) for _ in range(data.draw(st.integers(10, 30)))]
            base = next(counter)
            expected_reason: dict[str, str] = {}
            order = data.draw(st.permutations(range(len(bad) + len(good))))
            for j in order:
                if j < len(bad):
                    topic, raw, field = bad[j]
                    key = f"{tag}:{base}:{j}"
                    expected_reason[key] = field
                    producer.publish_raw(topic.value, raw, key.encode())
                else:
                    producer.publish(good[j - len(bad)])
            producer.flush()
            total = len(bad) + len(good)
            deadline = time.monotonic() + 60.0
            while runner.consumer.consumed_total + runner.consumer.dead_lettered_total - taken < total \
                    or len(runner.buffer):
                assert time.monotonic() < deadline, "the runner stopped taking input"
                runner.process_once(0.2)
            taken = runner.consumer.consumed_total + runner.consumer.dead_lettered_total

            got: dict[str, DeadLetter] = {}
            deadline = time.monotonic() + 30.0
            while len(got) < len(expected_reason) and time.monotonic() < deadline:
                for rec in letters.poll(0.2):
                    if isinstance(rec.msg, DeadLetter) and (rec.msg.key or "").startswith(f"{tag}:{base}:"):
                        assert rec.msg.key not in got, f"dead-lettered twice: {rec.msg.key}"
                        got[rec.msg.key] = rec.msg
            assert set(got) == set(expected_reason)
            for key, letter in got.items():
                field = letter.reason.split(": ", 1)[0]
                assert field == expected_reason[key], (letter.reason, letter.raw)
                assert letter.reason.strip() != f"{field}:"
            seen_malformed.append(len(bad))

            batches = [m for m in good if isinstance(m, StepBatch)]
            samples = [m for m in good if isinstance(m, Telemetry)]
            events = [m for m in good if isinstance(m, Event)]
            steps = [b.step for b in batches]
            res = store.query("SELECT count() FROM rank_steps FINAL WHERE job = {j:String} "
                              "AND step IN {s:Array(UInt64)}", {"j": f"{tag}-ok", "s": steps})
            assert res.rows[0][0] == sum(b.ranks.size for b in batches)
            nodes = [t.node for t in samples]
            res = store.query("SELECT count() FROM gpu_samples FINAL WHERE node IN {n:Array(String)}", {"n": nodes})
            assert res.rows[0][0] == sum(t.gpu.size for t in samples)
            # an input event of a kind the tier derives itself (a job's progress and end, a stop the
            # lifecycle named) goes to the policy and is stored by no stage, in one process as staged
            kept = [e for e in events if takes_event(Stage.NODE, e) or takes_event(Stage.JOB, e)]
            res = store.query("SELECT count() FROM events FINAL WHERE id IN {i:Array(String)}",
                              {"i": [e.id for e in events]})
            assert res.rows[0][0] == len(kept), [e.kind for e in events if e not in kept]

        one_batch()
        assert sum(seen_malformed) >= 1000
        # still alive and still correct after the flood
        producer.publish(StepBatch(job=f"{tag}-after", step=0, node="n0", ts=T0 + 4000.0,
                                   ranks=np.arange(4, dtype=np.int32), gpus=np.arange(4, dtype=np.int16),
                                   compute_s=np.ones(4)))
        producer.flush()
        deadline = time.monotonic() + 30.0
        after = "SELECT count() FROM rank_steps WHERE job = {j:String}"
        while not store.query(after, {"j": f"{tag}-after"}).rows[0][0]:
            assert time.monotonic() < deadline, "a valid message after the flood never reached the store"
            runner.process_once(0.2)


# ---------------------------------------------------------------------------------------- bulk decode
def _same(a: object, b: object) -> bool:
    if isinstance(a, Exception) or isinstance(b, Exception):
        return type(a) is type(b) and str(a) == str(b)
    if isinstance(a, StepBatch) and isinstance(b, StepBatch):
        arrays = ("ranks", "gpus", "compute_s", "groups")
        return (a.job, a.step, a.node, a.ts) == (b.job, b.step, b.node, b.ts) and all(
            (getattr(a, k) is None and getattr(b, k) is None) or (
                getattr(a, k) is not None and getattr(b, k) is not None and getattr(a, k).dtype == getattr(b, k).dtype
                and np.array_equal(getattr(a, k), getattr(b, k))) for k in arrays)
    return orjson.dumps(a.to_obj(), option=orjson.OPT_SERIALIZE_NUMPY) == orjson.dumps(  # type: ignore[union-attr]
        b.to_obj(), option=orjson.OPT_SERIALIZE_NUMPY)  # type: ignore[union-attr]


@settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_decode_many_gives_exactly_what_decode_gives(data: st.DataObject) -> None:
    """The consumer's bulk decode (columnar validation over a whole poll, falling back per value) returns,
    value by value, the message or the very error ``decode`` gives — for the fuzz test's malformed values
    mixed with valid ones, on every input topic."""
    from fleethealth import schema

    tag = "d"
    values: dict[Topic, list[bytes]] = {t: [] for t in _REQUIRED}
    for i in range(data.draw(st.integers(1, 60))):
        if data.draw(st.booleans()):
            topic, raw, _ = data.draw(_malformed(tag, i))
        else:
            msg = data.draw(_valid(tag, i))
            topic, raw = msg.TOPIC, schema.encode(msg)
        values[topic].append(raw)
    for topic, raws in values.items():
        cls = schema.TOPIC_TYPES[topic]
        expected = []
        for raw in raws:
            try:
                expected.append(schema.decode(cls, raw))
            except Exception as exc:
                expected.append(exc)
        got = schema.decode_many(cls, raws)
        assert len(got) == len(raws)
        for raw, a, b in zip(raws, got, expected, strict=True):
            assert _same(a, b), (raw, a, b)


# ---------------------------------------------------------------------------------------- bounded buffer
def test_the_reorder_buffer_stays_bounded_and_nothing_is_lost(own_broker, tmp_path: Path) -> None:
    """Steps (one partition) and telemetry (another) over the same event-time span, read a few
    records a poll: whichever runs ahead waits in the reorder buffer, but never more than
    ``max_held`` records (the oldest go early and are counted), and everything reaches the store."""
    n = 120
    with Producer(own_broker.dsn, event_time_stamps=True) as producer:
        for k in range(n):
            producer.publish(Telemetry.from_columns("n0001", "r00", 1000.0 + k, [0], temp_c=[60.0]))
        for k in range(n):
            producer.publish(StepBatch(job="paced", step=k, node="n0001", ts=1000.0 + k,
                                       ranks=np.array([0], dtype=np.int32), gpus=np.array([0], dtype=np.int16),
                                       compute_s=np.array([1.0])))
        producer.flush()
    held = []
    with open_store(f"chdb://{tmp_path}/store") as store:
        store.migrate()
        with Runner(own_broker.dsn, store, group=_uid("paced"), max_records=7, max_held=10, publish=False,
                    registry=CollectorRegistry(), session_timeout_s=2.0, max_poll_interval_s=30.0) as runner:
            deadline = time.monotonic() + 60
            while runner.consumer.consumed_total < 2 * n and time.monotonic() < deadline:
                runner.process_once(0.5)
                held.append(len(runner.buffer))
            runner.drain()
            early = runner.released_early_total
        stored = store.query("SELECT count() FROM rank_steps FINAL WHERE job = 'paced'").rows[0][0]
        samples = store.query("SELECT count() FROM gpu_samples FINAL WHERE node = 'n0001'").rows[0][0]
    assert (stored, samples) == (n, n)
    assert max(held) <= 10 and early > 0


# ---------------------------------------------------------------------------------------- eviction outcome
def test_an_executed_eviction_reported_on_the_bus_is_judged_and_recorded(own_broker, tmp_path: Path) -> None:
    """The outcome loop in the running system: the runner recommends a straggler eviction, the
    scheduler adapter's ``scheduler_action`` report comes back on fh.events, and once ``settle_s`` of
    event time passes without the job straggling again the runner records a resolved outcome, which
    the next engine loaded from the store counts into P(healthy)."""
    from fleethealth.adapters.base import ActionRecord, Outcome
    from fleethealth.policy.persist import load_engine, outcomes
    from fleethealth.schema import Action, Guard

    _published_scenario(own_broker.dsn, "judged", 160)

    def run(runner: Runner, until: int) -> None:
        deadline = time.monotonic() + 60
        while runner.consumer.consumed_total < until and time.monotonic() < deadline:
            runner.process_once(0.5)
        runner.process_once(0.2)  # an empty poll releases what the reorder buffer holds

    with open_store(f"chdb://{tmp_path}/store") as store:
        store.migrate()
        with Runner(own_broker.dsn, store, group=_uid("judged"), publish=False, registry=CollectorRegistry(),
                    session_timeout_s=2.0, max_poll_interval_s=30.0) as runner:
            deadline = time.monotonic() + 60
            evictions: list = []
            while not evictions and time.monotonic() < deadline:
                runner.process_once(0.5)
                evictions = [r for r in store.recommendations(action="evict") if r.guard is Guard.ALLOWED]
            [rec] = evictions
            assert runner.policy.engine.watch_.issued_.keys() == {rec.id}
            done = ActionRecord(recommendation_id=rec.id, scheduler="slurm", node=rec.node, action=Action.EVICT,
                                outcome=Outcome.DONE, ts=rec.ts + 5.0, rec_ts=rec.ts, job=rec.job)
            seen = runner.consumer.consumed_total
            with Producer(own_broker.dsn, event_time_stamps=True) as producer:
                producer.publish(done.to_event())
                for i in range(4):  # the fleet's clock moves on past settle_s
                    producer.publish(Telemetry.from_columns(f"n{i:04d}", f"r{i // 2:02d}", rec.ts + 2000.0,
                                                            [0, 1, 2, 3]))
                # and the policy's, which moves with what it reads (findings and events), one process or staged
                producer.publish(Event(node="n0003", ts=rec.ts + 2000.0, kind=EventKind.JOB_START, job="other"))
                producer.flush()
            run(runner, seen + 6)
        [outcome] = outcomes(store)
        assert outcome.resolved and outcome.node == rec.node and outcome.job == "judged"
        assert load_engine(store).posterior_.counts(outcome.diagnosis) == (1, 0)
