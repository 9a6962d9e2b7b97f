"""``fleethealth demo``: one scenario through the whole system on the embedded parts.

The simulated fleet hands what its node probes would see — telemetry, per-node step batches,
events — to the probe's delivery path (the bounded disk spool in ``DATA/spool``, then the
idempotent producer) into the embedded Kafka-protocol broker, from a process of its own
(:mod:`fleethealth.demo_fleet`); the detector runner consumes them as a consumer group while they are
published, writes inputs, findings and recommendations to a chDB store in ``DATA/store``, and the
result is exported from the store to ``OUT/findings.jsonl`` and ``OUT/recommendations.jsonl``.
Only then is the scenario's fault list read, to score the run (``OUT/scorecard.json``), and the
page of :mod:`fleethealth.report` is written to ``OUT/report.html``.
Nothing is mocked: the same runner, bus and store code runs against a Kafka cluster and a
ClickHouse server in production. Like :mod:`fleethealth.commands`, this module wires parts together.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from fleethealth.broker import EmbeddedBroker
from fleethealth.bus import ensure_topics
from fleethealth.bus.consumer import group_read_to_end
from fleethealth.demo_fleet import FleetPublisher
from fleethealth.detectors.runner import Runner, Stage
from fleethealth.detectors.snapshot import Snapshots
from fleethealth.errors import BusUnavailable
from fleethealth.report.scorecard import Scorecard, score
from fleethealth.schema import EventKind, Finding, Recommendation, Topic
from fleethealth.sim import Scenario
from fleethealth.sim.closedloop import LoopResult, account, acts_from, seed_rule_acts
from fleethealth.store import StoreLike, open_store

__all__ = ["DemoResult", "run_demo", "export_jsonl", "compare_policies"]

Progress = Callable[[str, int, int], None]
_STALL_S = 120.0
_STORE_EVERY_S = 10.0
"""The demo's runners hold sample rows 10 s for one insert, as the Kubernetes detectors do
(``detect.runner.store_every_s``): the replay reads in large polls, and every insert pays for the
rollup views. The end of the input writes what is held, before the scorecard reads the store."""


@dataclass(frozen=True)
class DemoResult:
    """What a demo run produced and how fast (``messages_per_s`` over publish + detect)."""

    scenario: str
    findings: list[Finding]
    recommendations: list[Recommendation]
    messages: int
    dead_letters: int
    wall_s: float
    publish_s: float
    """From the fleet's start to its last message delivered (the runner of the whole tier reads meanwhile)."""
    detect_s: float
    """From then until the detectors had read and concluded everything."""
    out_dir: Path
    store_dir: Path
    scorecard: Scorecard | None = None
    report: Path | None = None
    """``OUT/report.html``; None when the report's extra (matplotlib, jinja2) is not installed."""
    report_s: float = 0.0
    report_note: str = ""
    closed_loop: tuple[LoopResult, ...] = ()
    """With ``closed_loop``: the run under fleethealth's policy, the seed rule alone, no detection."""
    stages: dict[str, object] = field(default_factory=dict)
    """With ``replicas``: per stage, its replicas, the records each read, the partitions each held at
    some time in the run (the group may move them when a replica is slow) and the node states published."""

    @property
    def messages_per_s(self) -> float:
        return self.messages / max(self.publish_s + self.detect_s, 1e-9)


def export_jsonl(store: StoreLike, out: Path) -> tuple[list[Finding], list[Recommendation]]:
    """Write the store's findings, recommendations and derived interruptions as JSON lines
    (docs/architecture.md's contract)."""
    out.mkdir(parents=True, exist_ok=True)
    findings = sorted(store.findings(), key=lambda f: (f.ts, f.kind.value, f.node, -1 if f.rank is None else f.rank))
    recs = sorted(store.recommendations(), key=lambda r: (r.ts, r.node, r.action.value))
    stops = sorted(store.events(kind=EventKind.INTERRUPTION.value), key=lambda e: (e.ts, e.job or "", e.id))
    for name, rows in (("findings.jsonl", findings), ("recommendations.jsonl", recs),
                       ("interruptions.jsonl", stops)):
        with open(out / name, "wb") as fh:
            for row in rows:
                fh.write(orjson.dumps(row.to_obj()) + b"\n")
    return findings, recs


def run_demo(scenario: Scenario, out: Path, data: Path, *, progress: Progress | None = None,
             closed_loop: bool = False, replicas: int | None = None, report: bool = True) -> DemoResult:
    """Run ``scenario`` end to end; ``data/store`` and ``data/spool`` are recreated empty first.
    ``closed_loop`` also weighs acting on the recommendations (:func:`compare_policies`).
    ``replicas`` runs the detector tier as its three stages (:mod:`fleethealth.detectors.stages`),
    that many replicas of the node and the job stage and one of the policy; None runs one runner of
    the whole tier. ``report=False`` writes no ``report.html`` (its plots take seconds)."""
    if replicas is not None and not 1 <= replicas <= 16:
        from fleethealth.errors import ConfigError

        raise ConfigError(f"replicas must be between 1 and 16, got {replicas}")
    started = time.perf_counter()
    if closed_loop and scenario.jobs:
        from fleethealth.errors import ConfigError

        raise ConfigError(f"scenario {scenario.name}: the closed loop weighs one job; this scenario has "
                          f"{len(scenario.jobs)} ('jobs')")
    store_dir = data / "store"
    for stale in (store_dir, data / "spool"):
        if stale.exists():
            shutil.rmtree(stale)
    data.mkdir(parents=True, exist_ok=True)
    _empty_store(store_dir)  # the demo owns its throwaway store: a copy of a migrated one
    with EmbeddedBroker(log_path=data / "broker.log") as broker, contextlib.ExitStack() as stack:
        ensure_topics(broker.dsn)
        t0 = time.perf_counter()
        # the fleet publishes from a process of its own, forked before this one opens its store
        fleet = FleetPublisher.start(scenario, broker.dsn, data / "spool")
        stack.callback(fleet.close)
        store = stack.enter_context(open_store(f"chdb://{store_dir}"))
        stages: dict[str, object] = {}
        goodput: dict[str, float | None] = {}
        if replicas is None:
            runner = stack.enter_context(_whole_tier_runner(broker.dsn, store))
            dead = _detect_all(runner, fleet, progress, goodput)
        else:  # the stages one after another, over the finished timeline
            published_all = False
            while not published_all:
                published_all = fleet.poll(1.0)
                if progress is not None:
                    progress("publish", fleet.steps_done, fleet.steps_total)
            dead = _detect_staged(broker.dsn, f"chdb://{store_dir}", fleet.by_topic, replicas, progress, stages,
                                  goodput)
        published = fleet.published
        t1 = fleet.finished_at or t0
        t2 = time.perf_counter()
        findings, recs = export_jsonl(store, out)
        # the goodput figure the pager read for each interruption (the same in both forms of the tier)
        (out / "goodput.json").write_bytes(orjson.dumps(goodput, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
        # the ground truth, read only now that the detectors have finished
        card = score(scenario, findings, recs)
        (out / "scorecard.json").write_bytes(orjson.dumps(card.to_obj(), option=orjson.OPT_INDENT_2))
        loop = compare_policies(scenario, findings, recs) if closed_loop else ()
        if loop:
            (out / "closed_loop.json").write_bytes(orjson.dumps([r.to_obj() for r in loop],
                                                                option=orjson.OPT_INDENT_2))
        page, report_s, note = (_report(store, out / "report.html", scenario.job.id, card, progress, loop) if report
                                else (None, 0.0, "not asked for (--no-report)"))
    return DemoResult(scenario=scenario.name, findings=findings, recommendations=recs, messages=published,
                      dead_letters=dead, wall_s=time.perf_counter() - started, publish_s=t1 - t0, detect_s=t2 - t1,
                      out_dir=out, store_dir=store_dir, scorecard=card, report=page, report_s=report_s,
                      report_note=note, closed_loop=tuple(loop), stages=stages)


def _empty_store(store_dir: Path) -> None:
    """``store_dir``: an empty store with every migration applied. It is a copy of a migrated template in
    the user's cache (``$XDG_CACHE_HOME/fleethealth``, default ``~/.cache``), named by the digest of the
    migration files, so it is made once per set of migrations; a copy takes about a third of the CPU of
    migrating a new store. Without a writable cache, the store is migrated where it is."""
    import hashlib

    from fleethealth.store import migration_files

    digest = hashlib.sha256("".join(f"{m.name}:{m.checksum};" for m in migration_files()).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fleethealth"
    template = cache / f"store-template-{digest}"
    try:
        if not template.exists():
            cache.mkdir(parents=True, exist_ok=True)
            making = cache / f".{template.name}-{os.getpid()}"
            shutil.rmtree(making, ignore_errors=True)
            with open_store(f"chdb://{making}") as made:
                made.migrate()
            try:
                making.rename(template)
            except OSError:  # another demo made it first
                shutil.rmtree(making, ignore_errors=True)
        shutil.copytree(template, store_dir, symlinks=True)
    except OSError:  # no writable cache: migrate here
        shutil.rmtree(store_dir, ignore_errors=True)
        with open_store(f"chdb://{store_dir}") as made:
            made.migrate()


def _whole_tier_runner(dsn: str, store: StoreLike) -> Runner:
    """One runner of the whole tier; the simulator replays hours of event time in seconds, so its records
    are not bounded against the broker's clock."""
    return Runner(dsn, store, group="fleethealth-demo", max_ahead_s=None, max_behind_s=None,
                  store_every_s=_STORE_EVERY_S)


def _detect_all(runner: Runner, fleet: FleetPublisher, progress: Progress | None,
                goodput: dict[str, float | None]) -> int:
    """``runner`` over what ``fleet`` publishes, as it publishes, until the fleet has finished and every
    partition is read to its end; returns the dead letters. The progress counts offsets: those read (or
    dead-lettered) of those on the topics, which can be more than the messages published (a batch the
    probes' delivery published again after a failed flush is on its topic twice), so it never passes
    100 %; nor does the run end on that count, with a partition's last records unread."""
    runner.consumer.wait_assigned(timeout_s=60.0)
    consumed, last_progress, shown = 0, time.monotonic(), False
    while True:
        done = fleet.poll()
        got = runner.process_once(1.0 if done else 0.2)
        consumed = sum(runner.consumer.reached.values())  # next offsets: read or dead-lettered
        on_topics = fleet.published
        if done and consumed >= on_topics and runner.caught_up(0):  # each partition at the end its last fetch saw
            break
        if got:
            last_progress = time.monotonic()
        elif time.monotonic() - last_progress > _STALL_S:
            raise BusUnavailable(f"the detectors read {consumed} of {on_topics} records and then nothing "
                                 f"for {_STALL_S:.0f} s")
        if progress is not None:
            if not shown:
                progress("publish", fleet.steps_done, fleet.steps_total)
                shown = done
            on_topics = max(on_topics, consumed + sum(n for n in runner.consumer.lag().values() if n))
            progress("detect", min(consumed, on_topics), on_topics)
    if progress is not None:
        progress("detect", consumed, consumed)
    runner.drain()
    if runner.policy is not None:
        goodput.update(runner.policy.goodput_)
    return runner.consumer.dead_lettered_total


def _detect_staged(dsn: str, store_dsn: str, by_topic: dict[Topic, int], replicas: int,
                   progress: Progress | None, stats: dict[str, object], goodput: dict[str, float | None]) -> int:
    """The node stage's replicas over the telemetry and events, then the job stage's over the steps
    and events (reading the node states the first published), then the policy: one stage after the
    other, since the demo replays a finished timeline (in a fleet they run side by side). Each
    replica has its own store handle and runs in its own thread; returns the dead letters."""
    dead = 0
    plan = ((Stage.NODE, replicas, by_topic[Topic.TELEMETRY] + by_topic[Topic.EVENTS]),
            (Stage.JOB, replicas, by_topic[Topic.STEPS] + by_topic[Topic.EVENTS]),
            (Stage.POLICY, 1, None))
    for stage, count, expected in plan:
        dead += _run_group(dsn, store_dsn, stage, count, expected, progress, stats, goodput)
    return dead


def _run_group(dsn: str, store_dsn: str, stage: Stage, count: int, expected: int | None,
               progress: Progress | None, stats: dict[str, object] | None = None,
               goodput: dict[str, float | None] | None = None) -> int:
    """``count`` replicas of ``stage`` in one group until they have read ``expected`` records between
    them (or, with None, until every partition is read to its end), then each drains."""
    from prometheus_client import CollectorRegistry

    with contextlib.ExitStack() as stack:
        runners = []
        snapshots = Snapshots(key=os.urandom(32))  # one key per demo run, shared by its replicas
        for _ in range(count):
            store = stack.enter_context(open_store(store_dsn))
            runners.append(stack.enter_context(Runner(
                dsn, store, group=f"fleethealth-demo-{stage}", stage=stage, max_ahead_s=None, max_behind_s=None,
                registry=CollectorRegistry(), snapshots=snapshots, store_every_s=_STORE_EVERY_S)))
        # join together, so the group assigns its partitions once, before anything is processed
        _in_threads([lambda r=r: r.consumer.wait_assigned(timeout_s=60.0) for r in runners])
        read = threading.Event()
        errors: list[BaseException] = []
        held: dict[int, set[int]] = {id(r): set() for r in runners}  # partitions each replica held at some time
        # the end, decided for the group: in rounds, every replica polls once and says what it holds and
        # whether that is read to its end; none polls again before all have said, and all drain together
        # once a round finds each partition held by exactly one replica, read to its end. A replica that
        # stopped on its own view could stop between two generations (holding nothing) while the
        # partition it lost went to a replica that had stopped too: its records past the commit unread
        said: dict[int, tuple[set[tuple[str, int]], bool]] = {}
        everything = runners[0].consumer.partitions()
        finished = threading.Event()
        started_end = [0.0]

        def decide() -> None:
            if group_read_to_end(list(said.values()), everything):
                finished.set()
            elif time.monotonic() - started_end[0] > _STALL_S:
                errors.append(BusUnavailable(f"the {stage} stage's replicas did not read every partition to its end "
                                             f"within {_STALL_S:.0f} s: {[(sorted(a), d) for a, d in said.values()]}"))
                finished.set()

        rounds = threading.Barrier(count, action=decide)

        def work(runner: Runner) -> None:
            mine = held[id(runner)]
            try:
                while not read.is_set():
                    got = runner.process_once(0.5)
                    mine.update(p for _, p in runner.consumer.assignment())
                    if expected is None and runner.caught_up(got):
                        break
                if not started_end[0]:
                    started_end[0] = time.monotonic()
                while not finished.is_set():
                    got = runner.process_once(0.2)
                    assigned = runner.consumer.assignment()
                    mine.update(p for _, p in assigned)
                    said[id(runner)] = (assigned, runner.caught_up(got))
                    rounds.wait(_STALL_S)
                runner.drain()
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)
                read.set()
                finished.set()
                rounds.abort()

        threads = [threading.Thread(target=work, args=(r,), name=f"demo-{stage}-{i}", daemon=True)
                   for i, r in enumerate(runners)]
        for t in threads:
            t.start()
        last, last_progress = -1, time.monotonic()
        while any(t.is_alive() for t in threads) and not read.is_set():
            done = _distinct_read(runners, max(last, 0))
            if expected is not None and done >= expected:
                read.set()
            if done != last:
                last, last_progress = done, time.monotonic()
            elif time.monotonic() - last_progress > _STALL_S:
                read.set()
                errors.append(BusUnavailable(f"the {stage} stage read {done} of {expected} records and then "
                                             f"nothing for {_STALL_S:.0f} s"))
            if progress is not None and expected:
                progress(f"detect ({stage})", min(done, expected), expected)
            time.sleep(0.1)
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        if stats is not None:
            stats[str(stage)] = {"replicas": count, "records": [r.consumer.consumed_total for r in runners],
                                 "partitions": [sorted(held[id(r)]) for r in runners],
                                 "node_states": sum(r.states_published_total for r in runners)}
        if goodput is not None:
            for r in runners:
                if r.policy is not None:
                    goodput.update(r.policy.goodput_)
        return sum(r.consumer.dead_lettered_total for r in runners)


def _distinct_read(runners: list[Runner], before: int) -> int:
    """Records the group has read (or dead-lettered) at least once: per partition, the furthest offset any
    replica reached (the demo's broker is fresh, so offsets count records from 0). A record read again —
    after a replica restored a snapshot and moved back to its offsets, or a partition moved — counts
    once, so a stage is never taken for done while a record is still unread."""
    reached: dict[tuple[str, int], int] = {}
    try:
        for r in runners:
            for tp, offset in list(r.consumer.reached.items()):  # (written by the replica's thread)
                reached[tp] = max(reached.get(tp, 0), offset)
    except RuntimeError:  # the dict grew under the copy (a partition's first record): count on the next tick
        return before
    return sum(reached.values())


def _in_threads(calls: list[Callable[[], object]]) -> None:
    """Run ``calls`` at once, each in a thread; raise the first error."""
    errors: list[BaseException] = []

    def one(call: Callable[[], object]) -> None:
        try:
            call()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(c,), daemon=True) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def compare_policies(scenario: Scenario, findings: list[Finding],
                recommendations: list[Recommendation]) -> tuple[LoopResult, ...]:
    """The scenario's job three times through :func:`fleethealth.sim.closedloop.account`: (a) a
    scheduler carrying out fleethealth's allowed recommendations at the step of the finding each
    answers, (b) the seed rule alone (z > 3 for 100 steps, then evict), (c) no detection."""
    steps = {f.id: (f.step if f.step is not None
                    else int(round((f.ts - scenario.start_ts) / scenario.job.step_time_s)))
             for f in findings}
    return (account(scenario, acts_from(recommendations, steps), policy="fleethealth"),
            account(scenario, seed_rule_acts(scenario), policy="seed rule", detect_sdc=False),
            account(scenario, [], policy="no detection", detect_sdc=False))


def _report(store: StoreLike, path: Path, job: str, card: Scorecard, progress: Progress | None,
            loop: tuple[LoopResult, ...] = ()) -> tuple[Path | None, float, str]:
    """Write the demo's report page; without the report extra, say so instead."""
    from fleethealth.errors import ConfigError
    from fleethealth.report import require_extra, write

    try:
        require_extra()
    except ConfigError as exc:
        return None, 0.0, str(exc)
    built = write(store, path, job, scorecard=card, progress=progress, closed_loop=loop)
    return path, built.render_s, ""
