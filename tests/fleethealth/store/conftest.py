"""Records shared by the store tests: step batches over a few nodes and one straggler finding."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from fleethealth.schema import Diagnosis, Finding, FindingKind, StepBatch


def _batches(job: str = "train-1", steps: int = 5, nodes: int = 3, gpus: int = 8) -> list[StepBatch]:
    rng = np.random.default_rng(7)
    return [StepBatch(job=job, step=s, node=f"n{n:04d}", ts=1_700_000_000.0 + 2.0 * s,
                      ranks=np.arange(n * gpus, (n + 1) * gpus, dtype=np.int32),
                      gpus=np.arange(gpus, dtype=np.int16), compute_s=rng.lognormal(0.7, 0.02, gpus),
                      groups=None if n else np.zeros(gpus, dtype=np.int32))
            for s in range(steps) for n in range(nodes)]


def _finding(node: str = "n0013", step: int = 199, kind: FindingKind = FindingKind.STRAGGLER) -> Finding:
    return Finding(kind=kind, node=node, ts=1_700_000_398.123456, job="train-1", gpu=3, rank=107, step=step,
                   diagnosis=Diagnosis.NODE_THERMAL if kind is FindingKind.STRAGGLER else None,
                   z=7.25, slowdown=0.2, detector="straggler", evidence={"temp_c": 91.5, "why": ["HW_THERMAL"]})


@pytest.fixture
def make_batches() -> Callable[..., list[StepBatch]]:
    """``make_batches(job, steps, nodes, gpus)``: one batch per (step, node), node 0 with rank groups."""
    return _batches


@pytest.fixture
def make_finding() -> Callable[..., Finding]:
    """``make_finding(node, step, kind)``: a finding with every optional field set."""
    return _finding
