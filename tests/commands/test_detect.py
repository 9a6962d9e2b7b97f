"""``build_runner`` hands the config's detector and policy keys to the parts it wires, on a real
broker and a real chDB store; with no settings the runner is the one ``Runner`` builds itself."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from fleethealth.commands import build_parser
from fleethealth.commands._settings import load_settings
from fleethealth.commands.detect import build_runner
from fleethealth.detectors.runner import Runner


def _settings(*sets: str):
    argv = ["detect"]
    for item in sets:
        argv += ["--set", item]
    return load_settings(build_parser().parse_args(argv))


def test_settings_reach_the_detectors_the_policy_and_the_runner(broker, store) -> None:
    settings = _settings("policy.fleet_nodes=2048", "policy.breaker_share=0.05", "detect.straggler.clip=5",
                         "detect.hang.window=64", "detect.diagnosis.thermal_limit_c=80",
                         "detect.features.recent_s=600", "policy.paging.rate_factor=4", "detect.runner.lateness_s=2",
                         "detect.pipeline.diagnosis_wait_s=3", "detect.group=fh-test-config")
    with build_runner(broker.dsn, store, settings, registry=CollectorRegistry()) as runner:
        p, engine = runner.pipeline, runner.policy.engine
        assert engine.breaker_.fleet_nodes == 2048 and engine.breaker_.share == 0.05
        assert p.straggler().clip == 5.0 and p.hang.window == 64
        assert p.diagnoser.thresholds.thermal_limit_c == 80.0
        assert p.predictor.features.recent_s == 600.0 and runner.policy.pager.rate_factor == 4.0
        assert runner.lateness_s == 2.0 and p.diagnosis_wait_s == 3.0


def test_defaults_build_the_same_parts_as_the_runner_alone(broker, store) -> None:
    with build_runner(broker.dsn, store, _settings(), registry=CollectorRegistry()) as ours, \
            Runner(broker.dsn, store, registry=CollectorRegistry()) as plain:
        a, b = ours.pipeline, plain.pipeline
        pa, pb = ours.policy.engine, plain.policy.engine
        assert vars(a.straggler()) == vars(b.straggler()) and vars(a.hang) == vars(b.hang)
        assert a.diagnoser.thresholds == b.diagnoser.thresholds and vars(a.health) == vars(b.health)
        assert pa.breaker_.fleet_nodes == pb.breaker_.fleet_nodes == 0
        assert (pa.restart_s, pa.stale_after_s) == (pb.restart_s, pb.stale_after_s)
        assert (ours.lateness_s, ours.max_records) == (plain.lateness_s, plain.max_records)


def test_until_caught_up_logs_the_join_and_start_offsets_then_exits_once_read_to_the_end(tmp_path) -> None:
    """``fleethealth detect --until-caught-up`` on a broker of its own: it logs the group it joins and
    the offset it starts each partition at, reads everything, concludes what it holds, commits and
    exits 0; a second run in the same group starts where the first ended and reads nothing again."""
    import os
    import subprocess
    import sys

    import numpy as np

    from fleethealth.broker import EmbeddedBroker
    from fleethealth.bus import Producer, ensure_topics
    from fleethealth.schema import StepBatch, Telemetry
    from fleethealth.store import open_store

    with EmbeddedBroker() as running:
        ensure_topics(running.dsn, partitions=4)
        with Producer(running.dsn, event_time_stamps=True) as producer:
            for k in range(20):
                for i, node in enumerate(("n0000", "n0001")):
                    producer.publish(Telemetry.from_columns(node, "r00", 1000.0 + 2 * k, [0, 1], temp_c=[50.0, 50.0]))
                    producer.publish(StepBatch(job="batch", step=k, node=node, ts=1000.0 + 2 * k,
                                               ranks=np.array([2 * i, 2 * i + 1], dtype=np.int32),
                                               gpus=np.array([0, 1], dtype=np.int16), compute_s=np.array([1.9, 1.9])))
            producer.flush()
        store = f"chdb://{tmp_path}/store"
        argv = [sys.executable, "-m", "fleethealth", "detect", "--kafka", running.dsn, "--store", store,
                "--group", "fh-batch", "--metrics-port", "0", "--until-caught-up", "--migrate"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETHEALTH_")}
        first = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
        assert first.returncode == 0, first.stderr
        assert "joined group 'fh-batch'; reading from fh.events/0@0" in first.stderr
        assert "fh.steps/" in first.stderr and "caught up (80 records" in first.stderr
        second = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
        assert second.returncode == 0, second.stderr
        assert "caught up (0 records" in second.stderr
    with open_store(store) as s:
        assert s.query("SELECT count() FROM rank_steps FINAL WHERE job = 'batch'").rows[0][0] == 80


def test_a_broker_that_comes_up_after_detect_started_is_waited_for_with_a_log_line(tmp_path) -> None:
    """``fleethealth detect`` started against an address where no broker answers yet (one restarting):
    it logs that the broker is unreachable and retries with backoff instead of exiting; once the broker
    is up on that address it creates the topics, joins its group and runs (here: to the end of the
    empty topics, exit 0)."""
    import os
    import subprocess
    import sys
    import threading
    import time

    from fleethealth.broker import EmbeddedBroker, free_port

    port = free_port()
    argv = [sys.executable, "-m", "fleethealth", "detect", "--kafka", f"kafka://127.0.0.1:{port}", "--store",
            f"chdb://{tmp_path}/store", "--group", "fh-late", "--metrics-port", "0", "--until-caught-up",
            "--migrate"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETHEALTH_")}
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr or ()), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not any("unreachable" in line for line in lines):
            assert proc.poll() is None, "detect exited while the broker was down: " + "".join(lines)[-2000:]
            assert time.monotonic() < deadline, "detect logged no retry within 120 s: " + "".join(lines)[-2000:]
            time.sleep(0.1)
        with EmbeddedBroker(port=port):
            assert proc.wait(timeout=120) == 0, "".join(lines)[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(5)
    out = "".join(lines)
    assert "fleethealth detect: creating the topics: store or broker unreachable" in out, out[-2000:]
    assert "joined group 'fh-late'" in out and "caught up (0 records" in out, out[-2000:]
