"""One replica of a detector stage in a process of its own, for the stage crash test (which SIGKILLs it).

Usage: ``python _stage_worker.py BUS_DSN STORE_DIR GROUP STAGE SNAPSHOT_EVERY_S FINISH_FILE``. The process
owns its chDB data path while it runs (chDB allows one process per path; in a fleet the replicas
share a ClickHouse server). It processes until FINISH_FILE exists, what it holds is read to its end and
the group has committed every partition of its topics to the end, then concludes what it holds,
prints ``done`` and exits 0.
"""

from __future__ import annotations

import sys
from pathlib import Path


class _Admin:
    """The group's committed offsets against the topics' ends: a consumer of the group that never
    subscribes (so never joins it) only fetches offsets."""

    def __init__(self, dsn: str, group: str) -> None:
        from kafka import KafkaConsumer

        self.kc = KafkaConsumer(bootstrap_servers=dsn.split("://", 1)[1], group_id=group, enable_auto_commit=False)


def _group_done(admin: _Admin, group: str) -> bool:
    from kafka import TopicPartition

    kc = admin.kc
    parts = [TopicPartition(t, p) for t in ("fh.steps", "fh.events") for p in kc.partitions_for_topic(t) or ()]
    ends = kc.end_offsets(parts)
    return all(end == 0 or (kc.committed(tp) or 0) >= end for tp, end in ends.items())


def main(argv: list[str]) -> int:
    dsn, store_dir, group, stage, every, finish = argv[0], argv[1], argv[2], argv[3], float(argv[4]), Path(argv[5])
    from prometheus_client import CollectorRegistry

    from fleethealth.detectors.runner import Runner
    from fleethealth.detectors.snapshot import Snapshots
    from fleethealth.store import open_store

    with open_store(f"chdb://{store_dir}") as store:
        store.migrate()
        with Runner(dsn, store, group=group, stage=stage, registry=CollectorRegistry(), snapshot_every_s=every,
                    snapshot_to="bus", session_timeout_s=3.0, max_poll_interval_s=6.0, max_ahead_s=None,
                    max_behind_s=None, publish=False,
                    snapshots=Snapshots(key=b"stage-crash-test-snapshot-key-0123")) as runner:
            print("started", flush=True)
            idle, restored = 0, 0
            admin = _Admin(dsn, group)
            while idle < 3:
                polled = runner.process_once(0.3)
                if polled:
                    print(f"polled {polled}", flush=True)
                if runner.restored_total != restored:
                    restored = runner.restored_total
                    print(f"restored {restored}", flush=True)
                # done: what it holds is read to its end (or it holds nothing), and the group has committed
                # every partition to its end — so no replica leaves partitions unread to one that left
                mine = runner.caught_up(polled) or not runner.consumer.assignment()
                idle = idle + 1 if finish.exists() and mine and _group_done(admin, group) else 0
            runner.drain()
            print(f"done restored={runner.restored_total} snapshots={runner.snapshots_total}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
