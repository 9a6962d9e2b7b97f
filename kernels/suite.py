"""The self-test suites: which known-answer tests run, at which sizes, on which devices.

``quick`` fits in a minute on a two-core CPU and in seconds on a GPU (launch checks, Slurm's
health check); ``full`` is the sweep of an idle or quarantined node, and only a passing ``full``
suite may return a quarantined node to the pool. Each suite is a list of test groups
(:data:`GROUPS`): ``gemm_exact_fp32`` … ``gemm_repeat_fp32`` give one result each, ``memory`` one
per pattern, ``collective`` one per collective (across CPU processes on ``cpu``, across every
local GPU with NCCL when the run covers two or more GPUs).

:func:`run_suite` runs the plan, stamps each result with its completion time, and lets a
:class:`~fleethealth.kernels.baseline.BaselineBook` turn a correct but slow result into ``slow``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from fleethealth.errors import ConfigError
from fleethealth.kernels.abft import run_abft
from fleethealth.kernels.backend import Backend, Precision
from fleethealth.kernels.baseline import BaselineBook
from fleethealth.kernels.collective import run_gloo, run_nccl
from fleethealth.kernels.faults import Fault
from fleethealth.kernels.gemm import run_exact, run_repeat
from fleethealth.kernels.memory import Pattern, run_memory
from fleethealth.kernels.results import SelfTestResult

__all__ = ["SUITES", "GROUPS", "Step", "SuiteSizes", "SIZES", "plan", "expected_tests", "run_suite"]

SUITES = ("quick", "full")
GROUPS = ("gemm_exact_fp32", "gemm_exact_fp16", "gemm_exact_bf16", "gemm_abft_fp32", "gemm_abft_bf16",
          "gemm_repeat_fp32", "memory", "collective")

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class SuiteSizes:
    """Problem sizes of one suite on one kind of device. ``memory`` is bytes on a CPU and a
    fraction of free device memory on a GPU; ``ranks`` is the CPU collective's process count."""

    gemm: int
    abft: int
    repeat: int
    iters: int
    memory: float
    elements: int
    ranks: int = 3


SIZES: dict[tuple[str, bool], SuiteSizes] = {
    ("quick", False): SuiteSizes(gemm=384, abft=512, repeat=384, iters=1, memory=16 << 20, elements=1 << 16),
    ("full", False): SuiteSizes(gemm=1024, abft=2048, repeat=1024, iters=2, memory=256 << 20, elements=1 << 20),
    ("quick", True): SuiteSizes(gemm=4096, abft=4096, repeat=4096, iters=5, memory=0.05, elements=1 << 24),
    ("full", True): SuiteSizes(gemm=8192, abft=8192, repeat=8192, iters=10, memory=0.5, elements=1 << 26),
}

_QUICK = ("gemm_exact_fp32", "gemm_exact_bf16", "gemm_abft_fp32", "gemm_repeat_fp32", "memory", "collective")


@dataclass(frozen=True)
class Step:
    """One test group on one device (``devices`` lists every device for a collective)."""

    group: str
    device: str
    devices: tuple[str, ...]


def plan(suite: str, devices: Sequence[str], *, only: Sequence[str] | None = None) -> list[Step]:
    """The steps of ``suite`` over ``devices``; ``only`` keeps just the named groups."""
    if suite not in SUITES:
        raise ConfigError(f"unknown suite {suite!r} (known: {', '.join(SUITES)})")
    if not devices:
        raise ConfigError("no device to test")
    if only:
        unknown = sorted(set(only) - set(GROUPS))
        if unknown:
            raise ConfigError(f"unknown test {unknown[0]!r} (known: {', '.join(GROUPS)})")
    groups = [g for g in (_QUICK if suite == "quick" else GROUPS) if not only or g in only]
    gpus = tuple(d for d in devices if d != "cpu")
    steps = []
    for device in devices:
        for group in groups:
            if group != "collective":
                steps.append(Step(group, device, (device,)))
    if "collective" in groups:
        if "cpu" in devices:
            steps.append(Step("collective", "cpu", ("cpu",)))
        if len(gpus) >= 2:
            steps.append(Step("collective", gpus[0], gpus))
    return steps


_GROUP_TESTS = {"memory": tuple(f"memory_{p.value}" for p in Pattern),
                "collective": ("collective_all_reduce", "collective_all_gather")}


def expected_tests(suite: str, devices: Sequence[str]) -> set[tuple[str, str]]:
    """Every (test, device) result a complete run of ``suite`` on ``devices`` produces; a GPU
    collective's device is ``cuda:0,1,…`` (all the GPUs it spans)."""
    out = set()
    for step in plan(suite, devices):
        device = step.device if len(step.devices) == 1 else "cuda:" + ",".join(d.split(":", 1)[1] for d in step.devices)
        for test in _GROUP_TESTS.get(step.group, (step.group,)):
            out.add((test, device))
    return out


def _run_step(step: Step, suite: str, fault: Fault | None, backends: dict[str, Backend]) -> list[SelfTestResult]:
    if step.device not in backends:
        backends[step.device] = Backend.for_device(step.device)
    backend = backends[step.device]
    sizes = SIZES[(suite, backend.is_gpu)]
    group = step.group
    common: dict[str, Any] = {"suite": suite, "fault": fault}
    if group.startswith("gemm_exact_"):
        n = sizes.gemm
        return [run_exact(backend, n, n, n, precision=Precision(group.rsplit("_", 1)[1]), iters=sizes.iters,
                          **common)]
    if group.startswith("gemm_abft_"):
        n = sizes.abft
        return [run_abft(backend, n, n, n, precision=Precision(group.rsplit("_", 1)[1]), iters=sizes.iters,
                         **common)]
    if group == "gemm_repeat_fp32":
        n = sizes.repeat
        return [run_repeat(backend, n, n, n, runs=3, **common)]
    if group == "memory":
        nbytes = int(sizes.memory if not backend.is_gpu else sizes.memory * backend.free_memory_bytes())
        return run_memory(backend, nbytes, **common)
    if group == "collective":
        if backend.is_gpu:
            return run_nccl([int(d.split(":", 1)[1]) for d in step.devices], elements=sizes.elements,
                            model=backend.model, **common)
        return run_gloo(sizes.ranks, elements=sizes.elements, model=backend.model, **common)
    raise ConfigError(f"unknown test group {group!r}")


def run_suite(suite: str, devices: Sequence[str], *, fault: Fault | None = None,
              baselines: BaselineBook | None = None, only: Sequence[str] | None = None,
              progress: Progress | None = None, clock: Callable[[], float] = time.time) -> list[SelfTestResult]:
    """Run every step of ``suite`` on ``devices``; results in plan order, judged against baselines.

    ``progress(label, done, total)`` is called before each step and once at the end; ``clock``
    stamps each result's ``ts`` (its completion time, strictly increasing within the run).
    """
    steps = plan(suite, devices, only=only)
    book = baselines if baselines is not None else BaselineBook()
    backends: dict[str, Backend] = {}
    results: list[SelfTestResult] = []
    last = -1.0
    for done, step in enumerate(steps):
        if progress is not None:
            progress(f"{step.group} on {step.device}", done, len(steps))
        for result in _run_step(step, suite, fault, backends):
            last = max(float(clock()), last + 1e-6)  # distinct times give distinct event ids
            results.append(book.judge(replace(result, ts=last)))
    if progress is not None:
        progress("done", len(steps), len(steps))
    return results
