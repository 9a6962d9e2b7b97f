"""The probe's delivery across a frozen broker: recovery time and duplicates per trial (one JSON object).

Each trial starts its own embedded Tansu broker, runs the probe's real delivery path (spool on
disk, :class:`fleethealth.probe.delivery.Delivery` and its producer) with a steady stream of
records, freezes the broker with SIGSTOP for ``--freeze-s`` seconds, thaws it with SIGCONT and
measures:

- ``first_after_thaw_s``: from SIGCONT to the first record acknowledged after it;
- ``drained_after_thaw_s``: from SIGCONT to an empty spool (the backlog replayed);
- ``records`` / ``unique`` / ``duplicates``: what is on the topic at the end, read back raw.

A frozen broker is the nasty outage: its TCP sockets stay open and the kernel still accepts
connections, so nothing fails fast — every request just waits.

    nice -n 10 python bench/broker_freeze.py                       # 150 s x 3, as the issue reported
    python bench/broker_freeze.py --freeze-s 20 --trials 2         # a quick run
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from fleethealth import schema
from fleethealth.broker import EmbeddedBroker
from fleethealth.bus import ensure_topics
from fleethealth.probe.delivery import Delivery
from fleethealth.probe.spool import Spool
from fleethealth.schema import Event, EventKind, Topic


def _read_all(dsn: str, topic: str, expected: int, timeout_s: float = 60.0) -> list[bytes]:
    import kafka

    consumer = kafka.KafkaConsumer(topic, bootstrap_servers=dsn.removeprefix("kafka://"), group_id=None,
                                   auto_offset_reset="earliest", enable_auto_commit=False,
                                   consumer_timeout_ms=2000)
    values: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            batch = consumer.poll(timeout_ms=1000)
            got = [r.value for recs in batch.values() for r in recs]
            values += got
            if not got and len(values) >= expected:
                break
    finally:
        consumer.close()
    return values


def trial(freeze_s: float, rate_hz: float, before_s: float, after_s: float, work: Path, *,
          ensure: bool = False) -> dict[str, object]:
    broker = EmbeddedBroker().start()
    stop = threading.Event()
    submitted = 0
    try:
        ensure_topics(broker.dsn, partitions=1, topics=[Topic.EVENTS.value])
        delivery = Delivery(broker.dsn, Spool(work / "spool"), on_connect=ensure_topics if ensure else None)
        delivery.start()

        def produce() -> None:
            nonlocal submitted
            t0 = time.time()
            while not stop.is_set():
                delivery.submit(Event(node="n0000", ts=time.time(), kind=EventKind.PROBE_ERROR,
                                      message=f"seq {submitted}", data={"seq": submitted, "t0": t0}))
                submitted += 1
                stop.wait(1.0 / rate_hz)

        feeder = threading.Thread(target=produce, daemon=True)
        feeder.start()
        time.sleep(before_s)
        os.kill(broker.pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        time.sleep(freeze_s)
        frozen_s = time.monotonic() - frozen_at
        spooled_at_thaw = len(delivery.spool)
        delivered_at_thaw = delivery.stats.delivered_total
        os.kill(broker.pid, signal.SIGCONT)
        thawed = time.monotonic()
        first = drained = None
        deadline = thawed + after_s
        while time.monotonic() < deadline:
            now = time.monotonic()
            if first is None and delivery.stats.delivered_total > delivered_at_thaw:
                first = now - thawed
            if drained is None and first is not None and len(delivery.spool) <= 2:
                drained = now - thawed
                break
            time.sleep(0.05)
        stop.set()
        feeder.join()
        delivery.close(drain_timeout_s=30.0)
        values = _read_all(broker.dsn, Topic.EVENTS.value, submitted)
        seqs = [schema.decode(Event, v).data["seq"] for v in values]
        return {"freeze_s": round(frozen_s, 1),
                "spooled_at_thaw": spooled_at_thaw,
                "first_after_thaw_s": None if first is None else round(first, 2),
                "drained_after_thaw_s": None if drained is None else round(drained, 2),
                "submitted": submitted, "records": len(seqs), "unique": len(set(seqs)),
                "duplicates": len(seqs) - len(set(seqs)), "missing": submitted - len(set(seqs)),
                "failures": delivery.stats.failures_total, "last_error": delivery.stats.last_error}
    finally:
        stop.set()
        os.kill(broker.pid, signal.SIGCONT) if broker.running else None
        broker.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--freeze-s", type=float, default=150.0)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--rate-hz", type=float, default=10.0, help="records submitted per second")
    parser.add_argument("--before-s", type=float, default=3.0, help="steady delivery before the freeze")
    parser.add_argument("--after-s", type=float, default=120.0, help="how long to wait for recovery")
    parser.add_argument("--ensure-topics", action="store_true",
                        help="create the topics after every (re)connect, as `fleethealth probe --ensure-topics`")
    args = parser.parse_args(argv)
    trials = []
    for i in range(args.trials):
        with tempfile.TemporaryDirectory(prefix="fh-freeze-") as work:
            trials.append(trial(args.freeze_s, args.rate_hz, args.before_s, args.after_s, Path(work),
                                ensure=args.ensure_topics))
        print(json.dumps({"trial": i, **trials[-1]}), file=sys.stderr, flush=True)
    firsts = [t["first_after_thaw_s"] for t in trials]
    print(json.dumps({"freeze_s": args.freeze_s, "trials": trials,
                      "recovered": sum(f is not None for f in firsts),
                      "max_first_after_thaw_s": max((f for f in firsts if f is not None), default=None),
                      "duplicates_total": sum(t["duplicates"] for t in trials)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
