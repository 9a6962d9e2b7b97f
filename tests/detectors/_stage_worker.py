"""One replica of a detector stage in a process of its own, for the stage crash test (which SIGKILLs it).

Usage: ``python _stage_worker.py BUS_DSN STORE_DIR GROUP STAGE SNAPSHOT_EVERY_S FINISH_FILE [POINT:N]``.
The process owns its chDB data path while it runs (chDB allows one process per path; in a fleet the
replicas share a ClickHouse server). It processes until FINISH_FILE exists, what it holds is read to its
end and the group has committed every partition to the end FINISH_FILE names, then concludes what it
holds, prints ``done`` and exits 0.

FINISH_FILE holds the log end of every partition (JSON, ``{"topic/partition": offset}``), which the test
reads from a fetch's high watermark: Tansu 0.6 answers a ListOffsets request for the latest offset with
the last record batch's base offset plus one, short of the end when that batch holds several records,
so a check against it would find the group done while a partition's last records are unread.

On SIGTERM it stops reading and leaves the group (the runner's close sends LeaveGroup), prints ``left``
and exits 0 without concluding what it holds: the test's last rescue of a group the coordinator left
with partitions unowned.

With ``POINT:N`` it SIGKILLs itself right after the N-th call of one step of the write path
(:data:`KILL_POINTS`): after a write of step rows, after an offset commit, after a snapshot save, after
a restore's seek.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

KILL_POINTS = ("steps", "commit", "snapshot", "seek")
"""Where a worker may kill itself: after storing step rows (not committed yet), after committing offsets
(not snapshotted yet), after saving a snapshot, after moving back to a restored snapshot's offsets (a
partition taken over, nothing of it read or committed here yet)."""


def _arm(runner: Any, point: str, after: int) -> None:
    """Make this process SIGKILL itself right after the ``after``-th call at ``point``."""
    from fleethealth.bus import SnapshotTopic

    calls = 0

    def hit() -> None:
        nonlocal calls
        calls += 1
        if calls >= after:
            print(f"killed at {point}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def wrap(obj: Any, name: str, did: Any) -> None:
        real = getattr(obj, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            before = runner.consumer.committed()
            out = real(*args, **kwargs)
            if did(args, before):
                hit()
            return out
        setattr(obj, name, wrapped)

    targets = {"steps": (runner.store, "insert_steps", lambda args, _: len(args[0]) > 0),
               "commit": (runner.consumer, "commit", lambda _, before: runner.consumer.committed() != before),
               "snapshot": (SnapshotTopic, "save_snapshot", lambda *_: True),
               "seek": (runner.consumer, "seek", lambda args, _: bool(args[0]))}
    wrap(*targets[point])


class _Offsets:
    """The group's committed offsets: a consumer of the group that never subscribes (so never joins it)."""

    def __init__(self, dsn: str, group: str) -> None:
        from kafka import KafkaConsumer

        self.kc = KafkaConsumer(bootstrap_servers=dsn.split("://", 1)[1], group_id=group, enable_auto_commit=False)
        self.admin: Any = None

    def done(self, ends: dict[str, int]) -> bool:
        """Whether the group has committed every partition to its end."""
        from kafka import TopicPartition

        for name, end in ends.items():
            topic, partition = name.rsplit("/", 1)
            if end and (self.kc.committed(TopicPartition(topic, int(partition))) or 0) < end:
                return False
        return True


def _members(runner: Any, offsets: _Offsets) -> str:
    """This member's id and generation beside the coordinator's list of members (Tansu's DescribeGroups
    names them, not their assignments): a member the coordinator no longer lists, or a member it lists
    that is gone, shows here."""
    from kafka.admin import KafkaAdminClient

    me = runner.consumer._kc._coordinator._generation
    try:
        if offsets.admin is None:
            offsets.admin = KafkaAdminClient(bootstrap_servers=offsets.kc.config["bootstrap_servers"])
            offsets.admin._process_acl_operations = lambda obj: obj  # Tansu's authorized_operations do not parse
        group = offsets.admin.describe_groups([runner.consumer.group])[runner.consumer.group]
        coordinator = f"{group['group_state']} {sorted(m['member_id'][-6:] for m in group['members'])}"
    except Exception as exc:  # noqa: BLE001 — a diagnostic line only
        coordinator = f"describe failed: {exc!r}"
    return f"me={me.member_id[-6:]}@{me.generation_id} coordinator={coordinator}"


def _status(runner: Any, offsets: _Offsets, ends: dict[str, int] | None) -> str:
    """One line of where this replica stands: what it holds, how far behind it is, what the group has
    committed against the ends (printed while it waits, so a replica that never finishes says why)."""
    from kafka import TopicPartition

    group = {}
    for name in sorted(ends or {}):
        topic, partition = name.rsplit("/", 1)
        group[name] = offsets.kc.committed(TopicPartition(topic, int(partition)))
    still = sorted(runner.core.open_steps())
    return (f"waiting: {_members(runner, offsets)} assigned={sorted(runner.consumer.assignment())} "
            f"positions={runner.consumer.positions()} "
            f"lag={runner.consumer.lag()} table_lag={None if runner.table is None else runner.table.lag()} "
            f"held={sorted(runner.core.held())} buffered={len(runner.buffer)} "
            f"open_steps={len(still)} {still[:2]}..{still[-1:]} ends={ends} group={group}")


def main(argv: list[str]) -> int:
    dsn, store_dir, group, stage, every, finish = argv[0], argv[1], argv[2], argv[3], float(argv[4]), Path(argv[5])
    kill = argv[6].split(":") if len(argv) > 6 else None
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks a replica that hangs where it is
    handler = logging.StreamHandler(sys.stdout)  # warnings, and where each restore began reading ("log: ...")
    handler.setFormatter(logging.Formatter("log: %(asctime)s %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    logging.getLogger("fleethealth.detectors.runner").setLevel(logging.INFO)
    from prometheus_client import CollectorRegistry

    from fleethealth.detectors.runner import Runner
    from fleethealth.detectors.snapshot import Snapshots
    from fleethealth.store import open_store

    leave = threading.Event()  # SIGTERM: leave the group in order (the test's last rescue), concluding nothing
    signal.signal(signal.SIGTERM, lambda *_: leave.set())
    with open_store(f"chdb://{store_dir}") as store:
        store.migrate()
        with Runner(dsn, store, group=group, stage=stage, registry=CollectorRegistry(), snapshot_every_s=every,
                    snapshot_to="bus", session_timeout_s=3.0, max_poll_interval_s=6.0, max_ahead_s=None,
                    max_behind_s=None, publish=False,
                    snapshots=Snapshots(key=b"stage-crash-test-snapshot-key-0123")) as runner:
            if kill is not None:
                _arm(runner, kill[0], int(kill[1]))
            print("started", flush=True)
            idle, restored = 0, 0
            offsets = _Offsets(dsn, group)
            told = time.monotonic()
            member = None
            while idle < 3 and not leave.is_set():
                polled = runner.process_once(0.3)
                if runner.consumer._kc._coordinator._generation.member_id != member:  # a hang prints every id held
                    member = runner.consumer._kc._coordinator._generation.member_id
                    print(f"member {member}", flush=True)
                if polled:
                    print(f"polled {polled}", flush=True)
                if runner.restored_total != restored:
                    restored = runner.restored_total
                    print(f"restored {restored}", flush=True)
                # done: what it holds is read to its end (or it holds nothing), and the group has committed
                # every partition to its end — so no replica leaves partitions unread to one that left
                ends = json.loads(finish.read_text()) if finish.exists() else None
                mine = runner.caught_up(polled) or not runner.consumer.assignment()
                idle = idle + 1 if ends is not None and mine and offsets.done(ends) else 0
                if ends is not None and time.monotonic() - told > 10.0:
                    print(_status(runner, offsets, ends), flush=True)
                    told = time.monotonic()
            if leave.is_set():  # closing the runner sends LeaveGroup: the coordinator starts a new generation
                print("left", flush=True)
                return 0
            runner.drain()
            print(f"done restored={runner.restored_total} snapshots={runner.snapshots_total}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
