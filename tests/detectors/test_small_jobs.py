"""A job with fewer comparable ranks than ``detect.straggler.min_group`` is not scored for stragglers, and
says so: counted by the detector, listed by the pipeline, logged once and counted by the runner (on the real
broker and chDB), and noted in the job's report."""

from __future__ import annotations

import logging
import time
import uuid

import numpy as np
from prometheus_client import CollectorRegistry

from fleethealth.bus import Producer, ensure_topics
from fleethealth.detectors.pipeline import Pipeline
from fleethealth.detectors.runner import Runner
from fleethealth.detectors.straggler import StragglerDetector
from fleethealth.schema import StepBatch

T0 = 1_767_225_600.0


def _steps(job: str, nodes: int, steps: int, slow_rank: int | None = None) -> list[StepBatch]:
    out = []
    rng = np.random.default_rng(0)
    for k in range(steps):
        for n in range(nodes):
            ranks = np.array([2 * n, 2 * n + 1], dtype=np.int32)
            t = 1.0 + 0.01 * rng.standard_normal(2)
            if slow_rank is not None and k >= steps // 2:
                t[ranks == slow_rank] *= 1.5
            out.append(StepBatch(job=job, step=k, node=f"host-{job}-{n}", ts=T0 + 2.0 * k, ranks=ranks,
                                 gpus=np.array([0, 1], dtype=np.int16), compute_s=t))
    return out


def test_a_small_job_is_counted_as_not_scored_and_a_large_one_is_scored() -> None:
    small = StragglerDetector()
    for k in range(50):
        assert small.check(k, np.arange(4), np.full(4, 1.0)) == []
    assert (small.unscored_small_total_, small.unscored_group_) == (200, 4)
    grouped = StragglerDetector()  # two pipeline stages of 8 and 3 ranks: only the small stage is left out
    grouped.check(0, np.arange(11), np.ones(11), np.array([0] * 8 + [1] * 3))
    assert (grouped.unscored_small_total_, grouped.unscored_group_) == (3, 3)
    large = StragglerDetector()
    large.check_many(list(range(20)), np.arange(8), np.ones((20, 8)))
    assert large.unscored_small_total_ == 0 and large.scored_steps_ == 20
    large.check(20, np.arange(7), np.ones(7))  # one rank missing from a step: left out, the job is not small
    assert large.unscored_small_total_ == 7 and large.scored_steps_ == 20
    pipe = Pipeline()
    pipe.feed(_steps("tiny", 2, 30, slow_rank=1) + _steps("big", 4, 30))
    assert pipe.unscored_jobs_ == {"tiny": 4}


def test_the_runner_logs_and_counts_it_and_the_report_notes_it(broker, store, caplog) -> None:
    from fleethealth.report.data import load

    ensure_topics(broker.dsn, partitions=1)
    msgs = _steps("tiny", 2, 40, slow_rank=1) + _steps("big", 4, 40)
    with Producer(broker.dsn, event_time_stamps=True) as producer:
        for m in sorted(msgs, key=lambda m: m.ts):
            producer.publish(m)
        producer.flush()
    registry = CollectorRegistry()
    with caplog.at_level(logging.WARNING, logger="fleethealth.detectors.runner"), \
            Runner(broker.dsn, store, group=f"small-{uuid.uuid4().hex[:8]}", publish=False, registry=registry,
                   session_timeout_s=2.0, max_poll_interval_s=30.0, max_ahead_s=None, max_behind_s=None) as runner:
        deadline = time.monotonic() + 60
        while runner.consumer.consumed_total < len(msgs):
            if time.monotonic() > deadline:
                raise AssertionError(f"read {runner.consumer.consumed_total} of {len(msgs)} records in 60 s")
            runner.process_once(0.5)
        runner.drain()
    said = [r.getMessage() for r in caplog.records if "not scored for stragglers" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("job tiny is not scored for stragglers: 4 comparable rank(s)")
    assert registry.get_sample_value("fleethealth_detect_unscored_jobs") == 1.0
    assert load(store, "tiny").extra["unscored"].startswith("Not scored for stragglers: this job has 4 rank(s)")
    assert "unscored" not in load(store, "big").extra
    try:
        from fleethealth.report import render, require_extra

        require_extra()
    except Exception as exc:  # noqa: BLE001 - the page needs the report extra
        print(f"the rendered page is not checked: {exc}")
        return
    page = render(store, "tiny")
    assert 'id="unscored"' in page and "Not scored for stragglers" in page
    assert 'id="unscored"' not in render(store, "big")
