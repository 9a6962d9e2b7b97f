"""Broker faults end to end on the durable cluster, the long form: one JSON object.

Starts moto's S3 server and ``--brokers`` Tansu brokers on one bucket (``tests/cluster.py``), streams
two jobs' rank-steps (``--steps`` each, one rank 20 % slow from a third of the way) through the probe's
spool-backed delivery, runs ``fleethealth detect`` staged (two job replicas, one policy replica, chDB
stores) and SIGKILLs a broker ``--kills`` times at random points of the stream, each time starting it
again on its port; with ``--lose-broker`` one broker is then killed for good with two chunks of the
stream to come. The run is ``tests/broker_faults.run``; the suite's short forms are
``tests/probe/test_broker_kill.py`` (one kill in the broker's crash window, which lost acknowledged
records) and ``tests/fleethealth/test_bus_failover.py`` (a broker lost for good). Prints the faults
injected, records sent, acknowledged and read back after an acknowledgement without an offset,
rank-steps expected, stored, missing and duplicated (``FINAL``), the straggler finding against
one uninterrupted pipeline's, recommendations stored and published (and copies a fail-over published
twice), how soon the producer and the detectors resumed after the loss, and ``ok``.

    python bench/broker_faults.py                          # 10 kills and restarts, then a broker lost
    python bench/broker_faults.py --kills 3 --steps 300    # a quick run
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.broker_faults import run  # noqa: E402
from tests.cluster import DurableCluster  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=10, help="SIGKILLs of a broker, each followed by its restart")
    ap.add_argument("--steps", type=int, default=1200, help="steps of each of the two jobs")
    ap.add_argument("--chunks", type=int, default=0, help="chunks the stream is sent in (default: kills + 4)")
    ap.add_argument("--brokers", type=int, default=2)
    ap.add_argument("--lose-broker", action=argparse.BooleanOptionalAction, default=True,
                    help="then kill one broker for good (default: yes)")
    ap.add_argument("--seed", type=int, default=20261202)
    ap.add_argument("--keep", type=Path, default=None, help="keep the logs and stores in this folder")
    args = ap.parse_args()
    chunks = args.chunks or args.kills + 4
    root = args.keep or Path(tempfile.mkdtemp(prefix="fleethealth-broker-faults-"))
    root.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with DurableCluster(brokers=args.brokers, root=root / "cluster") as cluster:
        report = run(cluster, root, steps=args.steps, chunks=chunks, kills=args.kills, lose_broker=args.lose_broker,
                     seed=args.seed, log=lambda line: print(line, file=sys.stderr, flush=True))
    out = {"brokers": args.brokers, "steps": args.steps, "chunks": chunks, "seed": args.seed, **report.as_dict(),
           "total_s": round(time.monotonic() - started, 1), "root": str(root)}
    print(json.dumps(out, indent=1))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
