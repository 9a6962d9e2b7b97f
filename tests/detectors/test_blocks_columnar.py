"""The columnar block path gives what the one-step path gives: a stream of step blocks (each node's
steps of one interval in one message) and the same stream as one step batch per node and step must
assemble the same steps, score them the same and find the same stragglers and hangs, with the same
ids. Pure (no broker, no store); seconds."""

from __future__ import annotations

import numpy as np
import pytest

from fleethealth.detectors.assembly import AssembledStep, StepAssembler
from fleethealth.detectors.hang import HangDetector
from fleethealth.detectors.pipeline import Pipeline
from fleethealth.detectors.straggler import StragglerDetector
from fleethealth.schema import StepBatch, StepBlock

GPUS = 8
T0 = 1_767_225_600.0


class Recording(StragglerDetector):
    """The production detector, keeping every step it scored (whichever entry point was used) as
    ``(job, step, ranks, times)`` in rank order (the node order within a step may differ)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, int, list[int], list[float]]] = []
        self._many = False

    def _keep(self, placement, step, ranks, compute_s) -> None:
        order = np.argsort(ranks, kind="stable")
        self.seen.append((placement.job, int(step), np.asarray(ranks)[order].tolist(),
                          np.asarray(compute_s)[order].tolist()))

    def check(self, step, ranks, compute_s, groups=None, *, placement=None):  # type: ignore[override]
        if not self._many:
            self._keep(placement, step, ranks, compute_s)
        return super().check(step, ranks, compute_s, groups, placement=placement)

    def check_many(self, steps, ranks, compute_s, groups=None, *, placements=None):  # type: ignore[override]
        for k, step in enumerate(steps):
            self._keep(placements[k], step, ranks, compute_s[k])
        self._many = True
        try:
            return super().check_many(steps, ranks, compute_s, groups, placements=placements)
        finally:
            self._many = False


def _stream(ranks: int, steps: int, per_block: int, *, slow_rank: int, slow_from: int, slowdown: float,
            seed: int = 11) -> tuple[list[list[StepBatch]], list[list[StepBlock]]]:
    """One job of ``ranks`` ranks (8 a node): its first step, then (11 s later, so the first step is
    concluded by the completeness timeout and the job's ranks are known, as in a running detector) a
    step every 0.1 s with each node's clock a little off; ``slow_rank`` is ``slowdown`` slower from
    ``slow_from`` on. The first step alone as step batches, then per interval of ``per_block`` steps the
    step batches in event-time order, and the same as the nodes' blocks in a shuffled node order."""
    rng = np.random.default_rng(seed)
    times = 0.6 * np.exp(0.02 * rng.standard_normal((steps, ranks)))
    times[slow_from:, slow_rank] *= 1.0 + slowdown
    skew = rng.uniform(0.0, 0.004, ranks // GPUS)
    gpus = np.arange(GPUS, dtype=np.int16)
    start = [StepBatch(job="train", step=0, node=f"n{n:04d}", ts=T0 + float(skew[n]),
                       ranks=np.arange(n * GPUS, (n + 1) * GPUS, dtype=np.int32), gpus=gpus,
                       compute_s=times[0, n * GPUS:(n + 1) * GPUS]) for n in range(ranks // GPUS)]
    one, blocks = [start], [start]
    for k0 in range(1, steps, per_block):
        interval = [[StepBatch(job="train", step=k, node=f"n{n:04d}", ts=T0 + 11.0 + 0.1 * k + float(skew[n]),
                               ranks=np.arange(n * GPUS, (n + 1) * GPUS, dtype=np.int32), gpus=gpus,
                               compute_s=times[k, n * GPUS:(n + 1) * GPUS])
                     for k in range(k0, min(k0 + per_block, steps))] for n in range(ranks // GPUS)]
        one.append(sorted((b for node in interval for b in node), key=lambda b: (b.ts, b.node)))
        blocks.append([StepBlock.of(interval[n]) for n in rng.permutation(len(interval))])
    return one, blocks


def _run(feeds: list[list]) -> tuple[Pipeline, list, list[tuple[str, float]]]:
    pipeline = Pipeline(straggler=lambda: Recording())
    findings, steps = [], []
    for messages in feeds:
        out = pipeline.feed(messages)
        findings += out.findings
        steps += out.steps
    tail = pipeline.drain()
    return pipeline, findings + tail.findings, steps + tail.steps


def test_a_block_stream_assembles_scores_and_finds_as_the_one_step_stream() -> None:
    """1,024 ranks, 10 steps a block, one rank 5 % slow from step 60: the same steps reach the
    straggler detector with the same compute times, and the same finding comes out, same id."""
    one, blocks = _stream(1024, 160, 10, slow_rank=300, slow_from=60, slowdown=0.05)
    p1, f1, s1 = _run(one)
    p2, f2, s2 = _run(blocks)
    assert [f.rank for f in f1 if f.kind.value == "straggler"] == [300]  # the injected straggler, found
    assert [(f.id, f.kind, f.node, f.rank, f.step, f.z, f.slowdown, f.evidence) for f in f2] == \
        [(f.id, f.kind, f.node, f.rank, f.step, f.z, f.slowdown, f.evidence) for f in f1]
    assert s2 == s1 and len(s1) == 160
    seen1, seen2 = p1.stragglers_["train"].seen, p2.stragglers_["train"].seen  # type: ignore[attr-defined]
    assert len(seen1) == 160 and seen2 == seen1  # every step, complete, with identical ranks and times
    a1, a2 = p1.assembler, p2.assembler
    assert (a2.late_total, a2.duplicate_total, a2.foreign_total, a2.implausible_total) == \
        (a1.late_total, a1.duplicate_total, a1.foreign_total, a1.implausible_total) == (0, 0, 0, 0)


def _assembled(steps: list[AssembledStep]) -> list[tuple]:
    return [(s.job, s.step, s.ts, s.complete, s.ranks.tolist(), s.gpus.tolist(), s.nodes.tolist(),
             s.compute_s.tolist()) for s in steps]


def _block(node: int, steps: list[int], ts0: float, ranks: np.ndarray | None = None) -> StepBlock:
    ranks = np.arange(node * 4, node * 4 + 4, dtype=np.int32) if ranks is None else ranks
    return StepBlock.of([StepBatch(job="j", step=k, node=f"n{node}", ts=ts0 + k, ranks=ranks,
                                   gpus=np.arange(ranks.size, dtype=np.int16),
                                   compute_s=np.full(ranks.size, 1.0 + k / 100 + node / 1000)) for k in steps])


@pytest.mark.parametrize("case", ["replay", "foreign", "timeout", "jump", "late", "reordered", "misaligned", "newnode"])
def test_add_block_is_add_of_its_steps_in_order_on_unusual_input(case: str) -> None:
    """Replayed blocks, another node claiming ranks, a block longer than the completeness timeout, an
    implausible step jump, a late node, steps out of order: the same steps, counts and refusals."""
    blocks = [_block(0, [0, 1], 0.0), _block(1, [0, 1], 0.0), _block(0, [2, 3, 4], 0.0), _block(1, [2, 3, 4], 0.0)]
    if case == "replay":
        blocks += [blocks[2], _block(1, [3, 4, 5], 0.0), _block(0, [5], 0.0)]
    elif case == "foreign":
        blocks += [_block(2, [5, 6], 0.0, ranks=np.arange(2, 6, dtype=np.int32)), _block(0, [5, 6], 0.0),
                   _block(1, [5, 6], 0.0)]
    elif case == "timeout":
        blocks += [_block(0, list(range(5, 30)), 0.0), _block(1, [5, 6, 7], 0.0), _block(1, list(range(8, 31)), 0.0)]
    elif case == "jump":
        blocks += [_block(0, [5, 6, 10**7], 0.0), _block(1, [5, 6], 0.0)]
    elif case == "late":
        blocks += [_block(0, [5, 6], 0.0), _block(1, [5, 6], 0.0), _block(2, [3, 4, 7], 0.0), _block(0, [7], 0.0),
                   _block(1, [7], 0.0)]
    elif case == "reordered":
        blocks += [_block(0, [7, 5, 6], 0.0), _block(1, [6, 5, 7], 0.0)]
    elif case == "misaligned":  # nodes cut their intervals differently: open steps stop sharing their parts
        blocks += [_block(0, [5, 6, 7], 0.0), _block(1, [5, 6], 0.0), _block(1, [7, 8], 0.0), _block(0, [8], 0.0)]
    elif case == "newnode":  # a third node joins: the job's known ranks grow while steps are open
        blocks += [_block(0, [5, 6], 0.0), _block(1, [5, 6], 0.0), _block(2, [5, 6], 0.0), _block(0, [7, 8], 0.0),
                   _block(1, [7, 8], 0.0), _block(2, [7, 8], 0.0)]
    a, b = StepAssembler(timeout_s=5.0), StepAssembler(timeout_s=5.0)
    got_a, got_b, refused_a, refused_b = [], [], [], []
    for i, block in enumerate(blocks):
        for k, batch in enumerate(block.split()):
            got_a += a.add(batch)
            if a.refused_:
                refused_a.append((i, k))
        steps, rows = b.add_block(block)
        got_b += steps
        refused_b += [(i, k) for k in rows]
    got_a += a.drain()
    got_b += b.drain()
    assert _assembled(got_b) == _assembled(got_a) and got_a
    assert refused_b == refused_a
    assert (b.late_total, b.duplicate_total, b.foreign_total, b.implausible_total) == \
        (a.late_total, a.duplicate_total, a.foreign_total, a.implausible_total)
    if case in ("foreign", "jump"):
        assert refused_a  # the case does exercise a refusal


def test_the_hang_detector_takes_blocks_as_their_steps() -> None:
    """Sixteen nodes in blocks of six steps; one node stops after step 35, the others after step 47
    (they wait for it in the next collective): the same rank state after every call and the same
    hang finding naming the node, as with one batch a step."""
    rng = np.random.default_rng(4)
    blocks = []
    for k0 in range(0, 48, 6):
        for n in rng.permutation(16):
            if n == 3 and k0 > 30:
                continue
            steps = list(range(k0, k0 + 6))
            blocks.append(StepBlock.of([StepBatch(job="j", step=k, node=f"n{n}", ts=100.0 + 2.0 * k + 0.01 * n,
                                                  ranks=np.arange(n * 4, n * 4 + 4, dtype=np.int32),
                                                  gpus=np.arange(4, dtype=np.int16), compute_s=np.ones(4))
                                        for k in steps]))
    a, b = HangDetector(min_timeout_s=20.0), HangDetector(min_timeout_s=20.0)
    found_a, found_b = [], []
    for i in range(0, len(blocks), 9):
        chunk = blocks[i:i + 9]
        now = max(x.ts for x in chunk)
        found_a += a.check([s for x in chunk for s in x.split()], [], now)
        found_b += b.check(chunk, [], now)
        ja, jb = a.jobs_["j"], b.jobs_["j"]
        for name in ("last_step", "last_ts", "node_of", "gpu_of"):
            np.testing.assert_array_equal(getattr(jb, name), getattr(ja, name))
        assert (jb.progress_ts, jb.max_step, jb.reported, jb.nodes) == (ja.progress_ts, ja.max_step, ja.reported,
                                                                        ja.nodes)
    later = blocks[-1].ts + 200.0
    found_a += a.check([], [], later)
    found_b += b.check([], [], later)
    assert [f.id for f in found_b] == [f.id for f in found_a]
    assert [f.rank for f in found_a] == [None] and found_a[0].evidence["behind_nodes"] == ["n3"]


def test_a_block_naming_a_job_or_node_beyond_the_limits_is_rejected_as_a_batch_would_be() -> None:
    pipe = Pipeline(max_nodes=2, max_jobs=1)
    first = StepBlock.of([StepBatch(job="a", step=k, node="n0", ts=T0 + k, ranks=np.arange(4, dtype=np.int32),
                                    gpus=np.arange(4, dtype=np.int16), compute_s=np.ones(4)) for k in range(3)])
    other_job = StepBlock(job="b", node="n0", steps=first.steps, step_ts=first.step_ts, ranks=first.ranks,
                          gpus=first.gpus, compute_s=first.compute_s)
    out = pipe.feed([first, other_job])
    assert [(m.job, why.split(":")[0]) for m, why in out.rejected] == [("b", "job")]
    nodes = [StepBlock(job="a", node=f"n{i}", steps=first.steps + 3, step_ts=first.step_ts + 3,
                       ranks=first.ranks + 4 * i, gpus=first.gpus, compute_s=first.compute_s) for i in (1, 2)]
    out = pipe.feed(nodes)
    assert [(m.node, why.split(":")[0]) for m, why in out.rejected] == [("n2", "node")]
    assert pipe.over_limit_ == {"jobs": 1, "nodes": 1}


def test_check_many_is_check_of_each_step_bit_for_bit() -> None:
    """Steps scored ten at a time as one matrix: the same findings and the same detector state, to
    the last bit, as one step at a time (a persistent, a 5 % and a 2 % straggler among 1,024 ranks)."""
    ranks, steps = 1024, 240
    rng = np.random.default_rng(5)
    t = 0.6 * np.exp(0.02 * rng.standard_normal((steps, ranks)))
    t[:, 5] *= 1.1
    t[100:, 37] *= 1.05
    t[150:, 500] *= 1.02
    nodes = np.array([f"n{i // GPUS}" for i in range(ranks)], dtype=object)
    place = [AssembledStep(job="j", step=k, ts=T0 + k, ranks=np.arange(ranks, dtype=np.int32),
                           gpus=(np.arange(ranks) % GPUS).astype(np.int16), nodes=nodes, compute_s=t[k], groups=None,
                           complete=True) for k in range(steps)]
    one, many = StragglerDetector(), StragglerDetector()
    found_one = [f for k in range(steps) for f in one.check(k, place[k].ranks, t[k], placement=place[k])]
    found_many = [f for k0 in range(0, steps, 10)
                  for f in many.check_many(list(range(k0, k0 + 10)), place[0].ranks, t[k0:k0 + 10],
                                            placements=place[k0:k0 + 10])]
    assert {f.rank for f in found_one} == {5, 37, 500}
    assert [(f.id, f.z, f.slowdown, f.evidence, f.episode_ts) for f in found_many] == \
        [(f.id, f.z, f.slowdown, f.evidence, f.episode_ts) for f in found_one]
    for name, value in vars(one).items():
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(getattr(many, name), value, err_msg=name)
        else:
            assert getattr(many, name) == value, name
