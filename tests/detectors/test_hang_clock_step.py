"""The hang detector and one node's clock stepped back an hour, without a broker (the end-to-end form is
``test_clock_step.py``): the stepped node's stretch of steps reaches the pipeline first, an hour ahead of
the other nodes' steps in event time; those, at lower steps from ranks the job has never seen, are the
rest of the job, not the job resuming after an hour's whole-job hang."""

from __future__ import annotations

import numpy as np

from fleethealth.detectors.pipeline import Pipeline
from fleethealth.schema import FindingKind, StepBatch, Telemetry

NODES = [f"host-{c}" for c in "abcd"]
GPUS = 4
STEPPED = "host-c"


def _step(node: str, k: int, ts: float) -> StepBatch:
    i = NODES.index(node)
    return StepBatch(job="clock-job", step=k, node=node, ts=ts,
                     ranks=np.arange(i * GPUS, (i + 1) * GPUS, dtype=np.int32),
                     gpus=np.arange(GPUS, dtype=np.int16), compute_s=np.full(GPUS, 1.9))


def _sample(node: str, ts: float) -> Telemetry:
    return Telemetry.from_columns(node, "rack-1", ts, list(range(GPUS)), temp_c=[55.0] * GPUS,
                                  util_pct=[97.0] * GPUS, power_w=[650.0] * GPUS)


def _kinds(out) -> list[FindingKind]:  # noqa: ANN001
    return [f.kind for f in out.findings]


def test_a_stretch_an_hour_behind_first_then_the_rest_of_the_job_is_no_hang() -> None:
    t0 = 1_790_000_000.0
    pipeline = Pipeline()
    found: list[FindingKind] = []
    # the stepped node's steps 30-59 (and samples), its clock an hour behind, released first as late data
    found += _kinds(pipeline.feed([m for k in range(30, 60) for m in (_step(STEPPED, k, t0 + 2 * k - 3600),
                                                                      _sample(STEPPED, t0 + 2 * k - 3600))]))
    # then every node at its true time; the stepped node's clock set right from step 60
    for k in range(90):
        if 30 <= k < 60:
            batch = [m for n in NODES if n != STEPPED for m in (_step(n, k, t0 + 2 * k), _sample(n, t0 + 2 * k))]
        else:
            batch = [m for n in NODES for m in (_step(n, k, t0 + 2 * k), _sample(n, t0 + 2 * k))]
        found += _kinds(pipeline.feed(batch))
    found += _kinds(pipeline.drain())
    assert FindingKind.HANG not in found, found


def test_a_level_hang_of_known_ranks_is_still_found() -> None:
    """The same job really stopped for an hour, every rank at step 59, its nodes alive: one hang."""
    t0 = 1_790_000_000.0
    pipeline = Pipeline()
    found: list[FindingKind] = []
    for k in range(60):
        found += _kinds(pipeline.feed([m for n in NODES for m in (_step(n, k, t0 + 2 * k), _sample(n, t0 + 2 * k))]))
    for s in range(0, 3600, 30):  # an hour of telemetry and no step
        found += _kinds(pipeline.feed([_sample(n, t0 + 120 + s) for n in NODES]))
    assert found.count(FindingKind.HANG) == 1, found
