"""``fleethealth report``: one self-contained HTML page about a job, from a demo's store or a DSN."""

from __future__ import annotations

import argparse

from fleethealth.commands._common import open_store_at, progress, store_dsn

__all__ = ["add"]


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="write an HTML report of a job (plots of the store's data)",
                       description="Read one job's steps, telemetry, events, findings and recommendations from "
                                   "the store and write one self-contained HTML page (inline SVG plots, no "
                                   "network needed): per-rank compute heatmap, rack temperature map, timeline "
                                   "of findings and recommendations, SDC timeline, goodput waterfall and ETTR, and the "
                                   "checkpoint interval with its inputs.")
    p.add_argument("--data", default="fleethealth-data", metavar="DIR",
                   help="the data directory of a demo or `fleethealth detect` (DIR/store; default: %(default)s)")
    p.add_argument("--store", default=None, metavar="DSN", help="a store DSN instead of DIR/store")
    p.add_argument("--job", default=None, metavar="ID", help="the job to report (default: the one with most steps)")
    p.add_argument("--out", default="report.html", metavar="FILE", help="the page to write (default: %(default)s)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fleethealth.report import check_writable, require_extra, write
    from fleethealth.report.data import pick_job

    dsn = store_dsn(args.store, args.data)
    require_extra()
    check_writable(args.out)
    with open_store_at(dsn, migrate=False) as store:
        job = pick_job(store, args.job)  # a missing job or an empty store fails here, before any drawing
        with progress("report") as show:
            built = write(store, args.out, job, progress=show)
    size = Path(args.out).stat().st_size
    print(f"wrote {args.out} (job {built.job}, {len(built.sections)} sections, {size / 1024:.0f} KiB, "
          f"{built.render_s:.1f} s)")
    return 0
