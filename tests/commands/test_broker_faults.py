"""Broker faults end to end on a durable cluster (moto's S3 server, two Tansu brokers on one bucket):
the probe's delivery publishing, ``fleethealth detect`` in the staged form (two job replicas, one policy
replica, chDB stores), a broker SIGKILLed and restarted twice at random points mid-stream, then one of
the two lost for good. The long form (ten kills, a longer stream) is ``bench/broker_faults.py``; the
run is ``tests/broker_faults.py``."""

from __future__ import annotations

import json

import pytest

from tests.broker_faults import run

pytestmark = pytest.mark.slow

RESUME_S = 60.0
"""How soon the producer and the detectors must carry on through the surviving broker (measured
here on 2 loaded cores: the producer 0.1–0.2 s, the detectors 0.9–19 s, a rebalance or two)."""


def test_brokers_killed_and_restarted_then_one_lost_for_good_lose_and_duplicate_nothing(cluster, tmp_path) -> None:
    report = run(cluster, tmp_path, steps=160, chunks=4, kills=2, lose_broker=True, log=print)
    print(json.dumps(report.as_dict()))
    assert (report.faults, report.restarts, report.brokers_lost) == (3, 2, 1)
    assert report.ok, report.problems
    assert report.rank_steps_stored == report.rank_steps_expected and report.findings == 1
    assert report.recommendations_stored == report.recommendations_published >= 1
    assert report.producer_resumed_s is not None and report.producer_resumed_s < RESUME_S, report
    assert report.detectors_resumed_s is not None and report.detectors_resumed_s < RESUME_S, report
