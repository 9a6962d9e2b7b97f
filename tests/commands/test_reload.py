"""SIGHUP reloads a running ``fleethealth detect``'s live keys at its next batch boundary: a real
process on the real broker and a chDB store. A straggler threshold lowered by a reload makes the job's
own detector (built before the reload, its baselines kept) find a rank it did not find before; an
invalid file is refused whole, the old value stays and the failure is counted; a changed restart-only
key is logged as ignored until restart."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable

import numpy as np

from fleethealth.broker import EmbeddedBroker, free_port
from fleethealth.bus import Producer

JOB = "reload-job"
RANKS = 16
SLOW = 5


def _publish(dsn: str, steps: range, rng: np.random.Generator) -> None:
    with Producer(dsn, event_time_stamps=True) as producer:
        for k in steps:
            t = 1.0 * (1.0 + 0.005 * rng.standard_normal(RANKS))
            t[SLOW] *= 1.10  # 10 % slower from its first step: a persistent straggler
            from fleethealth.schema import StepBatch

            producer.publish(StepBatch(job=JOB, step=k, node="gpu-a", ts=1000.0 + k,
                                       ranks=np.arange(RANKS, dtype=np.int32),
                                       gpus=np.arange(RANKS, dtype=np.int16), compute_s=t))
        producer.flush()


def _metric(port: int, name: str, labels: str = "") -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _until(what: str, ok: Callable[[], bool], proc: subprocess.Popen, lines: list[str], *, limit_s: float = 90) -> None:
    deadline = time.monotonic() + limit_s
    while not ok():
        assert proc.poll() is None, f"detect exited while waiting for {what}: " + "".join(lines)[-3000:]
        assert time.monotonic() < deadline, f"no {what} within {limit_s} s: " + "".join(lines)[-3000:]
        time.sleep(0.1)


def _config(path, kafka: str, store: str, port: int, body: str) -> None:
    path.write_text(f'kafka = "{kafka}"\nstore = "{store}"\n[detect]\ngroup = "fh-reload"\nmetrics_port = {port}\n'
                    f'[detect.pipeline]\ndiagnosis_wait_s = 1.0\n{body}')


def test_sighup_reloads_a_straggler_threshold_into_the_running_detector(tmp_path) -> None:
    # a broker of its own (the real embedded Tansu): the counts below are this job's alone
    with EmbeddedBroker() as broker:
        _run(broker, tmp_path)


def _run(broker: EmbeddedBroker, tmp_path) -> None:
    port = free_port()
    cfg = tmp_path / "fleethealth.toml"
    store = f"chdb://{tmp_path}/store"
    _config(cfg, broker.dsn, store, port, "[detect.straggler]\npersistent_min = 0.5\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETHEALTH_")}
    proc = subprocess.Popen([sys.executable, "-m", "fleethealth", "detect", "--config", str(cfg), "--migrate",
                             "--log-level", "info"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr or ()), daemon=True)
    reader.start()
    rng = np.random.default_rng(7)
    gauge = 'fleethealth_config_value', '{key="detect.straggler.persistent_min"}'
    try:
        _until("the group join", lambda: any("joined group 'fh-reload'" in x for x in lines), proc, lines)
        _publish(broker.dsn, range(0, 40), rng)
        _until("the first 30 steps processed",
               lambda: _metric(port, "fleethealth_detect_records_total", '{topic="fh.steps"}') >= 30, proc, lines)
        assert _metric(port, *gauge) == 0.5
        assert _metric(port, "fleethealth_detect_findings_total", '{kind="straggler"}') == 0  # 0.5: not found

        # an invalid file (a value out of range) is refused whole: the old value stays, the failure is counted
        _config(cfg, broker.dsn, store, port, "[detect.straggler]\npersistent_min = 0.03\nfalse_rate = 5.0\n")
        proc.send_signal(signal.SIGHUP)
        _until("the refusal counted", lambda: _metric(port, "fleethealth_config_reload_failures_total") == 1,
               proc, lines)
        assert _metric(port, *gauge) == 0.5
        assert any("config reload refused" in x and "false_rate" in x for x in lines), "".join(lines)[-3000:]

        # a valid file: the live key applies, the restart-only one is logged as ignored
        _config(cfg, broker.dsn, store, port, "[detect.straggler]\npersistent_min = 0.03\n"
                                              "[detect.runner]\nlateness_s = 1.0\n")
        proc.send_signal(signal.SIGHUP)
        _until("the reload applied", lambda: _metric(port, *gauge) == 0.03, proc, lines)
        log = "".join(lines)
        assert "config reload: detect.straggler.persistent_min 0.5 -> 0.03" in log, log[-3000:]
        assert "detect.runner.lateness_s changed (5.0 -> 1.0) but needs a restart" in log, log[-3000:]
        assert _metric(port, "fleethealth_config_reloads_total") == 1

        _publish(broker.dsn, range(40, 80), rng)
        _until("the straggler found under the new threshold",
               lambda: _metric(port, "fleethealth_detect_findings_total", '{kind="straggler"}') >= 1, proc, lines)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        reader.join(5)
