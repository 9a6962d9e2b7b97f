"""One replica of a detector stage for ``bench/scaleout.py``: join the group, read until every assigned
partition is read to its end (and, for the job stage, the node-state table too), conclude, exit.

    python bench/_scaleout_worker.py DSN STAGE GROUP STORE_DIR OUT_JSON REPLICAS PARTITIONS [STORE_EVERY_S]

Before it reads, a replica waits until the group has split the partitions between every replica of the
run (its share at most ``ceil(PARTITIONS / REPLICAS)`` of each of the stage's two group topics) and the
assignment held still for 3 s: a replica that started late would otherwise join mid-run, and the
rebalance would make the others read again from the commit what they had read (counted as CPU spent).

Writes ``{"records", "cpu_s", "first_s", "end_s"}`` to OUT_JSON: the records this replica read, its
process CPU seconds from joining the group to the end, and the wall-clock times (``time.time()``) of
its first record and of its end; a job replica also the records it read of its tables, the node states
it decoded (those of its jobs' nodes and their rack peers) and those it passed over.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from fleethealth.detectors.runner import Runner, tune_gc
from fleethealth.store import open_store


def main() -> None:
    dsn, stage, group, store_dir, out, replicas, partitions = sys.argv[1:8]
    store_every_s = float(sys.argv[8]) if len(sys.argv) > 8 else 0.0
    share = 2 * math.ceil(int(partitions) / int(replicas))  # two group topics per stage
    tune_gc()
    with open_store(f"chdb://{store_dir}") as store:
        store.migrate()
        with Runner(dsn, store, group=group, stage=stage, publish=stage == "node", registry=CollectorRegistry(),
                    max_ahead_s=None, max_behind_s=None, max_poll_interval_s=30.0, session_timeout_s=10.0,
                    store_every_s=store_every_s) as runner:
            runner.consumer.wait_assigned(timeout_s=120.0)
            # every replica of the run joins before the group settles: wait until the assignment holds still
            settled, seen = time.monotonic(), runner.consumer.assignment()
            deadline = time.monotonic() + 180.0
            while (time.monotonic() - settled < 3.0 or len(seen) > share) and int(replicas) > 1 \
                    and time.monotonic() < deadline:
                runner.consumer.wait_assigned(timeout_s=5.0)  # drives the group protocol; records are kept
                now = runner.consumer.assignment()
                if now != seen:
                    settled, seen = time.monotonic(), now
                time.sleep(0.2)
            cpu0 = time.process_time()
            first = None
            while True:
                got = runner.process_once(0.5)
                if got and first is None:
                    first = time.time()
                if runner.caught_up(got) or not runner.consumer.assignment():
                    break
            runner.drain()
            report = {"records": runner.consumer.consumed_total, "cpu_s": time.process_time() - cpu0,
                      "first_s": first if first is not None else time.time(), "end_s": time.time()}
            if runner.table is not None and runner.nodes is not None:  # the job stage's fh.nodestate
                report["table_records"] = runner.table.consumed_total + runner.table.passed_over_total
                report["node_states_decoded"] = runner.nodes.decoded_total_ + runner.table.consumed_total
                report["node_states_passed_over"] = runner.nodes.passed_over_total_
    Path(out).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
