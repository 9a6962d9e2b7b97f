"""``fleethealth sweep``: the self-test suite across idle or suspect nodes, riskiest first, and the
return of passing quarantined nodes to the pool."""

from __future__ import annotations

import argparse
import os
import sys

from fleethealth.commands._common import optional_producer, optional_store, parse_only, progress

__all__ = ["add"]


def add(sub: argparse._SubParsersAction) -> None:
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
    p.add_argument("--key-file", metavar="FILE", default=os.environ.get("FLEETHEALTH_SIGNING_KEY_FILE"),
                   help="this node's signing key (--launcher local: the sweep runs on the node it tests); "
                        "published results are signed as this node (default $FLEETHEALTH_SIGNING_KEY_FILE)")
    p.add_argument("--no-release", action="store_true", help="do not return passing quarantined nodes to the pool")
    p.add_argument("--maint-reservation", action="store_true",
                   help="with --launcher srun: test nodes fleethealth drained inside a MAINT,IGNORE_JOBS "
                        "reservation (srun --reservation), and resume in Slurm those the quarantine book releases")
    p.add_argument("--kubernetes-release", action="store_true",
                   help="with --launcher local in a pod: undo fleethealth's cordon and taint on a node the "
                        "quarantine book releases (in-cluster service account)")
    p.add_argument("--parallel", type=int, default=1, metavar="N", help="nodes tested at once (default 1)")
    p.add_argument("--timeout", type=float, default=1800.0, metavar="S", help="per-node limit (default 1800)")
    p.add_argument("--json", action="store_true", help="print one JSON object per node instead of a table")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import orjson
    from rich.console import Console
    from rich.table import Table

    from fleethealth.errors import ConfigError
    from fleethealth.nodename import node_name
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
    if args.maint_reservation and args.launcher != "srun":
        raise ConfigError("--maint-reservation needs --launcher srun")
    if args.kubernetes_release and args.launcher != "local":
        raise ConfigError("--kubernetes-release needs --launcher local (the sweep pod on the node)")
    if args.launcher == "srun":
        slurm = None
        if args.maint_reservation:
            from fleethealth.adapters import SlurmAdapter

            slurm = SlurmAdapter()
        launcher = SrunLauncher(srun=args.srun, command=tuple(args.remote_command.split()),
                                extra=tuple(args.srun_arg), scheduler=slurm)
    else:
        kubernetes = None
        if args.kubernetes_release:
            from fleethealth.adapters import KubernetesAdapter

            kubernetes = KubernetesAdapter(in_cluster=True)
        launcher = LocalLauncher(scheduler=kubernetes)
        if not nodes and not args.store:
            nodes = [node_name()]
    only = parse_only(args.only)
    with optional_store(args.store) as store, optional_producer(args.kafka, "fleethealth-sweep") as producer, \
            progress("sweep") as show:
        if producer is not None and args.key_file:
            from fleethealth.signing import load_signer

            producer.signer = load_signer(args.key_file, node_name())  # only this node's results verify
        report = run_sweep(nodes or None, launcher=launcher, suite=args.suite, device=args.device, only=only,
                           store=store, producer=producer, release=not args.no_release,
                           timeout_s=args.timeout, parallel=args.parallel, progress=show)
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
