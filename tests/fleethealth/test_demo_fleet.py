"""The demo's fleet, publishing from a process of its own (:class:`fleethealth.demo_fleet.FleetPublisher`):
what it reports is what the topics hold, and a fleet that dies half-way is an error naming how far it got,
never a demo that waits for records that will not come. Real broker of the test's own, a small scenario."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from fleethealth.broker import EmbeddedBroker
from fleethealth.bus import ensure_topics
from fleethealth.bus.consumer import Consumer
from fleethealth.demo_fleet import FleetPublisher
from fleethealth.errors import BusUnavailable
from fleethealth.schema import Topic
from fleethealth.sim import Scenario

STEPS = 30


_SMALL = {"fleet": {"racks": 2, "nodes_per_rack": 2, "gpus_per_node": 4}, "job": {"steps": 100_000, "step_time_s": 1.0}}


def _scenario(steps: int = STEPS) -> Scenario:
    return Scenario.from_obj({**_SMALL, "job": {"steps": steps, "step_time_s": 1.0}})


@pytest.fixture
def broker():
    with EmbeddedBroker() as running:
        ensure_topics(running.dsn)
        yield running


def test_its_totals_are_the_records_on_the_topics(broker, tmp_path) -> None:
    fleet = FleetPublisher.start(_scenario(), broker.dsn, tmp_path / "spool")
    try:
        fleet.wait()
    finally:
        fleet.close()
    assert fleet.done and fleet.steps_done == fleet.steps_total == STEPS
    assert set(fleet.by_topic) == {Topic.TELEMETRY, Topic.STEPS, Topic.EVENTS}
    assert fleet.published == sum(fleet.by_topic.values()) and fleet.by_topic[Topic.TELEMETRY] >= 4 * STEPS
    read: Counter[str] = Counter()
    with Consumer(broker.dsn, [str(t) for t in fleet.by_topic], "test-demo-fleet") as consumer:
        deadline = time.monotonic() + 60.0
        while sum(read.values()) < fleet.published and time.monotonic() < deadline:
            read.update(rec.topic for rec in consumer.poll(0.5))
        time.sleep(1.0)  # nothing more than it reported
        read.update(rec.topic for rec in consumer.poll(0.5))
    assert read == {str(t): n for t, n in fleet.by_topic.items() if n}


def test_a_fleet_killed_half_way_is_an_error_naming_how_far_it_got(broker, tmp_path) -> None:
    fleet = FleetPublisher.start(_scenario(steps=100_000), broker.dsn, tmp_path / "spool")
    try:
        deadline = time.monotonic() + 60.0
        while fleet.steps_done < 5 and time.monotonic() < deadline:
            fleet.poll(0.5)
        assert fleet.steps_done >= 5, "the fleet published nothing in 60 s"
        os.kill(fleet.pid, signal.SIGKILL)
        with pytest.raises(BusUnavailable, match=r"ended \(exit code -9\) before it had published everything: "
                                                 r"\d+ of 100000 steps"):
            while True:
                fleet.poll(0.5)
    finally:
        fleet.close()


def test_the_fleet_dies_with_a_demo_killed_outright(broker, tmp_path) -> None:
    """A demo SIGKILLed gets no chance to end its fleet; Linux kills the fleet with it (PR_SET_PDEATHSIG)."""
    demo = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\n"
         "from pathlib import Path\n"
         "from fleethealth.demo_fleet import FleetPublisher\n"
         "from fleethealth.sim import Scenario\n"
         f"fleet = FleetPublisher.start(Scenario.from_obj({_SMALL!r}), {broker.dsn!r}, Path({str(tmp_path)!r}))\n"
         "print(fleet.pid, flush=True)\n"
         "time.sleep(120)\n"], stdout=subprocess.PIPE, text=True)
    try:
        assert demo.stdout is not None
        child = int(demo.stdout.readline())
        os.kill(child, 0)  # publishing
        demo.kill()
        demo.wait(10)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and _alive(child):
            time.sleep(0.1)
        assert not _alive(child), f"the fleet (pid {child}) still runs after its demo was SIGKILLed"
    finally:
        if demo.poll() is None:
            demo.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"  # a zombie waits for its (new) parent to reap it
    except (FileNotFoundError, IndexError):
        return False
