"""The ``fleethealth`` command: wires the parts together and holds no logic of its own.

One module per command group; each has ``add(sub)``, which adds its parser and sets ``run``.
:data:`GROUPS` lists them in the order ``--help`` shows. Imports of the wings happen inside the
``run`` functions so ``fleethealth --help`` stays fast on a node without chdb or torch. Expected
errors (:class:`fleethealth.errors.FleetHealthError`) print one line and exit 2. Helpers more than
one command uses live once in :mod:`fleethealth.commands._common`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from fleethealth import __version__
from fleethealth.commands import (
    act,
    broker,
    budget,
    checkpoint,
    config,
    demo,
    detect,
    migrate,
    probe,
    query,
    report,
    selftest,
    serve,
    sweep,
)
from fleethealth.errors import FleetHealthError

__all__ = ["main", "build_parser", "GROUPS"]

Run = Callable[[argparse.Namespace], int]

GROUPS = (demo, detect, probe, broker, query, report, budget, checkpoint, selftest, serve, act, sweep, migrate, config)
"""The command groups, in ``--help`` order."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleethealth",
        description="Fleet health and silent-data-corruption detection for synchronous GPU training jobs.",
        epilog="start here:\n"
               "  fleethealth demo                      a faulty 256-GPU job through Kafka, detectors and ClickHouse\n"
               "  fleethealth query \"SELECT * FROM findings\" --data fleethealth-data\n"
               "  fleethealth report --data fleethealth-data --out report.html\n"
               "  fleethealth budget young-daly --checkpoint-s 30 --mtbf-h 3.1 --restart-s 600\n"
               "on a GPU node: fleethealth probe --source nvml --kafka kafka://broker:9092\n"
               "settings: fleethealth config show (file < $FLEETHEALTH_... < flags)\n"
               "every command has --help; expected errors print one line and exit 2",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"fleethealth {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for group in GROUPS:
        group.add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run: Run | None = getattr(args, "run", None)
    if run is None:
        parser.print_help()
        return 2
    try:
        code = run(args)
        sys.stdout.flush()  # a reader gone before the last write shows here, not at exit
        return code
    except FleetHealthError as exc:
        print(f"fleethealth {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader went away (`fleethealth query ... | head`): no traceback, and no second error
        # when Python flushes stdout at exit
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
