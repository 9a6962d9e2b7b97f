"""A normal end ends: a job that completed is not reopened by its ranks' last step batches, whatever
order they and rank 0's ``job_exit`` arrive in — no hang, no interruption, no page — while its nodes
live on (their telemetry goes on, which is what lets a level job look hung)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import pytest

from fleethealth.detectors.pipeline import Pipeline
from fleethealth.detectors.runner import conclude
from fleethealth.payloads.job import job_exit_event, job_start_event
from fleethealth.policy.stage import PolicyStage
from fleethealth.schema import Action, Event, EventKind, FindingKind, Message, StepBatch, Telemetry

T0 = 1_767_225_600.0
STEP_S = 1.0
LAST = 40
NODES = tuple(f"dc1-rack7-host{k:02d}" for k in range(4))


def _batch(node: int, step: int, ts: float) -> StepBatch:
    ranks = np.array([2 * node, 2 * node + 1], dtype=np.int32)
    return StepBatch(job="j", step=step, node=NODES[node], ts=ts, ranks=ranks, gpus=(ranks % 2).astype(np.int16),
                     compute_s=np.full(2, 0.8))


def _run(rng: random.Random, *, exit_last_step: int | None = LAST) -> tuple[list[Message], list[Message], float]:
    """The body (start, steps 0..LAST-1 of every node, telemetry), and the tail: each node's step LAST stamped
    up to 0.6 s around rank 0's completed exit (clocks of different nodes), in event-time order."""
    body: list[Message] = [job_start_event(ts=T0 - 5.0, world=8, node=NODES[0], job="j", rank=0)]
    for k in range(LAST):
        body += [_batch(n, k, T0 + STEP_S * k + 0.01 * n) for n in range(len(NODES))]
    end = T0 + STEP_S * LAST
    exit_ts = end + rng.uniform(0.0, 0.3) if exit_last_step is not None else end + 0.7  # (unknown: after them)
    tail: list[Message] = [_batch(n, LAST, end + rng.uniform(0.0, 0.6)) for n in range(len(NODES))]
    tail.append(job_exit_event(ts=exit_ts, status="completed", last_step=exit_last_step, node=NODES[0], job="j",
                               rank=0))
    body += [Telemetry.from_columns(NODES[n], "rack7", T0 + t, [0, 1]) for t in range(0, LAST, 5)
             for n in range(len(NODES))]
    return sorted(body, key=lambda m: m.ts), tail, end


def _after(end: float) -> list[Message]:
    """Ten minutes of the nodes living on after the job ended (past any step timeout and stack grace)."""
    return [Telemetry.from_columns(NODES[n], "rack7", end + t, [0, 1]) for t in range(1, 600, 5)
            for n in range(len(NODES))]


def _feeds(body: list[Message], tail: Sequence[Message], after: list[Message], rng: random.Random, *,
           exit_last: bool = False) -> list[list[Message]]:
    """The tail in an arrival order with batch boundaries anywhere: each feed is what a runner releases at once
    (in event-time order), so a record can arrive in a later feed than records stamped after it. With
    ``exit_last`` the exit arrives after every step: an exit without ``last_step`` is bounded by the steps
    seen before it, so it must come (and be stamped) after them."""
    order = list(tail)
    rng.shuffle(order)
    if exit_last:
        order.sort(key=lambda m: isinstance(m, Event))
    feeds = [body[:len(body) // 2], body[len(body) // 2:]]
    cut = sorted(rng.sample(range(1, len(order)), rng.randint(0, len(order) - 1)))
    for lo, hi in zip([0, *cut], [*cut, len(order)], strict=True):
        feeds.append(sorted(order[lo:hi], key=lambda m: m.ts))
    feeds += [after[i:i + 40] for i in range(0, len(after), 40)]
    return feeds


def _through(feeds: list[list[Message]]) -> tuple[list, list[Event], list, Pipeline]:
    pipe, policy = Pipeline(), PolicyStage()
    findings, events, recs = [], [], []
    for i, feed in enumerate(feeds):
        out = conclude(pipe, policy, feed, final=i == len(feeds) - 1)
        findings += out.findings
        events += out.events
        recs += out.recommendations
    return findings, events, recs, pipe


@pytest.mark.parametrize(("exit_last_step", "orders"), [(LAST, 12), (None, 4)])
def test_every_arrival_order_of_the_last_steps_and_the_exit_ends_the_job(exit_last_step: int | None,
                                                                        orders: int) -> None:
    done = 0
    for seed in range(orders):
        rng = random.Random(seed)
        body, tail, end = _run(rng, exit_last_step=exit_last_step)
        feeds = _feeds(body, tail, _after(end), rng, exit_last=exit_last_step is None)
        findings, events, recs, pipe = _through(feeds)
        done += 1
        hangs = [f for f in findings if f.kind is FindingKind.HANG]
        assert hangs == [], (seed, [(f.step, f.evidence.get("level")) for f in hangs])
        assert [e for e in events if e.kind is EventKind.INTERRUPTION] == [], seed
        assert [r for r in recs if r.action is Action.PAGE] == [], seed
        assert pipe.lifecycle.jobs_["j"].exit == "completed", seed  # ended, not reopened by a late step
    assert done == orders


def test_the_exit_first_then_late_steps_across_batch_boundaries() -> None:
    """The order of the incident: rank 0's exit, then each node's last step in a batch of its own, every one
    stamped after the exit; then the nodes live on. Counted as late steps of the ended run."""
    rng = random.Random(7)
    body, tail, end = _run(rng)
    exit_ev = next(m for m in tail if isinstance(m, Event))
    steps = [m for m in tail if not isinstance(m, Event)]
    steps = [StepBatch(job=b.job, step=b.step, node=b.node, ts=exit_ev.ts + 0.05 * (i + 1), ranks=b.ranks,
                       gpus=b.gpus, compute_s=b.compute_s) for i, b in enumerate(steps)]
    feeds = [body, [exit_ev], *([b] for b in steps), *(_after(end)[i:i + 40] for i in range(0, 480, 40))]
    findings, events, recs, pipe = _through(feeds)
    assert [f for f in findings if f.kind is FindingKind.HANG] == []
    assert events == [] and [r for r in recs if r.action is Action.PAGE] == []
    assert pipe.lifecycle.late_after_exit_total_ == 4 and pipe.hang.late_after_exit_total_ == 4


def test_a_step_past_the_exit_is_a_new_run_and_a_restart_after_a_failed_exit_is_still_seen() -> None:
    """What the rule leaves alone: a completed job that trains on past its exit's last step is running
    again; a failed run restarted without a start record from an earlier step, well after the exit, restarts."""
    rng = random.Random(3)
    body, tail, end = _run(rng)
    exit_ev = next(m for m in tail if isinstance(m, Event))
    pipe = Pipeline()
    conclude(pipe, None, [*body, *sorted(tail, key=lambda m: m.ts)])
    conclude(pipe, None, [_batch(n, LAST + 1, exit_ev.ts + 30.0) for n in range(len(NODES))])
    assert pipe.lifecycle.jobs_["j"].exit is None and pipe.lifecycle.jobs_["j"].top == LAST + 1
    # a failed exit, then the same job's steps from step 30 two minutes later: a restart, one interruption
    body, _, end = _run(rng)
    failed = job_exit_event(ts=end + 0.2, status="failed", last_step=LAST - 1, reason="NCCL error", node=NODES[0],
                            job="j", rank=0)
    again = [_batch(n, k, end + 120.0 + STEP_S * (k - 30)) for k in range(30, LAST + 2) for n in range(len(NODES))]
    pipe = Pipeline()
    conclude(pipe, None, [*body, failed])
    out = conclude(pipe, None, sorted(again, key=lambda m: m.ts))
    (ev,) = [e for e in out.events if e.kind is EventKind.INTERRUPTION]
    assert (ev.data["restarted_by"], ev.data["first_step"], ev.data["lost_steps"]) == ("batch_after_exit", 30, 10)


def test_through_the_broker_and_fleethealth_detect_on_chdb(broker, tmp_path) -> None:
    """The incident's order on the real path: rank 0's completed exit, then every node's last step stamped
    after it, then ten minutes of telemetry; ``fleethealth detect --until-caught-up`` stores no hang, no
    interruption and no page."""
    import os
    import subprocess
    import sys

    from fleethealth.bus import Producer, ensure_topics
    from fleethealth.store import open_store

    body, tail, end = _run(random.Random(11))
    exit_ev = next(m for m in tail if isinstance(m, Event))
    late = [StepBatch(job=b.job, step=b.step, node=b.node, ts=exit_ev.ts + 0.1 * (i + 1), ranks=b.ranks,
                      gpus=b.gpus, compute_s=b.compute_s) for i, b in enumerate(m for m in tail if m is not exit_ev)]
    ensure_topics(broker.dsn, partitions=2)
    with Producer(broker.dsn, event_time_stamps=True) as producer:
        for m in (*body, exit_ev, *late, *_after(end)):
            producer.publish(m)
        producer.flush()
    store = f"chdb://{tmp_path}/store"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETHEALTH_")}
    run = subprocess.run([sys.executable, "-m", "fleethealth", "detect", "--kafka", broker.dsn, "--store", store,
                          "--group", "fh-job-end", "--metrics-port", "0", "--until-caught-up", "--migrate"],
                         capture_output=True, text=True, timeout=180, env=env)
    assert run.returncode == 0, run.stderr
    with open_store(store) as s:
        assert s.query("SELECT count() FROM rank_steps FINAL WHERE job = 'j'").rows[0][0] == 8 * (LAST + 1)
        assert s.query("SELECT kind, count() FROM findings FINAL WHERE kind = 'hang' GROUP BY kind").rows == []
        assert s.query("SELECT count() FROM events FINAL WHERE kind = 'interruption'").rows[0][0] == 0
        assert s.query("SELECT count() FROM recommendations FINAL WHERE action = 'page'").rows[0][0] == 0
        assert s.query("SELECT count() FROM events FINAL WHERE kind = 'job_exit'").rows[0][0] == 1


def test_one_step_timeout_rule_for_the_hang_detector_and_the_lifecycle() -> None:
    """The hang window and the lifecycle's were 512 and 64: now one rule, set by the detect.hang keys."""
    from fleethealth.commands import build_parser
    from fleethealth.commands._settings import load_settings
    from fleethealth.detectors.hang import HangDetector, StepTimeout
    from fleethealth.detectors.lifecycle import LifecycleTracker
    from fleethealth.errors import ConfigError

    pipe = Pipeline()
    assert pipe.lifecycle.step_timeout == pipe.hang.step_timeout() == StepTimeout(3.0, 0.99, 30.0, 512)
    pipe = Pipeline(hang=HangDetector(window=64, min_timeout_s=10.0))
    assert pipe.lifecycle.step_timeout == StepTimeout(3.0, 0.99, 10.0, 64)
    conclude(pipe, None, [_batch(0, k, T0 + 9.0 * k) for k in range(80)])
    assert pipe.lifecycle._timeout("j") == pipe.hang.timeout_s("j") == pytest.approx(27.0)
    assert pipe.lifecycle.jobs_["j"].durations.maxlen == 64
    with pytest.raises(ConfigError, match="one step timeout"):
        Pipeline(hang=HangDetector(window=64), lifecycle=LifecycleTracker(step_timeout=StepTimeout(window=32)))
    keys = load_settings(build_parser().parse_args(["detect"])).schema.keys
    assert "detect.hang.window" in keys and not [k for k in keys if k.startswith("detect.lifecycle.timeout")]
