"""``fleethealth detect`` starting while the durable cluster's brokers are down and restarting: it logs
that the broker is unreachable and retries with backoff (never exits with ``KafkaConnectionError``
while creating the topics), then joins its group and reads every record written before the outage
(the cluster keeps them in S3), each stored once."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from fleethealth.bus import Producer, ensure_topics
from fleethealth.schema import StepBatch
from fleethealth.store import open_store

pytestmark = pytest.mark.slow

STEPS, NODES, RANKS = 30, 2, 4


def test_detect_started_while_the_brokers_restart_waits_retries_and_reads_everything(cluster, tmp_path) -> None:
    ensure_topics(cluster.dsn, partitions=2)
    t0 = time.time() - 60
    with Producer(cluster.dsn, event_time_stamps=True) as producer:
        for k in range(STEPS):
            for n in range(NODES):
                producer.publish(StepBatch(job="startup", step=k, node=f"node-{n}", ts=t0 + k,
                                           ranks=np.arange(n * RANKS, (n + 1) * RANKS, dtype=np.int32),
                                           gpus=np.arange(RANKS, dtype=np.int16), compute_s=np.full(RANKS, 0.9)))
        producer.flush(30.0)
    store = f"chdb://{tmp_path}/store"
    with open_store(store) as opened:
        opened.migrate()
    for broker in cluster.brokers:  # every broker down: a restart of the whole cluster
        broker.kill()
    argv = [sys.executable, "-m", "fleethealth", "detect", "--kafka", cluster.dsn, "--store", store,
            "--group", "fh-startup", "--metrics-port", "0", "--until-caught-up"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETHEALTH_")}
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr or ()), daemon=True)
    reader.start()
    faults = len(cluster.brokers)
    try:
        deadline = time.monotonic() + 120
        while not any("unreachable" in line for line in lines):
            assert proc.poll() is None, "detect exited while the brokers were down: " + "".join(lines)[-2000:]
            assert time.monotonic() < deadline, "detect logged no retry within 120 s: " + "".join(lines)[-2000:]
            time.sleep(0.1)
        cluster.brokers[0].start()  # one broker back, killed again while detect connects, then both back
        time.sleep(0.3)
        cluster.brokers[0].kill()
        faults += 1
        for broker in cluster.brokers:
            broker.start()
        assert proc.wait(timeout=180) == 0, "".join(lines)[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(5)
    out = "".join(lines)
    assert "fleethealth detect: creating the topics: store or broker unreachable" in out, out[-2000:]
    assert f"caught up ({STEPS * NODES} records" in out, out[-2000:]
    with open_store(store) as opened:
        rows = opened.query("SELECT count(), uniqExact(step, rank) FROM rank_steps FINAL WHERE job = 'startup'").rows
    print(f"{faults} broker kills around detect's start-up; {rows[0][0]} of {STEPS * NODES * RANKS} rank-steps "
          "stored, each once")
    assert tuple(rows[0]) == (STEPS * NODES * RANKS, STEPS * NODES * RANKS)
