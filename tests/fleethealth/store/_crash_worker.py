"""The store's owner for test_store_faults.py and bench/store_crash.py: writes rank-step batches
into a chDB store as the detector runner does — insert with a deduplication token, then "commit"
(the batch number, fsynced to a file, standing for the Kafka offset) — and resumes after the last
commit when started again. ``KILL`` (``during:B`` or ``after:B``) makes it SIGKILL itself while
batch B's insert runs (from a second thread, released as the insert starts) or between B's insert
and its commit. Prints the batches it wrote."""

from __future__ import annotations

import os
import signal
import sys
import threading

import numpy as np

from fleethealth.store import open_store

ROWS = 2_000


def batch(b: int) -> dict[str, object]:
    rank = np.arange(ROWS, dtype=np.uint32)
    return {"job": ["train-1"] * ROWS, "step": np.full(ROWS, b, dtype=np.uint64), "rank": rank,
            "node": [f"n{r // 8}" for r in range(ROWS)], "gpu": (rank % 8).astype(np.uint16),
            "ts": np.full(ROWS, 1.7e9 + b), "compute_s": 1.0 + (rank * 7 + b) % 1000 / 1e4,
            "rank_group": np.full(ROWS, -1, dtype=np.int32)}


def main(dsn: str, commits: str, batches: int, kill: str) -> None:
    how, _, at = kill.partition(":")
    kill_at = int(at) if at else -1
    start = int(open(commits).read()) + 1 if os.path.exists(commits) else 0
    go = threading.Event()
    threading.Thread(target=lambda: (go.wait(), os.kill(os.getpid(), signal.SIGKILL)), daemon=True).start()
    with open_store(dsn) as store:
        for b in range(start, batches):
            if how == "during" and b == kill_at:
                go.set()  # the killer runs while this insert does
            store.insert("rank_steps", batch(b), dedup_token=f"steps-{b}")
            if how == "after" and b == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            with open(commits + ".tmp", "w") as f:
                f.write(str(b))
                f.flush()
                os.fsync(f.fileno())
            os.replace(commits + ".tmp", commits)
    print(f"wrote {start}..{batches - 1}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else "")
