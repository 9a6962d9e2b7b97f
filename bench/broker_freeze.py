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

``--process`` runs the real ``fleethealth probe --source sim --ensure-topics`` as a subprocess
instead (telemetry every ``1 / --rate-hz`` s) and measures on the consumer side: the time from
SIGCONT to the first sample arriving on ``fh.telemetry``, and repeated values there.
``--probe-pythonpath DIR`` runs that probe from another checkout (e.g. the previous release) to
compare against it in the same run.

    nice -n 10 python bench/broker_freeze.py                       # 150 s x 3, as the issue reported
    python bench/broker_freeze.py --freeze-s 20 --trials 2         # a quick run
    python bench/broker_freeze.py --process --probe-pythonpath ../baseline-checkout
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


def process_trial(freeze_s: float, rate_hz: float, before_s: float, after_s: float, work: Path,
                  pythonpath: str | None) -> dict[str, object]:
    import subprocess

    import kafka

    broker = EmbeddedBroker().start()
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    arrivals: list[tuple[float, bytes]] = []
    stop = threading.Event()
    probe = None
    try:
        ensure_topics(broker.dsn, partitions=1)

        def consume() -> None:
            consumer = kafka.KafkaConsumer(Topic.TELEMETRY.value, bootstrap_servers=broker.bootstrap, group_id=None,
                                           auto_offset_reset="earliest", enable_auto_commit=False,
                                           request_timeout_ms=305_000, reconnect_backoff_max_ms=500)
            # the reader's own fetch waits the freeze out on its connection, so it sees the thaw at once
            try:
                while not stop.is_set():
                    for recs in consumer.poll(timeout_ms=200).values():
                        arrivals.extend((time.monotonic(), r.value) for r in recs)
            finally:
                consumer.close()

        reader = threading.Thread(target=consume, daemon=True)
        reader.start()
        probe = subprocess.Popen(
            [sys.executable, "-m", "fleethealth", "probe", "--source", "sim", "--kafka", broker.dsn,
             "--node", "n0000", "--interval", str(1.0 / rate_hz), "--no-socket", "--no-nic", "--metrics-port", "0",
             "--spool-dir", str(work / "spool"), "--ensure-topics", "--log-level", "warning"],
            env=env, cwd=work, stdout=subprocess.DEVNULL,  # cwd: the checkout named by PYTHONPATH must win
            stderr=open(work / "probe.log", "wb"))  # noqa: SIM115
        deadline = time.monotonic() + 60
        while not arrivals and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(before_s)
        os.kill(broker.pid, signal.SIGSTOP)
        time.sleep(freeze_s)
        os.kill(broker.pid, signal.SIGCONT)
        thawed = time.monotonic()
        time.sleep(after_s)
        probe.send_signal(signal.SIGINT)
        probe.wait(timeout=60)
        time.sleep(2.0)
        stop.set()
        reader.join(timeout=10)
        after = [t - thawed for t, _ in arrivals if t >= thawed]
        values = [v for _, v in arrivals]
        return {"freeze_s": freeze_s, "first_after_thaw_s": round(after[0], 2) if after else None,
                "records": len(values), "unique": len(set(values)), "duplicates": len(values) - len(set(values)),
                "probe_exit": probe.returncode}
    finally:
        stop.set()
        if probe is not None and probe.poll() is None:
            probe.kill()
        if broker.running:
            os.kill(broker.pid, signal.SIGCONT)
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
    parser.add_argument("--process", action="store_true", help="run the real `fleethealth probe` process")
    parser.add_argument("--probe-pythonpath", metavar="DIR", help="with --process: run the probe from this checkout")
    args = parser.parse_args(argv)
    trials = []
    for i in range(args.trials):
        with tempfile.TemporaryDirectory(prefix="fh-freeze-") as work:
            if args.process:
                trials.append(process_trial(args.freeze_s, args.rate_hz, args.before_s, args.after_s, Path(work),
                                            args.probe_pythonpath))
            else:
                trials.append(trial(args.freeze_s, args.rate_hz, args.before_s, args.after_s, Path(work),
                                    ensure=args.ensure_topics))
        print(json.dumps({"trial": i, **trials[-1]}), file=sys.stderr, flush=True)
    firsts = [t["first_after_thaw_s"] for t in trials]
    print(json.dumps({"freeze_s": args.freeze_s, "process": args.process, "probe_pythonpath": args.probe_pythonpath,
                      "trials": trials,
                      "recovered": sum(f is not None for f in firsts),
                      "max_first_after_thaw_s": max((f for f in firsts if f is not None), default=None),
                      "duplicates_total": sum(t["duplicates"] for t in trials)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
