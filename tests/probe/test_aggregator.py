"""Rank datagrams -> one columnar StepBatch per (job, step); garbage counted, never raised."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from fleethealth.probe.aggregator import StepAggregator, pack
from fleethealth.schema import MAX_MESSAGE_BYTES, EventKind, StepBatch, StepBlock, decode, encode
from fleethealth.wire import WireMessage


def _c(job: str, rank: int, step: int, s: float, ts: float = 100.0, gpu: int | None = None) -> bytes:
    return orjson.dumps({"t": "c", "job": job, "rank": rank, "gpu": rank % 8 if gpu is None else gpu,
                         "step": step, "s": s, "ts": ts})


def _p(job: str, rank: int, step: int, ts: float) -> bytes:
    return orjson.dumps({"t": "p", "job": job, "rank": rank, "gpu": rank % 8, "step": step, "ts": ts})


def test_one_batch_per_step_once_every_known_rank_reported() -> None:
    agg = StepAggregator("n0002", timeout_s=5.0)
    for rank in (19, 16, 18, 17):  # arrival order is not rank order
        agg.feed(_c("train-1", rank, 0, 1.0 + rank / 100), now=0.0)
    assert agg.drain(4.9).batches == ()  # the rank set is still being learnt
    (first,) = agg.drain(5.0).batches
    assert first.ranks.tolist() == [16, 17, 18, 19]
    for rank in (16, 17, 18):
        agg.feed(_c("train-1", rank, 1, 1.5), now=6.0)
    assert agg.drain(6.0).batches == ()  # rank 19 is known and missing
    agg.feed(_c("train-1", 19, 1, 1.9, ts=103.0), now=6.1)
    (batch,) = agg.drain(6.1).batches
    assert (batch.job, batch.step, batch.node) == ("train-1", 1, "n0002")
    assert batch.ranks.tolist() == [16, 17, 18, 19] and batch.gpus.tolist() == [0, 1, 2, 3]
    assert batch.compute_s.tolist() == [1.5, 1.5, 1.5, 1.9] and batch.ts == 103.0
    assert decode(StepBatch, encode(batch)).ranks.tolist() == [16, 17, 18, 19]
    assert agg.stats.incomplete_total == 0 and agg.stats.batches_total == 2


def test_a_silent_rank_does_not_hold_the_step_beyond_the_timeout() -> None:
    agg = StepAggregator("n0", timeout_s=2.0)
    for rank in range(4):
        agg.feed(_c("j", rank, 0, 1.0), now=0.0)
    assert len(agg.drain(2.0).batches) == 1
    for rank in range(3):  # rank 3 hangs
        agg.feed(_c("j", rank, 1, 1.0), now=10.0)
    assert agg.drain(11.9).batches == ()
    (batch,) = agg.drain(12.0).batches
    assert batch.ranks.tolist() == [0, 1, 2]
    assert agg.stats.incomplete_total == 1
    agg.feed(_c("j", 3, 1, 9.0), now=12.5)  # the straggler's datagram after emission
    assert agg.drain(12.5).batches == () and agg.stats.late_total == 1


def test_progress_marks_complete_the_step_and_set_its_time() -> None:
    agg = StepAggregator("n0", timeout_s=5.0)
    for rank in range(2):
        agg.feed(_c("j", rank, 0, 1.0), 0.0)
        agg.feed(_p("j", rank, 0, 50.0 + rank), 0.0)
    assert agg.drain(5.0).batches[0].ts == 51.0
    agg.feed(_c("j", 0, 1, 1.0, ts=60.0), 6.0)
    agg.feed(_c("j", 1, 1, 1.2, ts=60.2), 6.0)
    assert agg.drain(6.0).batches == ()  # the job sends progress marks: wait for them
    agg.feed(_p("j", 0, 1, 61.0), 6.1)
    agg.feed(_p("j", 1, 1, 61.5), 6.1)
    (batch,) = agg.drain(6.1).batches
    assert batch.ts == 61.5 and batch.compute_s.tolist() == [1.0, 1.2]


def test_jobs_are_batched_apart() -> None:
    agg = StepAggregator("n0", timeout_s=1.0)
    agg.feed(_c("a", 0, 0, 1.0), 0.0)
    agg.feed(_c("b", 1, 0, 2.0), 0.0)
    batches = sorted(agg.drain(1.0).batches, key=lambda b: b.job)
    assert [(b.job, b.ranks.tolist()) for b in batches] == [("a", [0]), ("b", [1])]


@pytest.mark.parametrize("garbage", [
    b"", b"\xff\xfe", b"not json", b"[1,2,3]", b'{"t":"x"}', b'{"t":"c","job":"j"}',
    b'{"t":"c","job":"j","rank":-1,"gpu":0,"step":0,"s":1.0,"ts":1.0}',
    b'{"t":"c","job":"j","rank":0,"gpu":0,"step":0,"s":1e300,"ts":1.0}',
    b'{"t":"c","job":"","rank":0,"gpu":0,"step":0,"s":1.0,"ts":1.0}',
    b'{"t":"e","event":"x"}', b'{"t":"e","event":{"kind":"no_such_kind","ts":1.0}}',
    b'{"t":"e","event":{"kind":"xid","ts":1.0,"code":"79"}}', b'{"t":"c","job":"j","rank":true,"gpu":0,'
    b'"step":0,"s":1.0,"ts":1.0}', b"1" * 70000,
    # in range for JSON, out of range for the batch's int32 ranks / int16 GPUs / int64 steps
    b'{"t":"c","job":"j","rank":0,"gpu":40000,"step":0,"s":1.0,"ts":1.0}',
    b'{"t":"c","job":"j","rank":1099511627776,"gpu":0,"step":0,"s":1.0,"ts":1.0}',
    b'{"t":"c","job":"j","rank":2147483648,"gpu":0,"step":0,"s":1.0,"ts":1.0}',
    b'{"t":"c","job":"j","rank":0,"gpu":32768,"step":0,"s":1.0,"ts":1.0}',
    b'{"t":"c","job":"j","rank":0,"gpu":0,"step":9223372036854775808,"s":1.0,"ts":1.0}',
])
def test_garbage_is_counted_and_dropped(garbage: bytes) -> None:
    agg = StepAggregator("n0")
    agg.feed(garbage, 0.0)
    out = agg.drain(100.0)
    assert out.batches == () and out.events == ()
    assert agg.stats.garbage_total == 1 and agg.last_garbage


def test_event_datagrams_are_forwarded_with_the_node_filled_in() -> None:
    agg = StepAggregator("n0009")
    event = {"kind": "sdc_check", "ts": 77.0, "job": "train-1", "rank": 72, "gpu": 0, "step": 50,
             "data": {"check": "selfcheck", "passed": False, "classification": "transient", "digests": ["ab"],
                      "duration_s": 0.3, "peer_ranks": [], "culprit_rank": None, "tolerance": None}}
    agg.feed(orjson.dumps({"t": "e", "event": event}), 1.0)
    agg.feed(orjson.dumps({"t": "e", "event": {"kind": "hang_report", "rank": 3, "step": 9,
                                               "data": {"stacks": "Thread 0x1 ...", "last_collective": None,
                                                        "timeout_s": 90.0}}}), 2.0)
    sdc, hang = agg.drain(2.0).events
    assert sdc.node == "n0009" and sdc.kind is EventKind.SDC_CHECK and sdc.data["passed"] is False
    assert hang.kind is EventKind.HANG_REPORT and hang.ts == 2.0  # no ts, no wall clock given: ``now``
    assert agg.stats.events_total == 2
    agg.feed(orjson.dumps({"t": "e", "event": {"kind": "hang_report", "rank": 3, "step": 10,
                                               "data": {"stacks": "", "last_collective": None, "timeout_s": 90.0}}}),
             3.0, wall=1_700_000_000.0)
    (late,) = agg.drain(3.0).events
    assert late.ts == 1_700_000_000.0  # the wall clock when given, never the monotonic ``now``


def test_open_steps_are_bounded() -> None:
    agg = StepAggregator("n0", timeout_s=1e9, max_open=8)
    for step in range(20):  # steps pile up while nothing completes them
        agg.feed(_c("j", 0, step, 1.0), 0.0)
    assert agg.stats.open_steps == 8 and agg.stats.evicted_total == 12
    assert [b.step for b in agg.drain(0.0).batches] == list(range(12))


def test_out_of_range_numbers_are_named_and_the_largest_valid_ones_batch() -> None:
    agg = StepAggregator("n0", timeout_s=1.0)
    agg.feed(_c("j", 2**31, 0, 1.0, gpu=0), 0.0)
    assert agg.stats.garbage_total == 1 and "rank 2147483648 is out of range" in (agg.last_garbage or "")
    agg.feed(_c("j", 2**31 - 1, 0, 1.0, gpu=2**15 - 1), 0.0)
    agg.feed(orjson.dumps({"t": "c", "job": "j", "rank": 0, "gpu": 0, "step": 2**63 - 1, "s": 1.0, "ts": 1.0}), 0.0)
    batches = sorted(agg.drain(1.0).batches, key=lambda b: b.step)
    assert [(b.step, b.ranks.tolist(), b.gpus.tolist()) for b in batches] == [
        (0, [2**31 - 1], [2**15 - 1]), (2**63 - 1, [0], [0])]
    assert agg.stats.garbage_total == 1


def test_a_parsed_message_that_cannot_be_batched_is_garbage_not_a_crash() -> None:
    """``add`` takes already parsed messages; values ``parse`` would refuse must not break ``drain``."""
    agg = StepAggregator("n0", timeout_s=1.0)
    agg.add(WireMessage("c", "j", 2**40, 0, 0, 1.0, 1.0), 0.0)
    agg.feed(_c("j", 1, 1, 1.0), 0.0)
    out = agg.drain(1.0)
    assert [b.step for b in out.batches] == [1]
    assert agg.stats.garbage_total == 1 and "cannot be batched" in (agg.last_garbage or "")


def test_a_failure_inside_handling_counts_the_datagram_as_garbage(monkeypatch) -> None:
    """Fault injected into the aggregator's own handling: ``feed`` never raises on input."""
    agg = StepAggregator("n0", timeout_s=1.0)
    real_add = agg.add

    def add(msg: WireMessage, now: float, wall: float | None = None) -> None:
        if msg.rank == 7:
            raise RuntimeError("injected")
        real_add(msg, now, wall)

    monkeypatch.setattr(agg, "add", add)
    agg.feed(_c("j", 7, 0, 1.0), 0.0)
    agg.feed(_c("j", 0, 0, 1.0), 0.0)
    assert agg.stats.garbage_total == 1 and agg.last_garbage == "RuntimeError: injected"
    assert [b.ranks.tolist() for b in agg.drain(1.0).batches] == [[0]]


def _learn(agg: StepAggregator, ranks: range, marks: tuple[int, ...]) -> None:
    """Step 0 of job ``j``: every rank's compute, a progress mark from ``marks``; out at the timeout."""
    for rank in ranks:
        agg.feed(_c("j", rank, 0, 1.0), 0.0)
    for rank in marks:
        agg.feed(_p("j", rank, 0, 50.0), 0.0)
    assert len(agg.drain(5.0).batches) == 1


def test_one_progress_mark_does_not_hold_a_cpu_timer_job_for_good() -> None:
    """CPU-path ranks send only the combined compute datagram; one ``step_done`` without a compute
    span sends a lone progress mark, which must not make every later step wait for the timeout."""
    agg = StepAggregator("n0", timeout_s=5.0)
    _learn(agg, range(2), marks=())
    agg.feed(_p("j", 0, 1, 60.0), 6.0)            # rank 0: step_done(1) without a compute span
    agg.feed(_c("j", 1, 1, 1.0), 6.0)
    assert agg.drain(6.0).batches == ()            # rank 0's compute for step 1 never comes
    assert [b.ranks.tolist() for b in agg.drain(11.0).batches] == [[1]]
    for step in range(2, 6):
        now = 12.0 + step
        agg.feed(_c("j", 0, step, 1.0), now)
        agg.feed(_c("j", 1, step, 1.0), now)
        (batch,) = agg.drain(now).batches            # out at once, not after the timeout
        assert batch.step == step and batch.ranks.tolist() == [0, 1]


def test_only_the_ranks_that_send_progress_marks_are_waited_for() -> None:
    agg = StepAggregator("n0", timeout_s=5.0)
    _learn(agg, range(3), marks=(1,))              # rank 1 times on the GPU path, ranks 0 and 2 on the CPU
    for rank in range(3):
        agg.feed(_c("j", rank, 1, 1.0, ts=60.0), 6.0)
    assert agg.drain(6.0).batches == ()            # rank 1's mark is still due
    agg.feed(_p("j", 1, 1, 61.0), 6.1)
    (batch,) = agg.drain(6.1).batches
    assert batch.ts == 61.0 and batch.ranks.tolist() == [0, 1, 2]


def test_a_mark_lost_once_is_learnt_again_from_the_next_late_mark() -> None:
    agg = StepAggregator("n0", timeout_s=5.0)
    _learn(agg, range(2), marks=(0, 1))
    agg.feed(_c("j", 0, 1, 1.0), 6.0)
    agg.feed(_c("j", 1, 1, 1.0), 6.0)
    agg.feed(_p("j", 0, 1, 61.0), 6.0)             # rank 1's mark for step 1 is lost
    assert len(agg.drain(11.0).batches) == 1       # out at the timeout: rank 1 no longer held
    agg.feed(_c("j", 0, 2, 1.0), 12.0)
    agg.feed(_p("j", 0, 2, 62.0), 12.0)
    agg.feed(_c("j", 1, 2, 1.0), 12.0)             # complete before rank 1's mark: it goes out
    assert len(agg.drain(12.0).batches) == 1
    agg.feed(_p("j", 1, 2, 62.5), 12.1)            # the mark came late: rank 1 sends marks after all
    assert agg.stats.late_total == 1
    for rank in range(2):
        agg.feed(_c("j", rank, 3, 1.0), 13.0)
    agg.feed(_p("j", 0, 3, 63.0), 13.0)
    assert agg.drain(13.0).batches == ()           # held for rank 1's mark again
    agg.feed(_p("j", 1, 3, 63.5), 13.1)
    assert agg.drain(13.1).batches[0].ts == 63.5


# ---------------------------------------------------------------------------------------- packing
def _batches(job: str, node: str, steps: range, ranks: int = 8, first_rank: int = 0) -> list[StepBatch]:
    r = np.arange(first_rank, first_rank + ranks, dtype=np.int32)
    rng = np.random.default_rng(3)  # measured times: full-length decimals on the wire
    return [StepBatch(job=job, step=k, node=node, ts=100.0 + 0.1 * k, ranks=r, gpus=(r % 8).astype(np.int16),
                      compute_s=0.5 + 0.01 * rng.random(ranks)) for k in steps]


def test_an_interval_of_steps_is_packed_into_one_message_per_job() -> None:
    """One drain of a 10-steps/s job and a second job: one block each, every step in it once; a step
    whose rank set differs (a rank missing at the timeout) goes apart; ``max_steps`` caps a block."""
    partial = StepBatch(job="a", step=10, node="n0001", ts=101.0, ranks=np.arange(7, dtype=np.int32),
                        gpus=np.arange(7, dtype=np.int16), compute_s=np.full(7, 0.5))
    batches = [*_batches("a", "n0001", range(10)), *_batches("b", "n0001", range(3), 2), partial]
    out = pack(batches, 100)
    assert [type(m).__name__ for m in out] == ["StepBlock", "StepBlock", "StepBatch"]
    assert out[0].steps.tolist() == list(range(10)) and out[1].job == "b" and out[2] is partial
    split = [b for m in out for b in (m.split() if isinstance(m, StepBlock) else [m])]
    assert sorted((b.job, b.step) for b in split) == sorted((b.job, b.step) for b in batches)
    assert [len(m.steps) for m in pack(batches[:10], 4)] == [4, 4, 2]
    assert pack(batches, 1) == batches  # packing off: one message per step, as before
    with pytest.raises(ValueError):
        pack(batches, 0)


def test_a_block_over_the_message_cap_is_split_until_each_part_fits() -> None:
    batches = _batches("big", "n0001", range(64), ranks=512)
    whole = len(encode(StepBlock.of(batches)))
    cap = whole // 5
    out = pack(batches, 100, max_bytes=cap)
    assert len(out) > 1 and all(len(encode(m)) <= cap for m in out)
    assert [s for m in out for s in m.steps.tolist()] == list(range(64))
    # the real cap holds for a default-sized interval of a large node
    out = pack(_batches("big", "n0001", range(100), ranks=512), 100)
    assert all(len(encode(m)) <= MAX_MESSAGE_BYTES for m in out) and len(out) > 1
    assert all(isinstance(decode(StepBatch, encode(m)), StepBlock) for m in out)
