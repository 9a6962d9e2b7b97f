"""The node stage columnar gives exactly what it gives one sample at a time.

The reference is the per-sample path, kept here: each telemetry value decoded alone
(``Telemetry.from_obj``), each sample's state derived alone (:func:`~fleethealth.detectors.nodestate.node_state`,
:func:`~fleethealth.detectors.nodestate.changed`) and the health rules applied to one sample at a time
(``HealthRules._telemetry``), fed the same polls. The columnar path is the runner's: a poll's values decoded at
once (``decode_many``), node states derived wave by wave over stacked columns, the rules' thresholds checked in
one pass. Both must give the same findings, node states and detector state, on the default and multi-job
scenarios (faults brought forward so they fire within a few simulated minutes) and on the independent-physics
thermal fleet (:mod:`tests.detectors.thermal_fleet`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml

from fleethealth import schema
from fleethealth.detectors.pipeline import Pipeline
from fleethealth.detectors.stages import Stage, takes_event
from fleethealth.schema import Event, Message, Telemetry
from fleethealth.sim.fleet import FleetSim
from fleethealth.sim.scenario import Scenario
from tests.detectors.thermal_fleet import Change, ThermalFleet

SCENARIOS = Path(__file__).resolve().parents[2] / "fleethealth" / "scenarios"
_STEP_KEYS = ("start_step", "end_step", "fail_step", "step")


def _early(name: str, factor: int, steps: int) -> Scenario:
    """The scenario with its node faults' steps divided by ``factor`` and its jobs cut to ``steps``."""
    obj = yaml.safe_load((SCENARIOS / f"{name}.yaml").read_text())
    # the SDC checks are the job side's (their replays run every hundreds of steps): not the node stage's
    obj["faults"] = [f for f in obj.get("faults", []) if not f["kind"].startswith("sdc")]
    for fault in obj["faults"]:
        for key in _STEP_KEYS:
            if key in fault:
                fault[key] = max(1, int(fault[key]) // factor)
    if "job" in obj:
        obj["job"]["steps"] = steps
    for job in obj.get("jobs", []):
        job["steps"] = min(int(job["steps"]), steps)
    return Scenario.from_obj(obj, name=name)


def _node_inputs(scenario: Scenario, seconds: float) -> Iterator[bytes | Event]:
    """The node stage's inputs over the first ``seconds`` of event time: telemetry as encoded values, the
    node events as they are."""
    for st in FleetSim(scenario).run():
        if st.ts > scenario.start_ts + seconds:
            return
        msgs: list[Message] = [*st.telemetry, *st.events]
        for m in sorted(msgs, key=lambda m: m.ts):
            if isinstance(m, Telemetry):
                yield schema.encode(m)
            elif isinstance(m, Event) and takes_event(Stage.NODE, m):
                yield m


def _physics_inputs() -> Iterator[bytes]:
    fleet = ThermalFleet(racks=3, nodes_per_rack=3, gpus=4, every_s=6.0, seed=11)
    r0, r1, r2 = fleet.rack_names  # the thermal models learn from 300 s on: residuals known by the faults
    fleet.timeline += [Change(0.0, busy={r0: True, r1: True}), Change(200.0, busy={r2: True}),
                       Change(520.0, cooling={(fleet.nodes[1], 1): 2.4}), Change(600.0, cap_w=450.0),
                       Change(680.0, aisle={r1: 15.0}), Change(760.0, busy={r0: False})]
    for s in fleet.run(0.0, 840.0):
        yield schema.encode(s)


def _per_message(inputs: Iterable[bytes | Event], poll: int) -> tuple[Pipeline, list[dict], list[dict]]:
    """The reference: the same polls, each value decoded alone, each sample's state derived alone."""
    pipe, findings, states = Pipeline(), [], []
    table = pipe.diagnoser.states
    table.observe = lambda samples: [s for s in map(table._observe_one, samples) if s is not None]
    health = pipe.health
    health._telemetry_many = lambda samples: [f for s in samples for f in health._telemetry(s)]
    items = list(inputs)
    for lo in range(0, len(items), poll):
        msgs = [schema.decode(Telemetry, i) if isinstance(i, bytes) else i for i in items[lo:lo + poll]]
        out = pipe.feed(msgs)
        findings += [f.to_obj() for f in out.findings]
        states += [s.to_obj() for s in out.states]
    del table.observe, health._telemetry_many  # the instances' own methods again, for state_dict
    return pipe, findings, states


def _columnar(inputs: Iterable[bytes | Event], poll: int) -> tuple[Pipeline, list[dict], list[dict]]:
    pipe, findings, states = Pipeline(), [], []
    items = list(inputs)
    for lo in range(0, len(items), poll):
        part = items[lo:lo + poll]
        values = [i for i in part if isinstance(i, bytes)]
        decoded = iter(schema.decode_many(Telemetry, values))
        msgs = [next(decoded) if isinstance(i, bytes) else i for i in part]
        assert all(not isinstance(m, Exception) for m in msgs)
        out = pipe.feed(msgs)
        findings += [f.to_obj() for f in out.findings]
        states += [s.to_obj() for s in out.states]
    return pipe, findings, states


def _same_state(a: object, b: object) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a), np.asarray(b), equal_nan=np.asarray(a).dtype.kind == "f")
    if isinstance(a, float) and isinstance(b, float) and np.isnan(a) and np.isnan(b):
        return True
    return bool(a == b)


CASES = {
    "default": lambda: _node_inputs(_early("default", 10, 55), 130.0),
    "multi_job": lambda: _node_inputs(_early("multi_job", 6, 60), 40.0),
    "thermal_fleet": _physics_inputs,
}


@pytest.mark.parametrize("case", list(CASES))
def test_columnar_node_stage_matches_per_message(case: str) -> None:
    inputs = list(CASES[case]())
    one, f_one, s_one = _per_message(inputs, poll=700)
    many, f_many, s_many = _columnar(inputs, poll=700)
    assert len(s_one) > 50, f"{case}: only {len(s_one)} node states: the case does not exercise the node stage"
    if case != "thermal_fleet":
        assert f_one, f"{case}: no finding fired: the case does not exercise the rules"
    assert f_many == f_one, (f"{case}: findings differ: per message {[f['kind'] for f in f_one]}, "
                             f"columnar {[f['kind'] for f in f_many]}")
    assert len(s_many) == len(s_one) and s_many == s_one, f"{case}: node states differ"
    a, b = many.state_dict(), one.state_dict()
    assert _same_state(a.tree, b.tree) and _same_state(a.arrays, b.arrays), f"{case}: detector state differs"
