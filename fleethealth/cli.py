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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleethealth",
        description="Fleet health and silent-data-corruption detection for synchronous GPU training jobs.",
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


if __name__ == "__main__":
    sys.exit(main())
