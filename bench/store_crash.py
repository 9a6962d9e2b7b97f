"""The store's owner SIGKILLed ten times during its inserts and restarted on the same chDB path: no
row missing, none twice (the long form of tests/fleethealth/store/test_store_faults.py).

The owner is tests/fleethealth/store/_crash_worker.py: rank-step batches inserted as the detector
runner inserts them (a deduplication token each), each followed by a commit (the batch number,
fsynced, standing for the Kafka offset). Kills alternate between "during" (a second thread SIGKILLs
the process as a batch's insert starts) and "after" (between the insert and its commit, so the
restart writes the batch again). The baseline, measured in the same run, is one uninterrupted
owner writing the same batches to a store of its own.

Prints one JSON object: kills, expected / stored / unique rows and the sum of compute_s, for the
killed store and the baseline, and the wall time of each.

    python bench/store_crash.py --kills 10 --batches 60
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fleethealth.store import open_store

WORKER = Path(__file__).resolve().parents[1] / "tests" / "fleethealth" / "store" / "_crash_worker.py"


def _owner(dsn: str, commits: Path, batches: int, kill: str = "") -> int:
    return subprocess.run([sys.executable, str(WORKER), dsn, str(commits), str(batches), kill],
                          capture_output=True, text=True, timeout=600).returncode


def _fresh(path: Path) -> str:
    dsn = f"chdb://{path}"
    with open_store(dsn) as store:
        store.migrate()
    return dsn


def _count(dsn: str) -> dict[str, float]:
    """Raw rows (no FINAL: a row written twice shows), distinct (step, rank) and the sum of compute_s."""
    with open_store(dsn) as store:
        steps = store.steps("train-1")
        rows = store.table_rows("rank_steps")
    keys = {(b.step, int(r)) for b in steps for r in b.ranks}
    return {"rows": rows, "unique": len(keys), "sum_compute_s": round(sum(float(b.compute_s.sum()) for b in steps), 6)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--batches", type=int, default=60)
    ap.add_argument("--seed", type=int, default=29)
    args = ap.parse_args()
    if args.batches < 2 * args.kills:
        raise SystemExit("--batches must be at least twice --kills")
    work = Path(tempfile.mkdtemp(prefix="fh-store-crash-"))
    rng = random.Random(args.seed)
    at = sorted(rng.sample(range(1, args.batches - 1), args.kills))
    plan = [f"{'during' if k % 2 == 0 else 'after'}:{b}" for k, b in enumerate(at)]

    base = _fresh(work / "baseline")
    t = time.perf_counter()
    if _owner(base, work / "baseline.commit", args.batches) != 0:
        raise SystemExit("the baseline owner failed")
    baseline_s = time.perf_counter() - t

    killed = _fresh(work / "killed")
    kills = 0
    t = time.perf_counter()
    for kill in plan:
        code = _owner(killed, work / "killed.commit", args.batches, kill)
        if code != -signal.SIGKILL:
            raise SystemExit(f"the owner was meant to die at {kill}, exit {code}")
        kills += 1
    if _owner(killed, work / "killed.commit", args.batches) != 0:
        raise SystemExit("the last owner failed")
    killed_s = time.perf_counter() - t
    sys.path.insert(0, str(WORKER.parent))
    from _crash_worker import ROWS

    got, clean = _count(killed), _count(base)
    expected = args.batches * ROWS
    print(json.dumps({"kills": kills, "plan": plan, "expected_rows": expected, "killed": got, "baseline": clean,
                      "lost": expected - got["unique"], "doubled": got["rows"] - got["unique"],
                      "same_as_baseline": got == clean, "killed_wall_s": round(killed_s, 1),
                      "baseline_wall_s": round(baseline_s, 1)}, indent=1))


if __name__ == "__main__":
    main()
