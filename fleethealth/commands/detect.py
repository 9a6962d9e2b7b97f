"""``fleethealth detect``: the streaming detectors, Kafka in, ClickHouse and Kafka out; and
:func:`build_runner`, which wires a detector runner from the settings (``serve`` uses it too)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fleethealth.commands._common import open_store_at, prepare_store, require_bus, stop_on_signals
from fleethealth.commands._settings import add_config_flags, add_log_flags, add_migrate_flag, add_setting, load_live

if TYPE_CHECKING:
    from fleethealth.config import LiveSettings, Settings
    from fleethealth.detectors.pipeline import Pipeline
    from fleethealth.detectors.retry import Retry
    from fleethealth.detectors.runner import Runner
    from fleethealth.detectors.stages import Stage
    from fleethealth.store.protocol import StoreLike

__all__ = ["add", "build_runner", "stage_group"]


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "detect", help="run the streaming detectors: Kafka in, ClickHouse and Kafka out",
        description="Consume fh.steps, fh.telemetry and fh.events as a member of a consumer group, detect "
                    "stragglers, hangs, SDC and "
                    "health faults in event time, write inputs, findings and recommendations to the store "
                    "and publish them to fh.findings / fh.recommendations. Offsets are committed only after "
                    "the store write, so a crash neither loses nor duplicates a row. Every detector and "
                    "policy threshold is a config key (detect.*, policy.*; `fleethealth config show`). "
                    "To scale out, run the tier as stages (--stage node, job, policy): replicas of a stage "
                    "share its group and split its partitions; fh.steps, fh.telemetry and fh.events need the "
                    "same partition count (a job's steps and events, a node's samples and events, meet on one "
                    "partition number). SIGHUP reloads the config file's live keys (thresholds, bands, windows: "
                    "fleethealth.config.LIVE_KEYS) at the next batch boundary, keeping the detectors' state; "
                    "other changed keys are logged as ignored until restart.",
    )
    add_setting(p, "--kafka", "kafka", metavar="DSN",
                help="bus, e.g. kafka://broker:9092 (required: flag, config key kafka or $FLEETHEALTH_KAFKA)")
    add_setting(p, "--store", "store", metavar="DSN",
                help="store, e.g. http://clickhouse:8123/fleethealth or chdb:///var/lib/fleethealth "
                     "(required: flag, config key store or $FLEETHEALTH_STORE)")
    add_setting(p, "--stage", "detect.stage", choices=("all", "node", "job", "policy"),
                help="which part of the tier this replica runs (default: %(default)s): 'all' — one consumer "
                     "group over every input, one replica per group; 'node' — telemetry and node events, "
                     "health rules, failure prediction, node states on fh.nodestate (N replicas); 'job' — "
                     "steps and job events, stragglers, hangs, SDC, lifecycle, diagnosis from fh.nodestate "
                     "(N replicas); 'policy' — findings to recommendations (one replica)")
    add_setting(p, "--group", "detect.group",
                help="consumer group (default: %(default)s, with the stage's name appended for node, job, policy)")
    add_setting(p, "--metrics-port", "detect.metrics_port", type=int,
                help="Prometheus /metrics port, 0 to disable (default: %(default)s)")
    p.add_argument("--until-caught-up", action="store_true",
                   help="batch mode: once every assigned partition is read to its end, conclude what is held "
                        "(open steps, undiagnosed findings), write and commit it, and exit 0")
    add_migrate_flag(p)
    add_log_flags(p)
    add_config_flags(p)
    p.set_defaults(run=run)


def build_runner(bus_dsn: str, store: StoreLike, settings: Settings, *, live: LiveSettings | None = None,
                 **kwargs: Any) -> Runner:
    """A detector :class:`~fleethealth.detectors.runner.Runner` whose detectors, policy engine and
    pager take the ``detect.*`` and ``policy*`` keys that differ from their defaults (``kwargs``
    go to the runner: ``registry``, ``publish`` …). With ``live``, a pipeline built later (a partition
    assigned after a reload) takes the settings in force then."""
    from functools import partial

    from fleethealth.detectors.assembly import StepAssembler
    from fleethealth.detectors.diagnosis import Diagnoser, DiagnosisThresholds, RackEpisodes
    from fleethealth.detectors.hang import HangDetector
    from fleethealth.detectors.health import HealthRules
    from fleethealth.detectors.lifecycle import LifecycleTracker
    from fleethealth.detectors.pipeline import Pipeline
    from fleethealth.detectors.predict import FailurePredictor, GpuFeatures
    from fleethealth.detectors.runner import Runner
    from fleethealth.detectors.sdc import SdcDetector
    from fleethealth.detectors.snapshot import Snapshots
    from fleethealth.detectors.stages import Stage
    from fleethealth.detectors.straggler import StragglerDetector
    from fleethealth.policy.paging import Pager
    from fleethealth.policy.persist import load_engine
    from fleethealth.policy.stage import PolicyStage

    def of(table: str) -> dict[str, Any]:
        return (live.current if live is not None else settings).section(table, changed_only=True)

    def diagnoser() -> Diagnoser:
        return Diagnoser(thresholds=DiagnosisThresholds(**of("detect.diagnosis")))

    def pipeline(shared: Diagnoser | None = None) -> Pipeline:
        return Pipeline(straggler=partial(StragglerDetector, **of("detect.straggler")),
                        hang=HangDetector(**of("detect.hang")),
                        diagnoser=shared if shared is not None else diagnoser(),
                        rack_episodes=RackEpisodes(**of("detect.rack_episodes")),
                        health=HealthRules(**of("detect.health")), sdc=SdcDetector(**of("detect.sdc")),
                        predictor=FailurePredictor(features=GpuFeatures(**of("detect.features")),
                                                   **of("detect.predict")),
                        assembler=StepAssembler(**of("detect.assembly")),
                        lifecycle=LifecycleTracker(**of("detect.lifecycle")), **of("detect.pipeline"))

    try:
        stage = Stage(settings["detect.stage"])
    except ValueError:
        from fleethealth.errors import ConfigError

        raise ConfigError(f"detect.stage must be one of {', '.join(s.value for s in Stage)}, "
                          f"got {settings['detect.stage']!r}") from None
    group = stage_group(settings["detect.group"], stage)
    if stage is Stage.ALL:
        pipelines: Callable[[], Pipeline] | None = pipeline  # a node side and a job side
    elif stage is Stage.JOB:  # one pipeline per partition, all reading this replica's copy of fh.nodestate
        pipelines = partial(pipeline, diagnoser())
    elif stage is Stage.NODE:
        pipelines = pipeline
    else:
        pipelines = None
    policy = PolicyStage(load_engine(store, **of("policy")), pager=Pager(**of("policy.paging"))) \
        if stage in (Stage.ALL, Stage.POLICY) else None
    runner = Runner(bus_dsn, store, group=group, pipeline=pipelines, policy=policy, stage=stage,
                    **{"snapshots": Snapshots(**of("detect.snapshot")), **of("detect.runner"), **kwargs})
    _sign_and_verify(runner, settings)
    for consumer in (runner.consumer, runner.table):  # fleethealth/bus/consumer.py Consumer._fail_over
        if consumer is not None:
            consumer.fail_over_after_s = settings["detect.fail_over_after_s"]
            consumer.hole_skip_after_s = settings["detect.hole_skip_after_s"]
    return runner


def _sign_and_verify(runner: Runner, settings: Settings) -> None:
    """``signing.*``: the consumer checks each input record's signature (fleethealth/signing.py), and what the
    runner publishes on fh.events (the job stage's interruptions) is signed as the service ``svc:detect``."""
    from fleethealth.signing import load_signer, load_verifier, service_signer

    secret, key_dir = settings["signing.fleet_secret_file"], settings["signing.key_dir"]
    runner.consumer.verifier = load_verifier(settings["signing.mode"], fleet_secret_file=secret, key_dir=key_dir)
    runner.producer.signer = (load_signer(settings["signing.key_file"], settings["signing.key_id"] or "svc:detect")
                              or service_signer(secret, "detect"))


def stage_group(group: str, stage: Stage) -> str:
    """The consumer group of a stage: ``group`` itself for the whole tier, ``group-<stage>`` for a stage."""
    return group if stage == "all" else f"{group}-{stage}"


def _startup_retry(stop: threading.Event) -> Retry:
    """The start-up's policy: an unreachable broker (or store) is retried with backoff up to 5 s, a
    line on stderr for each failure, until it answers or the process is stopped."""
    from fleethealth.detectors.retry import Retry

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    retry_log = logging.getLogger("fleethealth.detectors.retry")
    if not retry_log.handlers:
        retry_log.addHandler(handler)
    return Retry(backoff_s=0.5, max_backoff_s=5.0, log_every_s=0.0, stopping=stop.is_set)


def run(args: argparse.Namespace) -> int:
    from fleethealth.bus import ensure_topics
    from fleethealth.detectors.live import at_boundary, validate
    from fleethealth.detectors.runner import tune_gc

    live = load_live(args, validate)
    settings = live.current
    from fleethealth.probe.logs import configure_logging

    configure_logging(settings["log.level"], settings["log.format"])
    kafka = require_bus(settings["kafka"], "no bus: give --kafka DSN, config key kafka or FLEETHEALTH_KAFKA")
    store_dsn = require_bus(settings["store"], "no store: give --store DSN, config key store or FLEETHEALTH_STORE")
    prepare_store(store_dsn, settings, "detect")  # pending migrations: refused, or applied with --migrate
    # SIGTERM (a pod stopping) ends the loop in order; Ctrl-C interrupts at once (exit 130)
    with stop_on_signals(signals=(signal.SIGTERM,)) as stop:
        tune_gc()
        from prometheus_client import CollectorRegistry

        from fleethealth import buildinfo

        registry = CollectorRegistry()  # this process's: the runner's metrics and fleethealth_build_info
        buildinfo.register(registry)
        live.register(registry)
        # SIGHUP only sets a flag; the reload is read, checked and applied between two batches
        signal.signal(signal.SIGHUP, lambda *_: live.request())
        port = settings["detect.metrics_port"]
        if port:
            from prometheus_client import start_http_server

            start_http_server(port, registry=registry)
        # a broker restarting (or not up yet) while detect starts is waited out, with backoff and a log line
        startup = _startup_retry(stop)
        startup.call("fleethealth detect: creating the topics", lambda: ensure_topics(kafka))
        with open_store_at(store_dsn) as store, \
                startup.call("fleethealth detect: connecting", lambda: build_runner(kafka, store, settings, live=live,
                                                                                  registry=registry)) as runner:
            group = runner.consumer.group
            print(f"fleethealth detect: joining group {group!r}", file=sys.stderr, flush=True)
            startup.call(f"fleethealth detect: joining group {group!r}",
                         lambda: runner.consumer.wait_assigned(timeout_s=60.0))
            starts = ", ".join(f"{topic}/{part}@{offset}"
                               for (topic, part), offset in sorted(runner.consumer.positions().items()))
            print(f"fleethealth detect: joined group {group!r}; reading from {starts}", file=sys.stderr, flush=True)
            between = at_boundary(live, runner)
            if not args.until_caught_up:
                runner.run(stop, between=between)
                return 0
            while not stop.is_set():
                between()
                if runner.caught_up(runner.process_once(0.5)):
                    runner.drain()
                    dead = runner.consumer.dead_lettered_total
                    print(f"fleethealth detect: caught up ({runner.consumer.consumed_total} records, "
                          + (f"{dead} dead-lettered on fh.deadletter (with their reasons), " if dead else "")
                          + f"{runner.findings_total} findings, {runner.recommendations_total} recommendations)",
                          file=sys.stderr, flush=True)
                    break
    return 0
