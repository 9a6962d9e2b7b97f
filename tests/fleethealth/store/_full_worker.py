"""Writes rank-steps into a chDB store on a small tmpfs that a filler file has filled, through the
detector runner's retry policy, as the runner writes them (one insert per batch, a deduplication
token each); the "operator" frees the space at the retry policy's third wait (no clock involved).
Run by test_store_faults.py inside a mount namespace of its own; prints one JSON line."""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from fleethealth.detectors.retry import Retry
from fleethealth.store import open_store
from fleethealth.store.translate import full_errors_total

BATCHES, ROWS, BEFORE_FULL = 12, 5_000, 3


def main(root: str) -> None:
    filler = os.path.join(root, "filler")
    errors: list[str] = []
    waits = [0]

    def sleep(_: float) -> None:  # the retry policy's wait: the third frees the volume
        waits[0] += 1
        if waits[0] == 3 and os.path.exists(filler):
            os.remove(filler)

    with open_store(f"chdb://{root}/store") as store:
        store.migrate()
        retry = Retry(attempts=3, backoff_s=0.0, log_every_s=0.0, sleep=sleep)
        for b in range(BATCHES):
            if b == BEFORE_FULL:
                _fill(filler)
            rank = np.arange(ROWS, dtype=np.uint32)
            cols = {"job": ["train-1"] * ROWS, "step": np.full(ROWS, b, dtype=np.uint64), "rank": rank,
                    "node": ["n1"] * ROWS, "gpu": (rank % 8).astype(np.uint16),
                    "ts": np.full(ROWS, 1.7e9 + b), "compute_s": 1.0 + rank / 1e6,
                    "rank_group": np.full(ROWS, -1, dtype=np.int32)}

            def write(cols=cols, b=b) -> int:
                try:
                    return store.insert("rank_steps", cols, dedup_token=f"batch-{b}")
                except Exception as exc:
                    errors.append(f"{type(exc).__name__}: {exc}")
                    raise

            retry.call(f"batch {b}", write)
        count, unique = store.query("SELECT count(), uniqExact(step, rank) FROM rank_steps").rows[0]
    print(json.dumps({"rows": int(count), "unique": int(unique), "expected": BATCHES * ROWS, "errors": errors,
                      "metric": full_errors_total(), "waits": waits[0], "freed": not os.path.exists(filler)}))


def _fill(path: str) -> None:
    """Fill the volume to its last block."""
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass


if __name__ == "__main__":
    main(sys.argv[1])
