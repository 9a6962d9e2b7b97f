"""``fleethealth selftest``: the known-answer GEMM, ABFT, memory and collective tests on this node."""

from __future__ import annotations

import argparse
import os
import sys

from fleethealth.commands._common import optional_store, parse_only, progress

__all__ = ["add"]


def add(sub: argparse._SubParsersAction) -> None:
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
    p.add_argument("--key-file", metavar="FILE", default=os.environ.get("FLEETHEALTH_SIGNING_KEY_FILE"),
                   help="this node's signing key: published results are signed as this node "
                        "(default $FLEETHEALTH_SIGNING_KEY_FILE; deploy/README.md \"Signed messages\")")
    p.add_argument("--store", metavar="DSN", default=None,
                   help="store for fleet-median baselines; results are written there too")
    p.add_argument("--baseline", metavar="FILE", default=None,
                   help="baselines from an earlier --json run (one record a line)")
    p.add_argument("--slow-fraction", type=float, default=0.05, metavar="F",
                   help="a result more than F below its baseline is slow (default 0.05)")
    p.add_argument("--node", default=None,
                   help="node name for the records (default $FLEETHEALTH_NODE, else the short hostname, or "
                        "the FQDN with FLEETHEALTH_NODE_NAMING=fqdn)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import orjson
    from rich.console import Console

    from fleethealth.errors import ConfigError
    from fleethealth.kernels.backend import resolve_devices
    from fleethealth.kernels.baseline import BaselineBook
    from fleethealth.kernels.faults import Fault
    from fleethealth.kernels.presentation import exit_code, json_line, render_table
    from fleethealth.kernels.suite import SUITES, plan, run_suite
    from fleethealth.nodename import node_name

    if args.suite not in SUITES:
        raise ConfigError(f"unknown suite {args.suite!r} (known: {', '.join(SUITES)})")
    if args.kafka:  # a malformed DSN is refused before the suite runs, not after
        from fleethealth.bus import known_schemes, parse_dsn

        scheme, _ = parse_dsn(args.kafka)
        if f"{scheme}://" not in known_schemes().split(", "):
            raise ConfigError(f"unknown bus scheme {scheme + '://'!r} in {args.kafka!r} (known: {known_schemes()})")
    node = node_name(args.node)
    only = parse_only(args.only)
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
    with optional_store(args.store) as store:
        if store is not None:
            fleet = {**BaselineBook.from_store(store).fleet, **fleet}
        book = BaselineBook(fleet=fleet, slow_fraction=args.slow_fraction, min_samples=1 if args.baseline else 3)
        with progress("selftest") as show:
            results = run_suite(args.suite, devices, fault=fault, baselines=book, only=only, progress=show)
        events = [r.to_event(node) for r in results]
        if store is not None:
            store.insert_events(events)
    if args.json:
        sys.stdout.write("".join(json_line(r, node).decode() + "\n" for r in results))
    else:
        render_table(results, Console(width=None if sys.stdout.isatty() else 140),
                     title=f"fleethealth selftest --suite {args.suite} on {node}")
    sys.stdout.flush()
    if args.kafka:  # results are printed first: a bus outage must not lose them or change the verdict
        from fleethealth.bus import Producer
        from fleethealth.errors import BusError

        try:
            from fleethealth.signing import load_signer

            with Producer(args.kafka, client_id="fleethealth-selftest",
                          signer=load_signer(args.key_file, node)) as producer:
                for event in events:
                    producer.publish(event)
                producer.flush()
        except BusError as exc:
            print(f"fleethealth selftest: warning: results not published to {args.kafka}: {exc}", file=sys.stderr)
    return exit_code(results)
