"""The event-time reorder buffer and the step assembler (pure; no broker needed)."""

from __future__ import annotations

import numpy as np

from fleethealth.detectors.assembly import EventTimeBuffer, StepAssembler
from fleethealth.schema import StepBatch


def _batch(step: int, node: int, ts: float, gpus: int = 4) -> StepBatch:
    ranks = np.arange(node * gpus, (node + 1) * gpus, dtype=np.int32)
    return StepBatch(job="j", step=step, node=f"n{node:04d}", ts=ts, ranks=ranks,
                     gpus=np.arange(gpus, dtype=np.int16), compute_s=np.full(gpus, 1.0 + step / 100))


def test_buffer_releases_in_event_time_order_below_the_live_watermark() -> None:
    buf: EventTimeBuffer[str] = EventTimeBuffer()
    buf.push(5.0, "steps", "s5")
    buf.push(1.0, "tel", "t1")
    buf.push(3.0, "steps", "s3")
    # "tel" has more unread data and only reached t=1: nothing newer may go yet
    assert [x for _, x in buf.release(buf.watermark(["tel", "steps"]))] == ["t1"]
    # a live partition with nothing buffered yet holds everything back
    assert buf.watermark(["tel", "events"]) == float("-inf")
    # once "tel" is read to its end only "steps" is live
    assert [x for _, x in buf.release(buf.watermark(["steps"]))] == ["s3", "s5"]
    assert buf.watermark([]) == float("inf") and len(buf) == 0


def test_first_step_waits_for_the_timeout_then_steps_complete_on_their_last_rank() -> None:
    asm = StepAssembler(timeout_s=5.0)
    assert asm.add(_batch(0, 0, 10.0)) == [] and asm.add(_batch(0, 1, 10.0)) == []
    assert asm.add(_batch(1, 0, 12.0)) == []
    done = asm.add(_batch(1, 1, 16.0))  # its event time makes step 0 overdue; step 1 is complete
    assert [(s.step, s.complete) for s in done] == [(0, False), (1, True)]
    step1 = done[1]
    assert step1.ranks.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert step1.nodes.tolist() == ["n0000"] * 4 + ["n0001"] * 4
    np.testing.assert_allclose(step1.compute_s, 1.01)
    # now the job's ranks are known: step 2 completes as soon as both nodes reported
    assert asm.add(_batch(2, 1, 18.0)) == []
    assert [s.step for s in asm.add(_batch(2, 0, 18.0))] == [2]


def test_a_silent_node_does_not_stall_the_others() -> None:
    asm = StepAssembler(timeout_s=5.0)
    for node in (0, 1):
        asm.add(_batch(0, node, 0.0))
    asm.flush(100.0)
    assert asm.add(_batch(1, 0, 2.0)) == []  # node 1 hangs: step 1 never completes
    overdue = asm.flush(7.0)
    assert [(s.step, s.complete, s.ranks.size) for s in overdue] == [(1, False, 4)]


def test_late_and_duplicate_batches_are_counted_not_rescored() -> None:
    asm = StepAssembler(timeout_s=5.0)
    asm.add(_batch(0, 0, 0.0))
    assert asm.add(_batch(0, 0, 0.0)) == [] and asm.duplicate_total == 1
    asm.flush(10.0)
    assert asm.add(_batch(0, 1, 11.0)) == [] and asm.late_total == 1
    assert asm.drain() == []


def test_a_partial_first_step_does_not_make_later_partial_steps_complete() -> None:
    """Coverage is by rank identity, and late nodes are learned at once: a job first seen with one
    node must not keep emitting steps without its other nodes (the slow one would always be dropped)."""
    asm = StepAssembler(timeout_s=5.0)
    asm.add(_batch(0, 3, 0.0))
    asm.flush(10.0)  # step 0 went out with node 3 only
    assert asm.add(_batch(1, 0, 11.0)) == []  # node 0 has as many ranks as the job showed, but other ones
    done = asm.add(_batch(1, 3, 11.0))       # every known rank is in: complete
    assert [(s.step, s.ranks.size) for s in done] == [(1, 8)]
    assert asm.add(_batch(1, 1, 11.5)) == [] and asm.late_total == 1  # late, but now known
    assert asm.add(_batch(2, 3, 12.0)) == [] and asm.add(_batch(2, 0, 12.0)) == []
    assert [(s.step, s.ranks.size, s.complete) for s in asm.add(_batch(2, 1, 12.5))] == [(2, 12, True)]


def test_a_rank_reported_by_two_nodes_is_a_duplicate_not_a_crash() -> None:
    asm = StepAssembler(timeout_s=5.0)
    asm.add(_batch(0, 0, 0.0))
    moved = StepBatch(job="j", step=0, node="n0099", ts=0.5, ranks=np.arange(4, dtype=np.int32),
                      gpus=np.arange(4, dtype=np.int16), compute_s=np.ones(4))
    assert asm.add(moved) == [] and asm.duplicate_total == 1
    assert [s.ranks.size for s in asm.drain()] == [4]


def test_interruption_lets_step_numbers_repeat_and_forget_drops_a_job() -> None:
    asm = StepAssembler(timeout_s=5.0)
    asm.add(_batch(5, 0, 0.0))
    asm.drain()
    asm.add(_batch(4, 0, 1.0))
    assert asm.late_total == 1
    asm.restart("j")
    assert [s.step for s in asm.add(_batch(4, 0, 2.0))] == [4]
    assert asm.add(_batch(6, 1, 3.0)) == [] and asm.open_steps() == {("j", 6)}
    asm.forget(jobs=["j"])
    assert asm.open_steps() == set() and asm.drain() == []


def test_a_forged_step_far_ahead_is_refused_and_later_steps_still_score() -> None:
    """One batch claiming step 2**63-1 must not make every later step look late."""
    asm = StepAssembler(timeout_s=5.0, max_step_jump=1000)
    for step in range(3):  # 10 s apart: the first step is emitted on its timeout, the others complete
        asm.add(_batch(step, 0, 10.0 * step))
        asm.add(_batch(step, 1, 10.0 * step))
    forged = StepBatch(job="j", step=2**63 - 1, node="n0000", ts=25.0, ranks=np.arange(4, dtype=np.int32),
                       gpus=np.arange(4, dtype=np.int16), compute_s=np.ones(4))
    assert asm.add(forged) == [] and asm.refused_ and asm.implausible_total == 1
    emitted = asm.add(_batch(3, 0, 30.0)) + asm.add(_batch(3, 1, 30.0))
    assert [s.step for s in emitted if s.complete] == [3] and asm.late_total == 0 and not asm.refused_


def test_a_batch_naming_another_nodes_ranks_is_refused_until_the_job_restarts() -> None:
    asm = StepAssembler(timeout_s=5.0)
    asm.add(_batch(0, 0, 0.0))
    asm.add(_batch(0, 1, 0.0))
    thief = StepBatch(job="j", step=1, node="n0666", ts=10.0, ranks=np.arange(4, dtype=np.int32),
                      gpus=np.arange(4, dtype=np.int16), compute_s=np.full(4, 9.0))
    assert asm.add(thief) == [] and asm.refused_ and asm.foreign_total == 1
    done = asm.add(_batch(1, 0, 10.0)) + asm.add(_batch(1, 1, 10.0))
    assert [s.step for s in done if s.complete] == [1] and set(done[-1].nodes) == {"n0000", "n0001"}
    asm.restart("j")  # a new placement: ranks may move
    assert asm.add(thief) == [] and not asm.refused_ and asm.foreign_total == 1
