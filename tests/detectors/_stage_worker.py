"""One replica of a detector stage in a process of its own, for the stage crash test (which SIGKILLs it).

Usage: ``python _stage_worker.py BUS_DSN STORE_DIR GROUP STAGE SNAPSHOT_EVERY_S FINISH_FILE [last]``. The process
owns its chDB data path while it runs (chDB allows one process per path; in a fleet the replicas
share a ClickHouse server). It processes until FINISH_FILE exists and every partition assigned to it
is read to its end, then concludes what it holds, prints ``done`` and exits 0.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    dsn, store_dir, group, stage, every, finish = argv[0], argv[1], argv[2], argv[3], float(argv[4]), Path(argv[5])
    last = len(argv) > 6 and argv[6] == "last"
    from prometheus_client import CollectorRegistry

    from fleethealth.detectors.runner import Runner
    from fleethealth.store import open_store

    with open_store(f"chdb://{store_dir}") as store:
        store.migrate()
        with Runner(dsn, store, group=group, stage=stage, registry=CollectorRegistry(), snapshot_every_s=every,
                    snapshot_to="bus", session_timeout_s=3.0, max_poll_interval_s=6.0, max_ahead_s=None,
                    max_behind_s=None, publish=False) as runner:
            print("started", flush=True)
            idle, restored, shown = 0, 0, time.monotonic()
            while idle < 3:
                polled = runner.process_once(0.3)
                if polled:
                    print(f"polled {polled}", flush=True)
                if runner.restored_total != restored:
                    restored = runner.restored_total
                    print(f"restored {restored}", flush=True)
                # done: every partition it holds read to its end; one that holds none at the end may go
                # too unless it is the last (``last``): it has all the partitions then, and reads them out
                caught_up = runner.caught_up(polled) or (not last and not runner.consumer.assignment())
                idle = idle + 1 if finish.exists() and caught_up else 0
                if last and not caught_up and time.monotonic() - shown > 2.0:  # why it is not done yet
                    shown = time.monotonic()
                    lag = {**runner.consumer.lag(), **(runner.table.lag() if runner.table is not None else {})}
                    print(f"waiting: lag {sorted(lag.items())} held {len(runner.buffer)}", flush=True)
            runner.drain()
            print(f"done restored={runner.restored_total} snapshots={runner.snapshots_total}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
