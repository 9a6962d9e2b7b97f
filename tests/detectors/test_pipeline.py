"""The pipeline wiring that no single detector owns: goodput into the pager (detection composed with
the policy stage, as the runner does), clocks, job pruning, restarts."""

from __future__ import annotations

import numpy as np

from fleethealth.detectors.pipeline import Pipeline
from fleethealth.detectors.runner import conclude
from fleethealth.policy.stage import PolicyStage
from fleethealth.schema import Action, Event, EventKind, StepBatch, Telemetry

T0 = 1_767_225_600.0


def _steps(job: str, n: int, every_s: float = 2.0) -> list[StepBatch]:
    return [StepBatch(job=job, step=k, node="n0000", ts=T0 + every_s * k, ranks=np.arange(4, dtype=np.int32),
                      gpus=np.arange(4, dtype=np.int16), compute_s=np.full(4, 1.6)) for k in range(n)]


def _interruption(job: str, ts: float, lost: int, node: str) -> Event:
    return Event(node=node, ts=ts, kind=EventKind.INTERRUPTION, job=job, step=599,
                 data={"cause": "gpu_failure", "detected_by": "xid", "lost_steps": lost, "restart_s": 600.0})


def _pages(lost: int) -> list[str]:
    pipe, stage = Pipeline(), PolicyStage()
    conclude(pipe, stage, _steps("j", 600))
    out = conclude(pipe, stage, [_interruption("j", T0 + 1200.0, lost, "n0000")])  # the record's own time counts
    return [r.reason for r in out.recommendations if r.action is Action.PAGE]


def test_goodput_collapse_pages_when_restarts_eat_the_hour() -> None:
    pages = _pages(lost=500)  # 600 steps done in 20 min, 500 of them lost again: goodput ≈ 0.17
    assert len(pages) == 1 and "goodput" in pages[0]


def test_a_routine_interruption_does_not_page() -> None:
    assert _pages(lost=10) == []


def test_one_node_with_a_clock_far_ahead_does_not_move_now() -> None:
    pipe = Pipeline()
    pipe.feed([Telemetry.from_columns(f"n{i:04d}", "r00", T0 + 10.0, [0]) for i in range(5)])
    pipe.feed([Telemetry.from_columns("n0009", "r00", T0 + 86_400.0, [0]),
               Event(node="n0009", ts=T0 + 86_400.0, kind=EventKind.XID, gpu=0, code=13)])
    assert pipe.now_ == T0 + 10.0


def test_jobs_idle_for_hours_are_forgotten() -> None:
    pipe, stage = Pipeline(job_idle_s=600.0), PolicyStage()
    out = pipe.feed(_steps("old", 50))
    assert out.steps and {job for job, _ in out.steps} == {"old"}
    stage.update(out.findings, [], out.now, steps=out.steps, ended=out.ended)
    assert "old" in stage.step_ends_
    out = pipe.feed([Telemetry.from_columns("n0000", "r00", T0 + 3600.0, [0])])
    assert out.ended == ["old"]
    stage.update(out.findings, [], out.now, steps=out.steps, ended=out.ended)
    assert "old" not in pipe.stragglers_ and "old" not in stage.step_ends_
    assert pipe.assembler.open_steps() == set()


def test_an_interruption_restarts_step_assembly_once() -> None:
    """A restarted run repeats step numbers: after its interruption record they are assembled again,
    without any policy stage; the same record delivered twice does not restart twice."""
    pipe = Pipeline()
    pipe.feed(_steps("j", 20))
    late = pipe.assembler.late_total
    pipe.feed(_steps("j", 3))                                   # repeats without an interruption: late
    assert pipe.assembler.late_total == late + 3
    stop = _interruption("j", T0 + 40.0, 3, "n0000")
    pipe.feed([stop])
    pipe.feed(_steps("j", 3))                                   # after the restart: assembled again
    assert pipe.assembler.late_total == late + 3
    pipe.feed([stop])                                           # redelivered: no second restart
    pipe.feed(_steps("j", 3))
    assert pipe.assembler.late_total == late + 6


def _sample(node: str, ts: float, temp: float = 60.0) -> Telemetry:
    return Telemetry.from_columns(node, f"r{int(node[1:]) // 8:02d}", ts, [0, 1], temp_c=[temp, temp])


def test_nodes_not_seen_for_node_idle_s_are_forgotten_by_every_detector() -> None:
    """20 nodes report once, 30 keep reporting: once event time is ``node_idle_s`` past the 20, no
    detector holds anything about them (clock, diagnosis, health, feature windows, rank owners), and
    what remains is the 30 — bounded by the live fleet, not by every name ever seen."""
    pipe = Pipeline(node_idle_s=600.0, job_idle_s=600.0, prune_every_s=60.0)  # job j ran on the 20 alone
    transient = [f"n{1000 + i}" for i in range(20)]
    live = [f"n{i:04d}" for i in range(30)]
    pipe.feed([_sample(n, T0) for n in transient])
    pipe.feed([StepBatch(job="j", step=0, node=n, ts=T0, ranks=np.array([k], dtype=np.int32),
                         gpus=np.array([0], dtype=np.int16), compute_s=np.ones(1)) for k, n in enumerate(transient)])
    for t in range(0, 1500, 30):
        pipe.feed([_sample(n, T0 + t) for n in live])
    assert set(pipe.clock_) == set(live)
    assert set(pipe.diagnoser.latest_) == set(live) and set(pipe.diagnoser.states.latest_) <= set(live)
    assert all(set(peers) <= set(live) for peers in pipe.diagnoser.racks_.values())
    assert set(pipe.health.previous_) <= set(live)
    assert set(pipe.predictor.features_.nodes_) <= set(live)
    assert not set(pipe.assembler._codes) & set(transient)
    assert pipe.forgotten_nodes_total_ == 20
    left = _strings(pipe.state_dict().tree) & set(transient)  # nowhere else either (newest telemetry, NVLink windows)
    assert not left, f"the pipeline's state still names {sorted(left)}"


def _strings(tree: object) -> set[str]:
    if isinstance(tree, str):
        return {tree}
    if isinstance(tree, dict):
        return {s for k, v in tree.items() for s in (*_strings(k), *_strings(v))}
    if isinstance(tree, list | tuple):
        return {s for v in tree for s in _strings(v)}
    return set()


def test_beyond_max_nodes_and_max_jobs_a_new_name_is_rejected_with_a_reason() -> None:
    pipe = Pipeline(max_nodes=5, max_jobs=2)
    out = pipe.feed([_sample(f"n{i:04d}", T0) for i in range(8)])
    assert len(pipe.clock_) == 5 and [why.split(":")[0] for _, why in out.rejected] == ["node"] * 3
    assert {m.node for m, _ in out.rejected} == {"n0005", "n0006", "n0007"}
    batches = [StepBatch(job=f"j{k}", step=0, node="n0000", ts=T0 + 1, ranks=np.array([k], dtype=np.int32),
                         gpus=np.array([0], dtype=np.int16), compute_s=np.ones(1)) for k in range(3)]
    out = pipe.feed(batches)
    assert [m.job for m, _ in out.rejected] == ["j2"] and out.rejected[0][1].startswith("job:")
    assert pipe.over_limit_ == {"jobs": 1, "nodes": 3}
    # a known node and job are never refused
    assert pipe.feed([_sample("n0001", T0 + 2), batches[0]]).rejected == []
