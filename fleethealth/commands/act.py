"""``fleethealth act``: carry out allowed recommendations on Slurm or Kubernetes."""

from __future__ import annotations

import argparse
import sys

from fleethealth.commands._common import prepare_store, require_bus, stop_on_signals
from fleethealth.commands._settings import add_config_flags, add_log_flags, add_migrate_flag, add_setting, load_settings

__all__ = ["add"]


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("act", help="carry out recommendations on Slurm or Kubernetes",
                       description="Consume fh.recommendations and act on those with guard 'allowed' whose action "
                                   "the scheduler supports (evict, drain, quarantine): Slurm drains the node, "
                                   "Kubernetes drains it (cordon, taint, evictions). Each outcome is journaled "
                                   "(a replay never acts twice), logged and published on fh.events.")
    add_setting(p, "--scheduler", "act.scheduler", choices=("slurm", "kubernetes"),
                help="required (flag or config key act.scheduler)")
    add_setting(p, "--kafka", "kafka", metavar="DSN",
                help="the bus, e.g. the DSN `fleethealth serve` prints (default: $FLEETHEALTH_KAFKA)")
    add_setting(p, "--dry-run", "act.dry_run", store_true=True, help="record what would be done; change nothing")
    add_setting(p, "--data", "data", metavar="DIR",
                help="where the journal DIR/act-SCHEDULER.jsonl lives (default: %(default)s)")
    add_setting(p, "--group", "act.group", help="consumer group (default: fh-act-SCHEDULER)")
    add_setting(p, "--max-actions", "act.max_actions", type=int,
                help="the adapter's own rate limit: at most this many actions per --window-s (default: 5)")
    add_setting(p, "--window-s", "act.window_s", type=float, help="the rate-limit window, seconds (default: 3600)")
    add_setting(p, "--max-age-s", "act.max_age_s", type=float, metavar="S",  # adapters.act.DEFAULT_MAX_AGE_S
                help="record but do not act on recommendations older than S seconds, so a replayed old "
                     "topic never drains a recovered node (default: %(default)g, twice the policy engine's "
                     "900 s staleness bound; 0 = no bound, for simulated fleets in their own time)")
    add_setting(p, "--kubeconfig", "act.kubeconfig", help="kubeconfig file (default: ~/.kube/config)")
    add_setting(p, "--in-cluster", "act.in_cluster", store_true=True, help="use the pod's service account")
    add_setting(p, "--metrics-port", "act.metrics_port", type=int,
                help="/metrics and /healthz (503 when no poll for 60 s or the scheduler refused the last 3 "
                     "actions) on this port, 0 to disable (default: %(default)s)")
    add_setting(p, "--idle-exit", "act.idle_exit", type=float, metavar="S",
                help="exit after S seconds without a new recommendation (default: run until stopped)")
    add_setting(p, "--store", "store", metavar="DSN",
                help="the store (act itself writes none): given, its schema is checked at start like detect's")
    add_migrate_flag(p)
    add_log_flags(p)
    add_config_flags(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from fleethealth.adapters import ActionRecord, Actor, Journal, KubernetesAdapter, SlurmAdapter, run_act
    from fleethealth.adapters.act import ActMetrics
    from fleethealth.bus import Consumer, Producer
    from fleethealth.errors import ConfigError
    from fleethealth.schema import Topic

    s = load_settings(args)
    from fleethealth.probe.logs import configure_logging

    configure_logging(s["log.level"], s["log.format"])
    scheduler = s["act.scheduler"]
    if scheduler is None:
        raise ConfigError("no scheduler: give --scheduler slurm|kubernetes or config key act.scheduler")
    dsn = require_bus(s["kafka"], "no bus: give --kafka DSN (the one `fleethealth serve` prints) or set "
                                  "FLEETHEALTH_KAFKA")
    if s["store"]:  # one config for the tier: act starts only on a store whose schema is current
        prepare_store(s["store"], s, "act")
    max_age_s = s["act.max_age_s"]
    if max_age_s < 0:
        raise ConfigError(f"--max-age-s must be >= 0 (0 = no bound), got {max_age_s:g}")
    adapter = (SlurmAdapter() if scheduler == "slurm"
               else KubernetesAdapter(kubeconfig=s["act.kubeconfig"], in_cluster=s["act.in_cluster"],
                                      force=s["act.drain_force"],
                                      delete_emptydir_data=s["act.drain_delete_emptydir_data"],
                                      skip_namespaces=tuple(n.strip() for n in s["act.drain_skip_namespaces"].split(",")
                                                            if n.strip())))
    group = s["act.group"] or f"fh-act-{scheduler}"
    idle_exit = s["act.idle_exit"]
    from fleethealth.signing import load_signer

    signer = load_signer(s["signing.key_file"], s["signing.key_id"] or "svc:act")  # scheduler actions: a service's
    from fleethealth.commands.detect import _startup_retry

    # a broker restarting (or not up yet) while act starts is waited out, with backoff and a log line
    with stop_on_signals() as stop, \
            _startup_retry(stop).call("fleethealth act: connecting", lambda: Producer(
                dsn, client_id=f"fh-act-{scheduler}", signer=signer)) as producer, \
            _startup_retry(stop).call(f"fleethealth act: joining group {group!r}", lambda: Consumer(
                dsn, [Topic.RECOMMENDATIONS.value], group, producer=producer)) as consumer:
        metrics = ActMetrics()
        if s["act.metrics_port"]:
            from fleethealth.endpoints import Endpoints

            server = Endpoints(metrics=metrics.render, health=metrics.degraded, name="fh-act-endpoints").serve(
                s["act.metrics_port"])
            stop_server = server.shutdown
        else:
            stop_server = None

        def emit(record: ActionRecord) -> None:
            metrics.observe(record)
            producer.publish(record.to_event())
            producer.flush()

        actor = Actor(adapter, journal=Journal(Path(s["data"]) / f"act-{scheduler}.jsonl"),
                      dry_run=s["act.dry_run"], max_actions=s["act.max_actions"], window_s=s["act.window_s"],
                      max_age_s=max_age_s or None, emit=emit)
        _startup_retry(stop).call(f"fleethealth act: joining group {group!r}", consumer.wait_assigned)
        last = time.monotonic()
        while not stop.is_set():
            replays = actor.replays_
            if run_act(consumer, actor, stop, max_polls=1) or actor.replays_ != replays:
                last = time.monotonic()
            metrics.polled()
            if idle_exit is not None and time.monotonic() - last > idle_exit:
                break
        if stop_server is not None:
            stop_server()
        counts = {o.value: n for o, n in actor.counts_.items() if n}
        print(f"fleethealth act: {counts or 'nothing handled'}; {actor.replays_} replays skipped", file=sys.stderr)
    return 0
