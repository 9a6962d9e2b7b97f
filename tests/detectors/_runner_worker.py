"""A detector runner in a process of its own, for the crash test (which SIGKILLs it at random points).

Usage: ``python _runner_worker.py BUS_DSN STORE_DIR GROUP MAX_RECORDS``. The process owns the chDB
data path while it runs (chDB allows one process per path). It prints one line per
``process_once`` (``polled N``), and, once every assigned partition is read to its end and
nothing is held for event-time order, drains the pipeline, prints ``done`` and exits 0.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    dsn, store_dir, group, max_records = argv[0], argv[1], argv[2], int(argv[3])
    from prometheus_client import CollectorRegistry

    from fleethealth.detectors.runner import Runner
    from fleethealth.store import open_store

    with open_store(f"chdb://{store_dir}") as store:
        store.migrate()
        # short group timeouts: a restarted member gets the partitions within seconds of the killed
        # one's session expiring
        with Runner(dsn, store, group=group, max_records=max_records, registry=CollectorRegistry(),
                    session_timeout_s=2.0, max_poll_interval_s=2.0) as runner:
            print("started", flush=True)
            idle = 0
            while idle < 2:
                polled = runner.process_once(0.3)
                lag = runner.consumer.lag()
                at_end = bool(lag) and all(v == 0 for v in lag.values()) and len(runner.buffer) == 0
                idle = idle + 1 if polled == 0 and at_end else 0
                print(f"polled {polled}", flush=True)
            runner.drain()
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
