"""``fleethealth query``: read-only SQL on a demo's store, or through a running server's API."""

from __future__ import annotations

import argparse
import sys

from fleethealth.commands._common import open_store_at, store_dsn

__all__ = ["add"]


def add(sub: argparse._SubParsersAction) -> None:
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
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import os

    import orjson

    from fleethealth.api.client import DEFAULT_URL, query_via_api, server_running

    api = args.api or (DEFAULT_URL if args.store is None and server_running(DEFAULT_URL) else None)
    if api is not None:
        token = os.environ.get("FLEETHEALTH_READ_TOKEN") or os.environ.get("FLEETHEALTH_API_TOKEN")
        result = query_via_api(api, args.sql, token)
    else:
        with open_store_at(store_dsn(args.store, args.data), migrate=False) as store:
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
