"""``fleethealth migrate status|plan|up``: the store's schema changes as a step of their own."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from fleethealth.commands._common import embedded_store_dsn, open_store_at
from fleethealth.commands._settings import add_config_flags, add_setting, load_settings

__all__ = ["add"]

_DESCRIPTION = """\
Apply the store's schema changes (deploy/clickhouse/NNN_name.sql) as a step of their own, before
the writers start: `serve`, `detect` and `act` refuse to start while a migration is pending (unless
given --migrate), and `serve --no-detect` never migrates.

  status   what the store holds against this release: applied, pending, dirty (a migration that
           stopped half-way, with the step it stopped at), changed (an applied migration whose
           file differs: an error), and who holds the migration lock; exit 1 when not current
  plan     every step `up` would run, those already done marked, and the rows and bytes of each
           table a migration copies (expected copy time: deploy/README.md, "Upgrading")
  up       apply the pending migrations under the store's migration lock, one recorded step at a
           time; a migrator stopped anywhere (killed, out of space) continues where it stopped
           when run again. A second migrator refuses, naming the holder of the lock.

Stop the writers (detect, serve with detectors) before `up`: rows written to a table between
a migration's copy and its drop are not carried over. status and plan only read (a SELECT-only
user will do); up needs a user that may create, rename and drop tables."""


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("migrate", help="show, plan or apply the store's schema migrations",
                       description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=("status", "plan", "up"), help="status, plan or up (see above)")
    add_setting(p, "--store", "store", metavar="DSN",
                help="the store, e.g. http://clickhouse:8123/fleethealth or chdb:///var/lib/fleethealth "
                     "(default: config key store, else chdb://DATA/store)")
    add_setting(p, "--data", "data", metavar="DIR", help="with no store DSN: the embedded store DIR/store")
    add_setting(p, "--lock-ttl-s", "migrate.lock_ttl_s", type=float, metavar="S",
                help="up: the migration lock's claim lasts S seconds unless extended (it is, before every step); "
                     "longer than the longest step (default: %(default)g)")
    p.add_argument("--break-lock", action="store_true",
                   help="up: take the migration lock from its holder (only when that migrator is known to be gone)")
    p.add_argument("--json", action="store_true", help="status and plan as one JSON object")
    add_config_flags(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from fleethealth.store.migrator import plan, status

    settings = load_settings(args)
    dsn = settings["store"] or embedded_store_dsn(settings["data"], create=args.action == "up")
    with open_store_at(dsn) as store:
        if args.action == "status":
            found = status(store)
            _print_status(found.as_dict(), store.dsn, as_json=args.json)
            return 0 if found.current else 1
        if args.action == "plan":
            _print_plan(plan(store), as_json=args.json)
            return 0
        applied = store.migrate(lock_ttl_s=settings["migrate.lock_ttl_s"], break_lock=args.break_lock)
        print(f"fleethealth migrate: {len(applied)} applied ({', '.join(applied) or 'none pending'}); "
              f"{store.dsn} is current", file=sys.stderr)
    return 0


def _print_status(found: dict[str, Any], dsn: str, *, as_json: bool) -> None:
    if as_json:
        import orjson

        sys.stdout.write(orjson.dumps({"store": dsn, **found}).decode() + "\n")
        return
    print(f"store    {dsn}")
    print(f"applied  {len(found['applied'])}" + (f" (last {found['applied'][-1]})" if found["applied"] else ""))
    for name in found["pending"]:
        dirty = found["dirty"].get(name)
        print(f"pending  {name}" + (f"  DIRTY: {dirty}" if dirty else ""))
    for name, why in found["changed"].items():
        print(f"CHANGED  {name}: {why}")
    for name in found["unknown"]:
        print(f"unknown  {name} (applied by a newer release)")
    print(f"lock     {found['lock'] or 'free'}")


def _print_plan(planned: list[Any], *, as_json: bool) -> None:
    if as_json:
        import orjson

        out = [{"migration": m.name,
                "steps": [{"step": s.index + 1, "kind": s.kind, "done": s.index in m.done, "statement": s.summary}
                          for s in m.steps],
                "copies": {t: {"rows": r, "bytes": b} for t, (r, b) in m.copies.items()}} for m in planned]
        sys.stdout.write(orjson.dumps(out).decode() + "\n")
        return
    if not planned:
        print("nothing to do: the store is current")
    for m in planned:
        print(m.name)
        for s in m.steps:
            print(f"  {'done' if s.index in m.done else '    '} {s.index + 1:2d} {s.kind:6s} {s.summary}")
        for table, (rows, size) in m.copies.items():
            print(f"  copies {table}: {rows} rows, {size / 1e9:.3f} GB on disk")
