"""``fleethealth demo``: one scenario through the whole system on the embedded parts.

The simulated fleet hands what its node probes would see — telemetry, per-node step batches,
events — to the probe's delivery path (the bounded disk spool in ``DATA/spool``, then the
idempotent producer) into the embedded Kafka-protocol broker; the detector runner consumes them as a consumer
group, writes inputs, findings and recommendations to a chDB store in ``DATA/store``, and the
result is exported from the store to ``OUT/findings.jsonl`` and ``OUT/recommendations.jsonl``.
Only then is the scenario's fault list read, to score the run (``OUT/scorecard.json``), and the
page of :mod:`fleethealth.report` is written to ``OUT/report.html``.
Nothing is mocked: the same runner, bus and store code runs against a Kafka cluster and a
ClickHouse server in production. Like :mod:`fleethealth.commands`, this module wires parts together.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import orjson

from fleethealth.broker import EmbeddedBroker
from fleethealth.bus import ensure_topics
from fleethealth.detectors.runner import Runner
from fleethealth.errors import BusUnavailable
from fleethealth.probe.delivery import Delivery
from fleethealth.probe.spool import Spool
from fleethealth.report.scorecard import Scorecard, score
from fleethealth.schema import Finding, Recommendation
from fleethealth.sim import FleetSim, Scenario
from fleethealth.sim.closedloop import LoopResult, account, acts_from, seed_rule_acts
from fleethealth.store import StoreLike, open_store

__all__ = ["DemoResult", "run_demo", "export_jsonl", "compare_policies"]

Progress = Callable[[str, int, int], None]
_DELIVERY_BATCH = 5000
_STALL_S = 120.0


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
    detect_s: float
    out_dir: Path
    store_dir: Path
    scorecard: Scorecard | None = None
    report: Path | None = None
    """``OUT/report.html``; None when the report's extra (matplotlib, jinja2) is not installed."""
    report_s: float = 0.0
    report_note: str = ""
    closed_loop: tuple[LoopResult, ...] = ()
    """With ``closed_loop``: the run under fleethealth's policy, the seed rule alone, no detection."""

    @property
    def messages_per_s(self) -> float:
        return self.messages / max(self.publish_s + self.detect_s, 1e-9)


def export_jsonl(store: StoreLike, out: Path) -> tuple[list[Finding], list[Recommendation]]:
    """Write the store's findings and recommendations as JSON lines (docs/architecture.md's contract)."""
    out.mkdir(parents=True, exist_ok=True)
    findings = sorted(store.findings(), key=lambda f: (f.ts, f.kind.value, f.node, -1 if f.rank is None else f.rank))
    recs = sorted(store.recommendations(), key=lambda r: (r.ts, r.node, r.action.value))
    for name, rows in (("findings.jsonl", findings), ("recommendations.jsonl", recs)):
        with open(out / name, "wb") as fh:
            for row in rows:
                fh.write(orjson.dumps(row.to_obj()) + b"\n")
    return findings, recs


def run_demo(scenario: Scenario, out: Path, data: Path, *, progress: Progress | None = None,
             closed_loop: bool = False) -> DemoResult:
    """Run ``scenario`` end to end; ``data/store`` and ``data/spool`` are recreated empty first.
    ``closed_loop`` also weighs acting on the recommendations (:func:`compare_policies`)."""
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
    sim = FleetSim(scenario)
    with EmbeddedBroker(log_path=data / "broker.log") as broker, open_store(f"chdb://{store_dir}") as store:
        store.migrate()
        ensure_topics(broker.dsn)
        t0 = time.perf_counter()
        published = 0
        delivery = Delivery(broker.dsn, Spool(data / "spool"), client_id="fleethealth-demo-probes",
                            batch_records=_DELIVERY_BATCH)
        delivered = 0
        steps_done, steps_total = 0, sum(j.steps for j in scenario.job_specs)

        def deliver(backlog: int) -> int:
            sent = 0
            while published - delivered - sent > backlog:
                n = delivery.step(force=True)
                if n == 0:
                    raise BusUnavailable(f"the probes could not deliver to the broker: {delivery.stats().last_error}")
                sent += n
            return sent

        try:
            for tick in sim.run():
                for msg in (*tick.telemetry, *tick.batches, *tick.events):
                    delivery.submit(msg)
                published += len(tick.telemetry) + len(tick.batches) + len(tick.events)
                delivered += deliver(_DELIVERY_BATCH)  # keep the spool short whatever the scenario's size
                if tick.step is not None:
                    steps_done += 1
                    if progress is not None:
                        progress("publish", steps_done, steps_total)
            delivered += deliver(0)
        finally:
            delivery.close()
        t1 = time.perf_counter()
        # the simulator replays hours of event time in seconds: no bound against the broker's clock
        with Runner(broker.dsn, store, group="fleethealth-demo", max_ahead_s=None, max_behind_s=None) as runner:
            consumed, last_progress = 0, time.monotonic()
            while consumed + runner.consumer.dead_lettered_total < published:
                got = runner.process_once(1.0)
                consumed += got
                if got:
                    last_progress = time.monotonic()
                elif time.monotonic() - last_progress > _STALL_S:
                    raise BusUnavailable(f"the detectors read {consumed} of {published} messages and then nothing "
                                         f"for {_STALL_S:.0f} s")
                if progress is not None:
                    progress("detect", consumed, published)
            runner.drain()
            dead = runner.consumer.dead_lettered_total
        t2 = time.perf_counter()
        findings, recs = export_jsonl(store, out)
        # the ground truth, read only now that the detectors have finished
        card = score(scenario, findings, recs)
        (out / "scorecard.json").write_bytes(orjson.dumps(card.to_obj(), option=orjson.OPT_INDENT_2))
        loop = compare_policies(scenario, findings, recs) if closed_loop else ()
        if loop:
            (out / "closed_loop.json").write_bytes(orjson.dumps([r.to_obj() for r in loop],
                                                                option=orjson.OPT_INDENT_2))
        report, report_s, note = _report(store, out / "report.html", scenario.job.id, card, progress, loop)
    return DemoResult(scenario=scenario.name, findings=findings, recommendations=recs, messages=published,
                      dead_letters=dead, wall_s=time.perf_counter() - started, publish_s=t1 - t0, detect_s=t2 - t1,
                      out_dir=out, store_dir=store_dir, scorecard=card, report=report, report_s=report_s,
                      report_note=note, closed_loop=tuple(loop))


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
