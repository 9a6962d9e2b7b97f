"""The stage cores, pure: the whole tier (``--stage all``) is the node, job and policy cores wired in process,
and what passes between them passes only as the messages the staged form publishes — so the staged cores,
handed each other's messages as Kafka would carry them, find and decide the same, id for id. A core's
state round-trips through ``state_dict`` / ``from_state`` and gives the same findings afterwards."""

from __future__ import annotations

import pytest

from fleethealth.bus import Record
from fleethealth.detectors.cores import DetectCore, PolicyCore, Tier, WholeCore, make_core
from fleethealth.detectors.effects import Effects
from fleethealth.detectors.snapshot import WHOLE
from fleethealth.detectors.stages import NODE_FINDING_KINDS, Stage
from fleethealth.errors import ConfigError
from fleethealth.schema import Event, Finding, Message, StepBatch, StepBlock, Telemetry, Topic
from fleethealth.sim.fleet import FleetSim
from fleethealth.sim.scenario import Scenario

CHUNK = 150


def _records() -> list[Record]:
    """An 8-node fleet's run with a thermal straggler, an Xid and a hang, as the records a runner releases
    (event-time order)."""
    scenario = Scenario.from_obj({
        "seed": 5, "fleet": {"racks": 2, "nodes_per_rack": 4, "gpus_per_node": 4},
        "job": {"steps": 60, "step_time_s": 2.0}, "checks": {"checkpoint_every": 25},
        "faults": [{"kind": "thermal_straggler", "node": "n0006", "gpu": 3, "start_step": 10, "slowdown": 0.2},
                   {"kind": "xid", "node": "n0002", "gpu": 1, "step": 25, "code": 79},
                   {"kind": "hang", "node": "n0005", "gpu": 0, "step": 40, "duration_s": 60, "restart_s": 30}]})
    msgs: list[Message] = []
    for tick in FleetSim(scenario).run():
        msgs += [*tick.telemetry, *tick.batches, *tick.events]
    msgs.sort(key=lambda m: m.ts)
    topic = {Telemetry: Topic.TELEMETRY, StepBatch: Topic.STEPS, StepBlock: Topic.STEPS, Event: Topic.EVENTS}
    return [Record(topic[type(m)].value, 0, i, None, m) for i, m in enumerate(msgs)]


def _handed(topic: Topic, msgs: list[Message]) -> list[Record]:
    return [Record(topic.value, 0, -1, None, m) for m in msgs]


def _by_time(records: list[Record]) -> list[Record]:
    return sorted(records, key=lambda r: r.msg.ts)


def _staged(records: list[Record]) -> list[Effects]:
    """The node, job and policy cores, each handed what the others publish (node states and the node stage's
    findings; findings, derived events, job progress and ends) in event-time order, as Kafka carries them."""
    node, job, policy = make_core(Stage.NODE), make_core(Stage.JOB), make_core(Stage.POLICY)
    effects, clock = [], float("-inf")
    for at in range(0, len(records), CHUNK):
        chunk, final = records[at:at + CHUNK], at + CHUNK >= len(records)
        n = node.step(chunk, float("-inf"), final=final)
        tables = [*_handed(Topic.NODESTATE, list(n.states)),
                  *_handed(Topic.FINDINGS, [f for f in n.findings if f.kind in NODE_FINDING_KINDS])]
        j = job.step(_by_time([*chunk, *tables]), float("-inf"), final=final)
        told = _by_time([*(r for r in chunk if isinstance(r.msg, Event)),
                         *_handed(Topic.FINDINGS, [m for m in (*n.outbox, *j.outbox) if isinstance(m, Finding)]),
                         *_handed(Topic.EVENTS, [m for m in j.outbox if isinstance(m, Event)])])
        p = policy.step(told, clock, final=final)
        clock = p.now
        effects += [n, j, p]
    return effects


def _whole(records: list[Record], core: WholeCore | None = None, start: int = 0) -> tuple[WholeCore, list[Effects]]:
    core = core if core is not None else make_core(Stage.ALL)  # type: ignore[assignment]
    effects, now = [], float("-inf")
    for at in range(start, len(records), CHUNK):
        eff = core.step(records[at:at + CHUNK], now, final=at + CHUNK >= len(records))
        now = max(now, eff.now)
        effects.append(eff)
    return core, effects


def _ids(effects: list[Effects]) -> tuple[set[str], set[str]]:
    return ({f.id for e in effects for f in e.findings}, {r.id for e in effects for r in e.recommendations})


@pytest.fixture(scope="module")
def records() -> list[Record]:
    return _records()


def test_the_whole_tier_finds_and_decides_what_the_three_staged_cores_do(records) -> None:
    core, whole = _whole(records)
    findings, recs = _ids(whole)
    staged_findings, staged_recs = _ids(_staged(records))
    kinds = {f.kind.value for e in whole for f in e.findings}
    assert {"straggler", "xid", "hang"} <= kinds, kinds
    assert recs, "no decision: the policy got nothing from detection"
    assert findings == staged_findings and recs == staged_recs
    # the job side learnt of the nodes only through node states: its node-state table holds every node
    assert set(core.job.diagnoser.latest_) == {r.msg.node for r in records if isinstance(r.msg, Telemetry)}
    assert core.node.steps_total_ == 0 and not core.node.job_seen_  # the node side saw no step


def test_each_stage_stores_and_publishes_what_it_owns(records) -> None:
    node, job, policy = _staged(records)[0:3]
    assert node.states and not node.steps and node.telemetry and not node.recommendations
    assert all(isinstance(m, Finding) for m in node.outbox)
    assert job.steps and not job.telemetry and not job.states
    assert {e.kind.value for e in job.outbox if isinstance(e, Event)} >= {"job_progress"}
    assert not policy.events and not policy.telemetry and not policy.steps and not policy.states
    whole = _whole(records)[1][0]
    assert not whole.states and not any(isinstance(m, Event) for m in whole.outbox)  # nothing to hand on the bus


def _findings(effects: list[Effects]) -> set[tuple]:
    """What was found, with each finding's id (a hang's dates its episode: the job's last progress)."""
    return {(f.id, f.kind, f.detector, f.job, f.node, f.gpu, f.rank, f.step, f.ts, f.episode_ts, f.diagnosis)
            for e in effects for f in e.findings}


def test_the_whole_tier_state_round_trips_and_finds_the_same_afterwards(records) -> None:
    half = (len(records) // 2 // CHUNK) * CHUNK
    first, _ = _whole(records[:half])
    restored = make_core(Stage.ALL)
    tier = restored.from_state(WHOLE, first.state_dict(WHOLE))
    assert isinstance(tier, Tier) and tier.job.steps_total_ == first.job.steps_total_ > 0
    restored.adopt(WHOLE, tier)
    assert restored.held() == {WHOLE}
    # the same second half after the first half's state, whether kept in memory or restored
    _, kept = _whole(records, first, half)
    _, after = _whole(records, restored, half)
    assert _findings(after) == _findings(kept) and _findings(after)
    assert _ids(after) == _ids(kept) and "hang" in {f.kind.value for e in after for f in e.findings}


def test_a_core_forgets_jobs_and_nodes(records) -> None:
    core, _ = _whole(records[: len(records) // 2])
    jobs = set(core.job.job_seen_)
    nodes = set(core.node.clock_)
    assert jobs and nodes
    core.forget(jobs, nodes)
    assert not core.job.job_seen_ and not core.node.clock_ and not core.policy.step_ends_


def test_the_stage_chooses_its_core_once() -> None:
    assert isinstance(make_core("node"), DetectCore) and isinstance(make_core("job"), DetectCore)
    assert isinstance(make_core("policy"), PolicyCore) and isinstance(make_core("all"), WholeCore)
    assert make_core("job").shared and not make_core("node").shared
    assert make_core("policy").wanted({0, 1}) == set() and make_core("node").wanted({0, 1}) == {0, 1}
    assert make_core("all").wanted({0, 1}) == {WHOLE}
    from fleethealth.detectors.pipeline import Pipeline

    for stage in ("all", "node", "job"):
        with pytest.raises(ConfigError, match="pass a factory"):
            make_core(stage, pipeline=Pipeline())
