"""The ``fleethealth`` command: wires the parts together and holds no logic of its own.

Each subcommand is one ``_cmd_<name>(sub)`` function that adds its parser and sets ``run``;
``COMMANDS`` lists them in the order ``--help`` shows. Imports of the wings happen inside the
``run`` functions so ``fleethealth --help`` stays fast on a node without chdb or torch.
Expected errors (:class:`fleethealth.errors.FleetHealthError`) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from fleethealth import __version__
from fleethealth.errors import FleetHealthError

__all__ = ["main", "build_parser"]

Runner = Callable[[argparse.Namespace], int]


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = []


def _cmd_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo", help="run a fault scenario through broker, detectors and store; write findings",
        description="Start the embedded Kafka-protocol broker and a chDB store, run a simulated GPU fleet "
                    "with injected faults through Kafka -> detectors -> ClickHouse, and export "
                    "OUT/findings.jsonl and OUT/recommendations.jsonl from the store.",
    )
    p.add_argument("--scenario", metavar="FILE",
                   help="scenario YAML/JSON (default: the shipped one, every fault kind)")
    p.add_argument("--out", metavar="DIR", default="fleethealth-out",
                   help="where the JSONL files go (default: %(default)s)")
    p.add_argument("--data", metavar="DIR", default="fleethealth-data",
                   help="the demo's store (DIR/store, recreated empty) and broker log (default: %(default)s); "
                        "query it afterwards with 'fleethealth query --data DIR'")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of a table")
    p.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fleethealth.demo import run_demo
    from fleethealth.detectors.runner import tune_gc
    from fleethealth.report import demo_summary
    from fleethealth.sim import Scenario

    scenario = Scenario.load(args.scenario) if args.scenario else Scenario.default()
    tune_gc()
    result = run_demo(scenario, Path(args.out), Path(args.data), progress=None if args.json else _progress())
    print(demo_summary(result, as_json=args.json))
    return 0


def _progress() -> Callable[[str, int, int], None]:
    last: dict[str, int] = {}

    def show(phase: str, done: int, total: int) -> None:
        pct = 100 * done // max(total, 1)
        if last.get(phase, -1) // 10 != pct // 10 or done == total:
            last[phase] = pct
            print(f"  {phase:8s} {pct:3d}% ({done}/{total})", file=sys.stderr, flush=True)

    return show


COMMANDS.append(_cmd_demo)


def _cmd_detect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "detect", help="run the streaming detectors: Kafka in, ClickHouse and Kafka out",
        description="Consume fh.steps, fh.telemetry and fh.events as a member of a consumer group (run several "
                    "replicas with the same --group to split partitions), detect stragglers, hangs, SDC and "
                    "health faults in event time, write inputs, findings and recommendations to the store "
                    "and publish them to fh.findings / fh.recommendations. Offsets are committed only after "
                    "the store write, so a crash neither loses nor duplicates a row.",
    )
    p.add_argument("--kafka", metavar="DSN", required=True, help="bus, e.g. kafka://broker:9092")
    p.add_argument("--store", metavar="DSN", required=True,
                   help="store, e.g. http://clickhouse:8123/fleethealth or chdb:///var/lib/fleethealth")
    p.add_argument("--group", default="fh-detect", help="consumer group (default: %(default)s)")
    p.add_argument("--metrics-port", type=int, default=9403,
                   help="Prometheus /metrics port, 0 to disable (default: %(default)s)")
    p.set_defaults(run=_run_detect)


def _run_detect(args: argparse.Namespace) -> int:
    import signal
    import threading

    from fleethealth.bus import ensure_topics
    from fleethealth.detectors.runner import Runner, tune_gc
    from fleethealth.store import open_store

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    tune_gc()
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port)
    ensure_topics(args.kafka)
    with open_store(args.store) as store:
        store.migrate()
        with Runner(args.kafka, store, group=args.group) as runner:
            print(f"fleethealth detect: consuming as group {args.group!r}", file=sys.stderr, flush=True)
            runner.run(stop)
    return 0


COMMANDS.append(_cmd_detect)



def _cmd_probe(sub: argparse._SubParsersAction) -> None:
    import os
    import socket

    p = sub.add_parser("probe", help="run the node probe: GPU telemetry and rank step timings to Kafka",
                       description="Sample this node's GPUs every interval (one fh.telemetry message), "
                                   "aggregate the training ranks' step timings from the Unix socket "
                                   "(fh.steps), forward events (fh.events), spool to disk while Kafka is "
                                   "unreachable, and serve Prometheus /metrics.")
    p.add_argument("--source", choices=("dcgm", "nvml", "sim"), default="nvml", help="telemetry source")
    p.add_argument("--kafka", metavar="DSN", default=os.environ.get("FLEETHEALTH_KAFKA"),
                   help="bus, kafka://host:port[,host:port] (default $FLEETHEALTH_KAFKA)")
    p.add_argument("--node", default=os.environ.get("FLEETHEALTH_NODE") or socket.gethostname(),
                   help="node name (default $FLEETHEALTH_NODE, else the hostname)")
    p.add_argument("--rack", default=os.environ.get("FLEETHEALTH_RACK", "unknown"), help="rack name")
    p.add_argument("--interval", type=float, default=1.0, metavar="S", help="seconds between samples")
    p.add_argument("--socket", metavar="PATH", default=None,
                   help="Unix socket for the in-job step timer (default $FLEETHEALTH_SOCKET or "
                        "/run/fleethealth/probe.sock)")
    p.add_argument("--no-socket", action="store_true", help="do not listen for training processes")
    p.add_argument("--spool-dir", metavar="DIR", default="/var/lib/fleethealth/spool",
                   help="on-disk queue used while Kafka is unreachable")
    p.add_argument("--spool-max-mb", type=float, default=512.0, metavar="MB",
                   help="spool bound; beyond it the oldest records are dropped and counted")
    p.add_argument("--metrics-port", type=int, default=9402, metavar="PORT", help="Prometheus port (0: off)")
    p.add_argument("--scenario", metavar="FILE", default=None, help="scenario for --source sim")
    p.add_argument("--dcgm-host", default=os.environ.get("FLEETHEALTH_DCGM_HOST", "localhost"), metavar="HOST[:PORT]",
                   help="nv-hostengine for --source dcgm (default $FLEETHEALTH_DCGM_HOST, else localhost; "
                        "GPU Operator's standalone host engine is nvidia-dcgm:5555)")
    p.add_argument("--dcgm-exporter-compat", action="store_true",
                   default=os.environ.get("FLEETHEALTH_DCGM_EXPORTER_COMPAT", "").lower() in ("1", "true", "yes"),
                   help="serve dcgm-exporter's DCGM_FI_* metric names and labels instead of fleethealth_gpu_* "
                        "(only where the probe replaces dcgm-exporter; default $FLEETHEALTH_DCGM_EXPORTER_COMPAT)")
    p.add_argument("--sysfs-root", metavar="DIR", default=os.environ.get("FLEETHEALTH_SYSFS_ROOT", "/"),
                   help="root whose sys/class/infiniband and sys/class/net hold the NIC counters "
                        "(default $FLEETHEALTH_SYSFS_ROOT, else /)")
    p.add_argument("--no-nic", action="store_true", help="do not read NIC counters")
    p.add_argument("--log-level", default=os.environ.get("FLEETHEALTH_LOG_LEVEL", "info"),
                   choices=("debug", "info", "warning", "error"),
                   help="log level (default $FLEETHEALTH_LOG_LEVEL, else info)")
    p.add_argument("--log-format", default=os.environ.get("FLEETHEALTH_LOG_FORMAT", "text"), choices=("text", "json"),
                   help="log lines as text or one JSON object each (default $FLEETHEALTH_LOG_FORMAT, else text)")
    p.add_argument("--stall-timeout", type=float, default=5.0, metavar="S",
                   help="a source call slower than this is reported as telemetry_stalled")
    p.add_argument("--step-timeout", type=float, default=5.0, metavar="S",
                   help="how long a step batch waits for the node's slower ranks")
    p.add_argument("--ensure-topics", action="store_true",
                   help="create the fh.* topics on every (re)connect (a broker that forgets them on restart)")
    p.add_argument("--duration", type=float, default=None, metavar="S", help="stop after S seconds")
    p.set_defaults(run=_run_probe)


def _run_probe(args: argparse.Namespace) -> int:
    import signal
    import threading
    import time

    from fleethealth.errors import ConfigError
    from fleethealth.probe.daemon import Probe, ProbeConfig, make_source
    from fleethealth.probe.logs import configure_logging
    from fleethealth.wire import DEFAULT_SOCKET

    configure_logging(args.log_level, args.log_format)
    if not args.kafka:
        raise ConfigError("--kafka DSN is required (or set FLEETHEALTH_KAFKA)")
    source = make_source(args.source, node=args.node, rack=args.rack, interval_s=args.interval,
                         scenario=args.scenario, dcgm_host=args.dcgm_host)
    config = ProbeConfig(node=args.node, rack=getattr(source, "rack", args.rack), interval_s=args.interval,
                         socket_path=None if args.no_socket else (args.socket or DEFAULT_SOCKET),
                         spool_dir=args.spool_dir, spool_max_bytes=int(args.spool_max_mb * (1 << 20)),
                         metrics_port=args.metrics_port or None, stall_timeout_s=args.stall_timeout,
                         step_timeout_s=args.step_timeout, nic_root=None if args.no_nic else args.sysfs_root,
                         dcgm_exporter_compat=args.dcgm_exporter_compat)
    on_connect = None
    if args.ensure_topics:
        from fleethealth.bus import ensure_topics

        on_connect = ensure_topics
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    timer = threading.Timer(args.duration, stop.set) if args.duration is not None else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    started = time.monotonic()
    with Probe(source, config, dsn=args.kafka, on_connect=on_connect) as probe:
        print(f"fleethealth probe: node {config.node}, source {args.source}, bus {args.kafka}, "
              f"socket {config.socket_path or 'off'}, metrics {config.metrics_port or 'off'}", file=sys.stderr)
        ticks = probe.run(stop)
        health = probe.health()
    print(f"fleethealth probe: stopped after {ticks} samples in {time.monotonic() - started:.1f} s; "
          f"delivered {health.delivered_total}, spooled {health.spool_records}, "
          f"dropped {health.spool_dropped_total}", file=sys.stderr)
    return 0


COMMANDS.append(_cmd_probe)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleethealth",
        description="Fleet health and silent-data-corruption detection for synchronous GPU training jobs.",
        epilog="start here:\n"
               "  fleethealth demo                      a faulty 256-GPU job through Kafka, detectors and ClickHouse\n"
               "  fleethealth query \"SELECT * FROM findings\" --data fleethealth-data\n"
               "  fleethealth budget young-daly --checkpoint-s 30 --mtbf-h 3.1 --restart-s 600\n"
               "on a GPU node: fleethealth probe --source nvml --kafka kafka://broker:9092\n"
               "every command has --help; expected errors print one line and exit 2",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"fleethealth {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run: Runner | None = getattr(args, "run", None)
    if run is None:
        parser.print_help()
        return 2
    try:
        return run(args)
    except FleetHealthError as exc:
        print(f"fleethealth {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


# ---------------------------------------------------------------- broker
def _cmd_broker(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("broker", help="run the embedded Kafka-protocol broker (Tansu) in the foreground",
                       description="Run the embedded Tansu broker on 127.0.0.1 and print its DSN. Storage is "
                                   "memory only: stopping it loses every topic, record and offset.")
    p.add_argument("--port", type=int, default=None, help="listen on this port (default: a free one)")
    p.set_defaults(run=_run_broker)


def _run_broker(args: argparse.Namespace) -> int:
    import signal
    import threading

    from fleethealth.broker import EmbeddedBroker
    from fleethealth.bus import ensure_topics
    from fleethealth.errors import BusUnavailable

    stop = threading.Event()
    handlers = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with EmbeddedBroker(port=args.port) as broker:
            ensure_topics(broker.dsn)
            print(broker.dsn, flush=True)
            print("fleethealth broker: memory storage; Ctrl-C stops it", file=sys.stderr, flush=True)
            while not stop.wait(0.5):
                if not broker.running:
                    raise BusUnavailable(f"the embedded broker exited: {broker.log_tail() or '(no output)'}")
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return 0


COMMANDS.append(_cmd_broker)


# ---------------------------------------------------------------- query
def _cmd_query(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("query", help="run read-only SQL on a demo's store",
                       description="Run one read-only SQL statement (ClickHouse readonly=1) on the store of "
                                   "a demo (DIR/store) or on --store DSN.")
    p.add_argument("sql", help="the statement, e.g. \"SELECT kind, node FROM findings\"")
    p.add_argument("--data", default="fleethealth-data", metavar="DIR",
                   help="the demo's data directory (default: %(default)s)")
    p.add_argument("--store", default=None, metavar="DSN", help="a store DSN instead of DIR/store")
    p.add_argument("--api", default=None, metavar="URL",
                   help="a running `fleethealth serve` to ask instead (default: tried at http://127.0.0.1:8080 "
                        "when no --store is given, since the server then owns the embedded store)")
    p.add_argument("--json", action="store_true", help="print one JSON object per row")
    p.set_defaults(run=_run_query)


def _run_query(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    import orjson

    from fleethealth.api.client import DEFAULT_URL, query_via_api, server_running
    from fleethealth.errors import ConfigError
    from fleethealth.store import open_store

    api = args.api or (DEFAULT_URL if args.store is None and server_running(DEFAULT_URL) else None)
    if api is not None:
        result = query_via_api(api, args.sql, os.environ.get("FLEETHEALTH_API_TOKEN"))
    else:
        dsn = args.store
        if dsn is None:
            path = Path(args.data) / "store"
            if not path.is_dir():
                raise ConfigError(f"no store at {path} (run `fleethealth demo --data {args.data}` first)")
            dsn = f"chdb://{path.resolve()}"
        with open_store(dsn) as store:
            result = store.query(args.sql, readonly=True)
    if args.json:
        for row in result.dicts():
            sys.stdout.write(orjson.dumps(row, default=str).decode() + "\n")
        return 0
    cells = [[str(v) for v in row] for row in result.rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(result.columns)]
    print("  ".join(c.ljust(w) for c, w in zip(result.columns, widths, strict=True)).rstrip())
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
    print(f"({len(cells)} row{'s' if len(cells) != 1 else ''})", file=sys.stderr)
    return 0


COMMANDS.append(_cmd_query)


# ---------------------------------------------------------------- budget
def _cmd_budget(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("budget", help="checkpoint-interval and reliability-budget arithmetic",
                       description="Young/Daly checkpoint interval and overhead terms (seed 000 §6), the "
                                   "automatic interval from measured MTBF, and a baseline-vs-candidate "
                                   "reliability budget in charged accelerator-hours (seed 003).")
    bs = p.add_subparsers(dest="budget_command", metavar="SUBCOMMAND", required=True)
    yd = bs.add_parser("young-daly", help="optimal interval and the three overhead terms")
    yd.add_argument("--checkpoint-s", type=float, required=True, metavar="C", help="checkpoint cost, seconds")
    yd.add_argument("--mtbf-h", type=float, required=True, metavar="M", help="job MTBF, hours")
    yd.add_argument("--restart-s", type=float, required=True, metavar="R", help="restart cost, seconds")
    yd.add_argument("--interval-s", type=float, default=None, metavar="T",
                    help="evaluate the terms at this interval (default: the optimum)")
    yd.add_argument("--json", action="store_true", help="print one JSON object")
    yd.set_defaults(run=_run_budget)
    iv = bs.add_parser("interval", help="automatic checkpoint interval from measured MTBF and checkpoint cost")
    iv.add_argument("--checkpoint-s", type=float, required=True, metavar="C", help="checkpoint cost, seconds")
    iv.add_argument("--mtbf-h", type=float, default=None, help="measured MTBF, hours")
    iv.add_argument("--interruptions", type=int, default=None, help="interruptions seen in the window")
    iv.add_argument("--window-h", type=float, default=None, help="length of that window, hours")
    iv.add_argument("--measured-gpus", type=int, default=None, help="GPU count the MTBF was measured at")
    iv.add_argument("--gpus", type=int, default=None, help="GPU count to plan for (MTBF scales as 1/GPUs)")
    iv.add_argument("--method", choices=("young", "daly"), default="young")
    iv.add_argument("--min-s", type=float, default=60.0, help="shortest interval allowed (default 60)")
    iv.add_argument("--max-s", type=float, default=6 * 3600.0, help="longest interval allowed (default 21600)")
    iv.add_argument("--json", action="store_true", help="print one JSON object")
    iv.set_defaults(run=_run_budget)
    cp = bs.add_parser("compare", help="price a baseline and a candidate design (seed 003 ledger)")
    cp.add_argument("file", help="budget YAML/JSON, e.g. fleethealth/scenarios/budget_seed003.yaml")
    cp.add_argument("--json", action="store_true", help="print one JSON object")
    cp.set_defaults(run=_run_budget)


def _run_budget(args: argparse.Namespace) -> int:
    import orjson

    from fleethealth.errors import ConfigError
    from fleethealth.policy import budget

    if args.budget_command == "young-daly":
        result = budget.young_daly(args.checkpoint_s, args.mtbf_h * 3600.0, args.restart_s, args.interval_s)
    elif args.budget_command == "interval":
        mtbf_s = None if args.mtbf_h is None else args.mtbf_h * 3600.0
        window_s = None if args.window_h is None else args.window_h * 3600.0
        if (args.gpus is None) != (args.measured_gpus is None):
            raise ConfigError("give both --measured-gpus and --gpus to scale the MTBF, or neither")
        if args.gpus is not None:
            if mtbf_s is None:
                if args.interruptions is None or window_s is None:
                    raise ConfigError("give --mtbf-h, or --interruptions with --window-h")
                mtbf_s, _ = budget.measured_mtbf_s(args.interruptions, window_s)
            mtbf_s = budget.scale_mtbf(mtbf_s, args.measured_gpus, args.gpus)
        result = budget.auto_interval(args.checkpoint_s, mtbf_s=mtbf_s, interruptions=args.interruptions,
                                      window_s=window_s, method=args.method, min_s=args.min_s, max_s=args.max_s)
    else:
        result = budget.load_comparison(args.file)
    if args.json:
        sys.stdout.write(orjson.dumps(result.to_obj(), option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print(result.to_text())
    return 0


COMMANDS.append(_cmd_budget)


# ---------------------------------------------------------------- selftest
def _cmd_selftest(sub: argparse._SubParsersAction) -> None:
    import os
    import socket

    p = sub.add_parser("selftest", help="known-answer GEMM, ABFT, memory and collective tests on this node",
                       description="Run the known-answer self-test suite on this node's devices. Exit 0 when "
                                   "every test passes, 1 when any fails or is slow, 2 when the suite cannot run.")
    p.add_argument("--suite", default="quick", metavar="quick|full", help="which suite (default quick)")
    p.add_argument("--device", default="all", metavar="cpu|cuda:N|all",
                   help="device to test; all = every GPU, or the CPU where there is none (default all)")
    p.add_argument("--only", default=None, metavar="TEST[,TEST]",
                   help="run only these test groups (gemm_exact_fp32, …, memory, collective)")
    p.add_argument("--json", action="store_true", help="print one JSON record per test instead of a table")
    p.add_argument("--inject-fault", default=None, metavar="bitflip|stuck-bit|slow",
                   help="corrupt one element / one memory bit / the timing inside the tests, to prove detection")
    p.add_argument("--seed", type=int, default=0, help="seed for fault positions")
    p.add_argument("--kafka", metavar="DSN", default=os.environ.get("FLEETHEALTH_KAFKA"),
                   help="publish each result to fh.events (default $FLEETHEALTH_KAFKA)")
    p.add_argument("--store", metavar="DSN", default=None,
                   help="store for fleet-median baselines; results are written there too")
    p.add_argument("--baseline", metavar="FILE", default=None,
                   help="baselines from an earlier --json run (one record a line)")
    p.add_argument("--slow-fraction", type=float, default=0.05, metavar="F",
                   help="a result more than F below its baseline is slow (default 0.05)")
    p.add_argument("--node", default=os.environ.get("FLEETHEALTH_NODE") or socket.gethostname().split(".")[0],
                   help="node name for the records (default $FLEETHEALTH_NODE, else the short hostname)")
    p.set_defaults(run=_run_selftest)


def _run_selftest(args: argparse.Namespace) -> int:
    import orjson
    from rich.console import Console
    from rich.progress import Progress

    from fleethealth.errors import ConfigError
    from fleethealth.kernels.backend import resolve_devices
    from fleethealth.kernels.baseline import BaselineBook
    from fleethealth.kernels.faults import Fault
    from fleethealth.kernels.report import exit_code, json_line, render_table
    from fleethealth.kernels.suite import SUITES, plan, run_suite

    if args.suite not in SUITES:
        raise ConfigError(f"unknown suite {args.suite!r} (known: {', '.join(SUITES)})")
    if args.kafka:  # a malformed DSN is refused before the suite runs, not after
        from fleethealth.bus import known_schemes, parse_dsn

        scheme, _ = parse_dsn(args.kafka)
        if f"{scheme}://" not in known_schemes().split(", "):
            raise ConfigError(f"unknown bus scheme {scheme + '://'!r} in {args.kafka!r} (known: {known_schemes()})")
    only = [t.strip() for t in args.only.split(",") if t.strip()] if args.only else None
    devices = resolve_devices(args.device)
    plan(args.suite, devices, only=only)  # validates --only before anything runs
    fault = Fault.parse(args.inject_fault, seed=args.seed)
    records: list[dict] = []
    if args.baseline:
        try:
            with open(args.baseline, "rb") as fh:
                records = [orjson.loads(line) for line in fh if line.strip()]
        except (OSError, orjson.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read baselines from {args.baseline}: {exc}") from exc
    fleet = BaselineBook.from_records(records).fleet
    store = None
    if args.store:
        from fleethealth.store import open_store

        store = open_store(args.store)
        store.migrate()
        fleet = {**BaselineBook.from_store(store).fleet, **fleet}
    book = BaselineBook(fleet=fleet, slow_fraction=args.slow_fraction, min_samples=1 if args.baseline else 3)
    err = Console(stderr=True)
    try:
        with Progress(console=err, transient=True) as bar:
            task = bar.add_task("selftest", total=None)

            def progress(label: str, done: int, total: int) -> None:
                bar.update(task, description=label, completed=done, total=total)

            results = run_suite(args.suite, devices, fault=fault, baselines=book, only=only, progress=progress)
        events = [r.to_event(args.node) for r in results]
        if store is not None:
            store.insert_events(events)
    finally:
        if store is not None:
            store.close()
    if args.json:
        sys.stdout.write("".join(json_line(r, args.node).decode() + "\n" for r in results))
    else:
        render_table(results, Console(width=None if sys.stdout.isatty() else 140),
                     title=f"fleethealth selftest --suite {args.suite} on {args.node}")
    sys.stdout.flush()
    if args.kafka:  # results are printed first: a bus outage must not lose them or change the verdict
        from fleethealth.bus import Producer
        from fleethealth.errors import BusError

        try:
            with Producer(args.kafka, client_id="fleethealth-selftest") as producer:
                for event in events:
                    producer.publish(event)
                producer.flush()
        except BusError as exc:
            print(f"fleethealth selftest: warning: results not published to {args.kafka}: {exc}", file=sys.stderr)
    return exit_code(results)


COMMANDS.append(_cmd_selftest)


# ---------------------------------------------------------------- serve
def _cmd_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the HTTP API (and, embedded, the broker, store and detectors)",
                       description="Serve the HTTP API under uvicorn. Without --kafka it also starts the embedded "
                                   "broker, owns the chDB store at DIR/store and runs the detector runner on a "
                                   "thread, so one process holds the store and every other client goes through "
                                   "the API (fleethealth query included).")
    p.add_argument("--data", default="fleethealth-data", metavar="DIR", help="data directory (default: %(default)s)")
    p.add_argument("--kafka", default=None, metavar="DSN", help="an existing Kafka (kafka://host:port) instead of "
                                                                "the embedded broker")
    p.add_argument("--store", default=None, metavar="DSN", help="a store DSN instead of chdb://DIR/store")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default: %(default)s)")
    p.add_argument("--port", type=int, default=8080, help="listen port (default: %(default)s)")
    p.add_argument("--token-file", default=None, metavar="F",
                   help="file holding the bearer token for write endpoints (else $FLEETHEALTH_API_TOKEN; "
                        "without either, writes are refused)")
    p.add_argument("--no-detect", action="store_true", help="serve the API only; run no detector runner")
    p.set_defaults(run=_run_serve)


def _api_token(path: str | None) -> str | None:
    import os
    from pathlib import Path

    from fleethealth.errors import ConfigError

    if path is not None:
        try:
            token = Path(path).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read --token-file {path}: {exc}") from exc
        if not token:
            raise ConfigError(f"--token-file {path} is empty")
        return token
    return os.environ.get("FLEETHEALTH_API_TOKEN") or None


def _run_serve(args: argparse.Namespace) -> int:
    import contextlib
    import signal
    import threading
    from pathlib import Path

    import uvicorn
    from prometheus_client import CollectorRegistry

    from fleethealth.api import create_app
    from fleethealth.store import open_store

    token = _api_token(args.token_file)
    if token is None:
        print("fleethealth serve: no token (--token-file or FLEETHEALTH_API_TOKEN): write endpoints refuse",
              file=sys.stderr)
    stop = threading.Event()
    registry = CollectorRegistry()
    with contextlib.ExitStack() as stack:
        dsn = args.kafka
        if dsn is None:
            from fleethealth.broker import EmbeddedBroker

            dsn = stack.enter_context(EmbeddedBroker()).dsn
        store_dsn = args.store or f"chdb://{(Path(args.data) / 'store').resolve()}"
        if args.store is None:
            (Path(args.data) / "store").mkdir(parents=True, exist_ok=True)
        store = stack.enter_context(open_store(store_dsn))
        store.migrate()
        hook = None
        server: uvicorn.Server | None = None
        failed: list[BaseException] = []
        if not args.no_detect:
            from fleethealth.bus import ensure_topics
            from fleethealth.detectors.runner import Runner

            ensure_topics(dsn)
            runner = stack.enter_context(Runner(dsn, store, registry=registry))
            hook = getattr(getattr(runner.pipeline, "policy", None), "reset_breaker", None)

            def detect() -> None:  # a dead detector must not leave an API that looks healthy
                try:
                    runner.run(stop)
                except Exception as exc:
                    failed.append(exc)
                    print(f"fleethealth serve: the detectors stopped: {exc}", file=sys.stderr, flush=True)
                    if server is not None:
                        server.should_exit = True

            thread = threading.Thread(target=detect, name="fleethealth-detect", daemon=True)
            thread.start()
            stack.callback(thread.join, 10.0)
            stack.callback(stop.set)
        app = create_app(store, token=token, registry=registry, on_breaker_reset=hook)
        print(f"fleethealth serve: http://{args.host}:{args.port} (bus {dsn}, store {store_dsn})",
              file=sys.stderr, flush=True)
        # uvicorn re-raises the signal that stopped it once it has shut down; ours sets ``stop`` so
        # the runner, store and broker still close in order
        handlers = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning"))
        try:
            if not failed:
                server.run()
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
    return 1 if failed else 0


COMMANDS.append(_cmd_serve)


# ---------------------------------------------------------------- act
def _cmd_act(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("act", help="carry out recommendations on Slurm or Kubernetes",
                       description="Consume fh.recommendations and act on those with guard 'allowed' whose action "
                                   "the scheduler supports (evict, drain, quarantine): Slurm drains the node, "
                                   "Kubernetes cordons, taints and marks it. Each outcome is journaled (a replay "
                                   "never acts twice), logged and published on fh.events.")
    p.add_argument("--scheduler", required=True, choices=("slurm", "kubernetes"))
    p.add_argument("--kafka", default=None, metavar="DSN",
                   help="the bus, e.g. the DSN `fleethealth serve` prints (default: $FLEETHEALTH_KAFKA)")
    p.add_argument("--dry-run", action="store_true", help="record what would be done; change nothing")
    p.add_argument("--data", default="fleethealth-data", metavar="DIR",
                   help="where the journal DIR/act-SCHEDULER.jsonl lives (default: %(default)s)")
    p.add_argument("--group", default=None, help="consumer group (default: fh-act-SCHEDULER)")
    p.add_argument("--max-actions", type=int, default=5,
                   help="the adapter's own rate limit: at most this many actions per --window-s (default: 5)")
    p.add_argument("--window-s", type=float, default=3600.0, help="the rate-limit window, seconds (default: 3600)")
    p.add_argument("--max-age-s", type=float, default=1800.0, metavar="S",  # adapters.act.DEFAULT_MAX_AGE_S
                   help="record but do not act on recommendations older than S seconds, so a replayed old "
                        "topic never drains a recovered node (default: %(default)g, twice the policy engine's "
                        "900 s staleness bound; 0 = no bound, for simulated fleets in their own time)")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: ~/.kube/config)")
    p.add_argument("--in-cluster", action="store_true", help="use the pod's service account")
    p.add_argument("--idle-exit", type=float, default=None, metavar="S",
                   help="exit after S seconds without a new recommendation (default: run until stopped)")
    p.set_defaults(run=_run_act)


def _run_act(args: argparse.Namespace) -> int:
    import logging
    import os
    import signal
    import threading
    import time
    from pathlib import Path

    from fleethealth.adapters import ActionRecord, Actor, Journal, KubernetesAdapter, SlurmAdapter, run_act
    from fleethealth.bus import Consumer, Producer
    from fleethealth.errors import ConfigError
    from fleethealth.schema import Topic

    dsn = args.kafka or os.environ.get("FLEETHEALTH_KAFKA")
    if not dsn:
        raise ConfigError("no bus: give --kafka DSN (the one `fleethealth serve` prints) or set FLEETHEALTH_KAFKA")
    if args.max_age_s < 0:
        raise ConfigError(f"--max-age-s must be >= 0 (0 = no bound), got {args.max_age_s:g}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    adapter = (SlurmAdapter() if args.scheduler == "slurm"
               else KubernetesAdapter(kubeconfig=args.kubeconfig, in_cluster=args.in_cluster))
    stop = threading.Event()
    handlers = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with Producer(dsn, client_id=f"fh-act-{args.scheduler}") as producer, \
                Consumer(dsn, [Topic.RECOMMENDATIONS.value], args.group or f"fh-act-{args.scheduler}",
                         producer=producer) as consumer:
            def emit(record: ActionRecord) -> None:
                producer.publish(record.to_event())
                producer.flush()

            actor = Actor(adapter, journal=Journal(Path(args.data) / f"act-{args.scheduler}.jsonl"),
                          dry_run=args.dry_run, max_actions=args.max_actions, window_s=args.window_s,
                          max_age_s=args.max_age_s or None, emit=emit)
            consumer.wait_assigned()
            last = time.monotonic()
            while not stop.is_set():
                replays = actor.replays_
                if run_act(consumer, actor, stop, max_polls=1) or actor.replays_ != replays:
                    last = time.monotonic()
                if args.idle_exit is not None and time.monotonic() - last > args.idle_exit:
                    break
            counts = {o.value: n for o, n in actor.counts_.items() if n}
            print(f"fleethealth act: {counts or 'nothing handled'}; {actor.replays_} replays skipped",
                  file=sys.stderr)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return 0


COMMANDS.append(_cmd_act)


# ---------------------------------------------------------------- sweep
def _cmd_sweep(sub: argparse._SubParsersAction) -> None:
    import os

    p = sub.add_parser("sweep", help="run the self-test suite across idle or suspect nodes, riskiest first",
                       description="Run the self-test suite on nodes (here, or on Slurm nodes through srun -w), "
                                   "quarantined and at-risk nodes first; publish and store the results; return "
                                   "quarantined nodes that pass the complete full suite to the pool. Exit 0 when "
                                   "every node passes, 1 otherwise, 2 when the sweep cannot run.")
    p.add_argument("nodes", nargs="*", help="node names (default: --idle, else the store's quarantined and "
                                            "at-risk nodes, else this machine with --launcher local)")
    p.add_argument("--nodes-file", metavar="FILE", help="node names, one a line or comma-separated")
    p.add_argument("--idle", action="store_true", help="sweep the nodes Slurm reports idle (sinfo -t idle)")
    p.add_argument("--partition", default=None, help="with --idle: only this Slurm partition")
    p.add_argument("--launcher", choices=("local", "srun"), default="local",
                   help="local: run here; srun: srun -w NODE on a Slurm cluster (default local)")
    p.add_argument("--srun", default="srun", metavar="PATH", help="the srun program")
    p.add_argument("--srun-arg", action="append", default=[], metavar="OPT",
                   help="extra srun option, one per flag (e.g. --srun-arg=--exclusive)")
    p.add_argument("--remote-command", default="fleethealth", metavar="CMD",
                   help="how a node starts fleethealth (split on spaces; default fleethealth)")
    p.add_argument("--suite", default="full", help="quick or full (default full: only full can release)")
    p.add_argument("--device", default="all", help="cpu, cuda:N or all (default all)")
    p.add_argument("--only", default=None, metavar="TEST[,TEST]", help="run only these test groups")
    p.add_argument("--store", metavar="DSN", default=os.environ.get("FLEETHEALTH_STORE"),
                   help="store: node risk, quarantine book, results (default $FLEETHEALTH_STORE)")
    p.add_argument("--kafka", metavar="DSN", default=os.environ.get("FLEETHEALTH_KAFKA"),
                   help="publish results to fh.events (default $FLEETHEALTH_KAFKA)")
    p.add_argument("--no-release", action="store_true", help="do not return passing quarantined nodes to the pool")
    p.add_argument("--parallel", type=int, default=1, metavar="N", help="nodes tested at once (default 1)")
    p.add_argument("--timeout", type=float, default=1800.0, metavar="S", help="per-node limit (default 1800)")
    p.add_argument("--json", action="store_true", help="print one JSON object per node instead of a table")
    p.set_defaults(run=_run_sweep)


def _run_sweep(args: argparse.Namespace) -> int:
    import socket

    import orjson
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from fleethealth.errors import ConfigError
    from fleethealth.sweeps.launch import LocalLauncher, SrunLauncher, slurm_idle_nodes
    from fleethealth.sweeps.plan import read_node_list, validate_node
    from fleethealth.sweeps.runner import run_sweep

    nodes = [validate_node(n) for n in args.nodes]
    if args.nodes_file:
        try:
            with open(args.nodes_file, encoding="utf-8") as fh:
                nodes += read_node_list(fh.read())
        except OSError as exc:
            raise ConfigError(f"cannot read {args.nodes_file}: {exc.strerror}") from exc
    if args.idle:
        nodes += slurm_idle_nodes(partition=args.partition)
    if args.launcher == "srun":
        launcher = SrunLauncher(srun=args.srun, command=tuple(args.remote_command.split()),
                                extra=tuple(args.srun_arg))
    else:
        launcher = LocalLauncher()
        if not nodes and not args.store:
            nodes = [socket.gethostname().split(".")[0]]
    only = [t.strip() for t in args.only.split(",") if t.strip()] if args.only else None
    store = producer = None
    try:
        if args.store:
            from fleethealth.store import open_store

            store = open_store(args.store)
            store.migrate()
        if args.kafka:
            from fleethealth.bus import Producer

            producer = Producer(args.kafka, client_id="fleethealth-sweep")
        with Progress(console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task("sweep", total=None)

            def progress(label: str, done: int, total: int) -> None:
                bar.update(task, description=label, completed=done, total=total)

            report = run_sweep(nodes or None, launcher=launcher, suite=args.suite, device=args.device, only=only,
                               store=store, producer=producer, release=not args.no_release,
                               timeout_s=args.timeout, parallel=args.parallel, progress=progress)
    finally:
        if producer is not None:
            producer.close()
        if store is not None:
            store.close()
    if args.json:
        sys.stdout.write("".join(orjson.dumps(o.to_obj()).decode() + "\n" for o in report.outcomes))
    else:
        table = Table(title=f"fleethealth sweep --suite {args.suite}")
        for name in ("node", "status", "tests", "failing / error", "risk", "released"):
            table.add_column(name, no_wrap=name != "failing / error")
        for o in report.outcomes:
            table.add_row(o.run.node, o.run.status.value, str(len(o.run.results)),
                          o.run.error or ", ".join(o.run.failing[:3]) or "-", ", ".join(o.risk.reasons) or "-",
                          "yes" if o.released else ("-" if o.decision is None else "no"))
        console = Console(width=None if sys.stdout.isatty() else 140)
        console.print(table)
        console.print(report.summary())
    return report.exit_code


COMMANDS.append(_cmd_sweep)


if __name__ == "__main__":
    sys.exit(main())
