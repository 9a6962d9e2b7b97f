"""Broker kills, the minimal form: numbered records through a Tansu-on-S3 broker that is SIGKILLed and
restarted, compared three ways. One JSON object.

A producer (kafka-python, idempotent, ``acks=all``, as :class:`fleethealth.bus.Producer`) writes records
numbered 0, 1, ... to a 2-partition topic of the durable cluster (``tests/cluster.py``) and notes each one
the broker acknowledged; a consumer group reads and commits after each poll; a broker is SIGKILLed and
started again ``--kills`` times at random points. Afterwards a fresh reader reads every partition from
its start. Printed: kills, sent, acknowledged, served (after the restarts), committed, consumed, and the
numbers acknowledged but not served (``lost``), served twice (``duplicated``), and whether the group's
commit passed records it never received (``committed_past_unread``).

    python bench/broker_kill_repro.py --kills 5
    python bench/broker_kill_repro.py --kills 5 --brokers 1
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.cluster import DurableCluster  # noqa: E402

TOPIC = "repro"
PARTITIONS = 2
INSPECT = ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--brokers", type=int, default=2)
    ap.add_argument("--rate", type=float, default=400.0, help="records per second")
    ap.add_argument("--seconds", type=float, default=0.0, help="length of the stream (default: 3 s per kill + 4)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--consume", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--inspect", default="", help="write the bucket's keys to this file")
    args = ap.parse_args()
    global INSPECT
    INSPECT = args.inspect
    seconds = args.seconds or 3.0 * args.kills + 4.0
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="fleethealth-kill-repro-"))
    with DurableCluster(brokers=args.brokers, root=root) as cluster:
        out = run(cluster, kills=args.kills, rate=args.rate, seconds=seconds, rng=rng, consume=args.consume)
    out.update(brokers=args.brokers, seed=args.seed, root=str(root))
    print(json.dumps(out))
    return 0 if not out["lost"] else 1


def run(cluster: DurableCluster, *, kills: int, rate: float, seconds: float, rng: random.Random,
        consume: bool) -> dict:
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition
    from kafka.admin import KafkaAdminClient, NewTopic

    hosts = [b.bootstrap for b in cluster.brokers]
    admin = KafkaAdminClient(bootstrap_servers=hosts)
    admin.create_topics([NewTopic(TOPIC, PARTITIONS, 1)])
    admin.close()
    acked: dict[int, tuple[int, int]] = {}
    failed: Counter[str] = Counter()
    lock = threading.Lock()
    stop = threading.Event()
    sent = [0]

    def produce() -> None:
        kp = KafkaProducer(bootstrap_servers=hosts, acks="all", enable_idempotence=True, linger_ms=5,
                           request_timeout_ms=2000, delivery_timeout_ms=2**31 - 1, max_block_ms=2000,
                           reconnect_backoff_max_ms=500)
        n = 0
        t0 = time.monotonic()
        while not stop.is_set():
            due = int((time.monotonic() - t0) * rate)
            while n < due:
                def ok(meta, n=n):
                    with lock:
                        acked[n] = (meta.partition, meta.offset)

                def bad(exc, n=n):
                    with lock:
                        failed[type(exc).__name__] += 1

                try:
                    kp.send(TOPIC, value=str(n).encode(), partition=n % PARTITIONS).add_callback(ok).add_errback(bad)
                except Exception as exc:  # noqa: BLE001 — counted
                    failed[f"send:{type(exc).__name__}"] += 1
                    break
                n += 1
                sent[0] = n
            time.sleep(0.01)
        kp.flush(timeout=60)
        kp.close(timeout=5)

    consumed: list[int] = []
    commits: dict[int, int] = {}

    def consume_() -> None:
        kc = KafkaConsumer(TOPIC, bootstrap_servers=hosts, group_id="repro", enable_auto_commit=False,
                           auto_offset_reset="earliest", session_timeout_ms=6000, fetch_max_wait_ms=100,
                           request_timeout_ms=11000)
        idle = 0
        while idle < 30 or not stop.is_set():
            try:
                batches = kc.poll(timeout_ms=200)
                got = [(tp, r) for tp, rs in batches.items() for r in rs]
                consumed.extend(int(r.value) for _, r in got)
                if got:
                    idle = 0
                    offsets = {tp: kc.position(tp) for tp in batches}
                    kc.commit()
                    commits.update({tp.partition: off for tp, off in offsets.items()})
                elif stop.is_set():
                    idle += 1
            except Exception as exc:  # noqa: BLE001 — a broker fault: poll again
                failed[f"consumer:{type(exc).__name__}"] += 1
                time.sleep(0.2)
        kc.close(autocommit=False)

    threads = [threading.Thread(target=produce, daemon=True)]
    if consume:
        threads.append(threading.Thread(target=consume_, daemon=True))
    for t in threads:
        t.start()
    began = time.monotonic()
    injected = 0
    times = sorted(rng.uniform(1.0, seconds - 2.0) for _ in range(kills))
    for at in times:
        time.sleep(max(0.0, began + at - time.monotonic()))
        victim = rng.randrange(len(cluster.brokers))
        cluster.brokers[victim].kill()
        injected += 1
        time.sleep(rng.uniform(0.2, 1.0))
        cluster.brokers[victim].start()
    time.sleep(max(0.0, began + seconds - time.monotonic()))
    stop.set()
    for t in threads:
        t.join(120)
    # what the cluster serves now, read from each partition's start
    reader = KafkaConsumer(bootstrap_servers=hosts, group_id=None, enable_auto_commit=False,
                           auto_offset_reset="earliest", fetch_max_wait_ms=100)
    tps = [TopicPartition(TOPIC, p) for p in range(PARTITIONS)]
    reader.assign(tps)
    for tp in tps:
        reader.seek(tp, 0)
    served: list[tuple[int, int, int]] = []
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        got = reader.poll(timeout_ms=200)
        if not got and all(reader.highwater(tp) is not None and reader.position(tp) >= reader.highwater(tp)
                           for tp in tps):
            break
        served += [(r.partition, r.offset, int(r.value)) for rs in got.values() for r in rs]
    ends = {tp.partition: reader.highwater(tp) for tp in tps}
    stuck = {tp.partition: reader.position(tp) for tp in tps}
    if INSPECT:
        import logging
        logging.basicConfig(level=logging.DEBUG, filename=INSPECT + ".log")
        for tp in tps:
            reader.seek(tp, stuck[tp.partition])
        for _ in range(3):
            got = reader.poll(timeout_ms=500)
            print("debug poll", {tp.partition: [r.offset for r in rs][:5] for tp, rs in got.items()}, file=sys.stderr)
        logging.getLogger().setLevel(logging.WARNING)
    reader.close()
    if INSPECT:
        import boto3

        s3 = boto3.client("s3", endpoint_url=cluster.s3.endpoint, region_name="us-east-1",
                          aws_access_key_id="x", aws_secret_access_key="x")
        paginator = s3.get_paginator("list_objects_v2")
        keys = [o["Key"] for page in paginator.paginate(Bucket=cluster.s3.bucket) for o in page.get("Contents", [])]
        Path(INSPECT).write_text("\n".join(keys))
    values = Counter(v for _, _, v in served)
    lost = sorted(set(acked) - set(values))
    gaps = {}
    for p in range(PARTITIONS):
        offs = sorted(o for q, o, _ in served if q == p)
        holes = [(a, b) for a, b in zip(offs, offs[1:], strict=False) if b != a + 1]
        gaps[p] = holes[:10]
    lost_where = [(n, acked[n]) for n in lost[:20]]
    committed_past_unread = consume and bool(set(values) - set(consumed)) and any(
        off >= ends.get(p, 0) for p, off in commits.items())
    return {"kills": injected, "sent": sent[0], "acknowledged": len(acked), "served": len(values),
            "consumed": len(set(consumed)), "committed": commits, "log_ends": ends,
            "lost": len(lost), "lost_first": lost_where, "duplicated": sum(n - 1 for n in values.values() if n > 1),
            "lost_acknowledged_without_offset": sum(1 for n in lost if acked[n][1] < 0),
            "acknowledged_without_offset": sum(1 for p, o in acked.values() if o < 0),
            "unacknowledged_served": len(set(values) - set(acked)), "offset_gaps": gaps,
            "consumed_not_served": len(set(consumed) - set(values)),
            "committed_past_unread": committed_past_unread, "reader_stopped_at": stuck, "failures": dict(failed)}


if __name__ == "__main__":
    sys.exit(main())
