"""Broker faults end to end on a durable cluster (moto's S3 server, two Tansu brokers on one bucket):
the probe's delivery publishing, ``fleethealth detect`` in the staged form (two job replicas, one policy
replica, chDB stores), a broker SIGKILLed and restarted twice at random points mid-stream. The long
form (ten kills, then one broker lost for good) is ``bench/broker_faults.py``; the run is
``tests/broker_faults.py``.

A broker lost for good is not in the suite: the producers fail over to the other broker (0.1–0.2 s),
but a consumer whose group coordinator was the lost broker's address keeps retrying it (Tansu's
brokers share one node id, and kafka-python forgets its bootstrap list once it has metadata), so
whether the detectors carry on depends on which broker each happened to use — they did within 19 s
in two short runs and never in the ten-kill bench run. Until the consumer fails over as the producer
does, that case is the bench's.
"""

from __future__ import annotations

import json

import pytest

from tests.broker_faults import run

pytestmark = pytest.mark.slow


@pytest.mark.xfail(strict=False, reason=(
    "open defect: a broker SIGKILLed mid-stream sometimes loses a whole delivered chunk of one partition "
    "(steps 80-119 of one job in one run of two here, 50 steps in the ten-kill bench): records the probe's "
    "delivery had acknowledged are in no store and no rebalance was logged; cause not yet found (Tansu "
    "acknowledging before its S3 write, or two brokers' appends to one partition racing; moto does refuse a "
    "conditional PUT whose precondition fails)"))
def test_a_broker_killed_and_restarted_twice_mid_stream_loses_and_duplicates_nothing(cluster, tmp_path) -> None:
    report = run(cluster, tmp_path, steps=160, chunks=4, kills=2, log=print)
    print(json.dumps(report.as_dict()))
    assert (report.faults, report.restarts, report.brokers_lost) == (2, 2, 0)
    assert report.ok, report.problems
    assert report.rank_steps_stored == report.rank_steps_expected and report.rank_steps_duplicated == 0
    assert report.findings == 1
    assert report.recommendations_stored == report.recommendations_published >= 1
