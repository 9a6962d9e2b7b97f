"""A detector runner in a process of its own, for the crash test (which SIGKILLs it at random points).

Usage: ``python _runner_worker.py BUS_DSN STORE_DIR GROUP MAX_RECORDS [POINT:N]``. The process owns the chDB
data path while it runs (chDB allows one process per path). It prints one line per
``process_once`` (``polled N``), and, once every assigned partition is read to its end and
nothing is held for event-time order, drains the pipeline, prints ``done`` and exits 0.

``$FH_STORE_EVERY_S`` (default 0) is the runner's ``store_every_s``: sample rows held over polls for one insert.

With ``POINT:N`` it SIGKILLs itself right after the N-th call of one step of the write/publish path
(:data:`KILL_POINTS`), so a test can stop it between any write and the next write or publish.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

KILL_POINTS = ("findings", "recommendations", "outbox_pending", "policy_state", "publish", "flush",
               "outbox_published")
"""Where a worker may kill itself: after storing findings, recommendations, pending outbox rows or the
policy state; after queueing one message or after the broker acknowledged them all; after marking
the outbox published."""


def _arm(runner: Any, point: str, after: int) -> None:
    """Make ``runner`` SIGKILL its own process right after the ``after``-th call at ``point``."""
    calls = 0

    def hit() -> None:
        nonlocal calls
        calls += 1
        if calls >= after:
            print(f"killed at {point}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def wrap(obj: Any, name: str, when: Any = None) -> None:
        real = getattr(obj, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            out = real(*args, **kwargs)
            if when is None or when(args, kwargs):
                hit()
            return out
        setattr(obj, name, wrapped)

    store, producer = runner.store, runner.producer
    from fleethealth.schema import Action

    # a kill after storing recommendations falls where one asks for an action: the replay of the restarted
    # runner (its detectors empty) need not decide it again, so only the outbox can still publish it
    targets = {"findings": (store, "insert_findings", None),
               "recommendations": (store, "insert_recommendations",
                                   lambda args, _: any(r.action is not Action.NONE for r in args[0])),
               "outbox_pending": (store, "write_outbox", lambda _, kw: not kw["published"]),
               "outbox_published": (store, "write_outbox", lambda _, kw: kw["published"]),
               "policy_state": (store, "write_policy_state", None),
               "publish": (producer, "publish_raw", None),
               "flush": (producer, "flush", None)}
    wrap(*targets[point])


def main(argv: list[str]) -> int:
    dsn, store_dir, group, max_records = argv[0], argv[1], argv[2], int(argv[3])
    kill = argv[4].split(":") if len(argv) > 4 else None
    from prometheus_client import CollectorRegistry

    from fleethealth.detectors.runner import Runner
    from fleethealth.store import open_store

    with open_store(f"chdb://{store_dir}") as store:
        store.migrate()
        # short group timeouts: a restarted member gets the partitions within seconds of the killed
        # one's session expiring
        with Runner(dsn, store, group=group, max_records=max_records, registry=CollectorRegistry(),
                    session_timeout_s=2.0, max_poll_interval_s=2.0,
                    store_every_s=float(os.environ.get("FH_STORE_EVERY_S", "0"))) as runner:
            if kill is not None:
                _arm(runner, kill[0], int(kill[1]))
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
