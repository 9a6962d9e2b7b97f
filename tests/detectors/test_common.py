"""One set of checks for every detector (scikit-learn's common-test habit), through the one entry point
of the detector contract, ``update(batch, now)`` (:class:`~fleethealth.detectors.batch.Batch`): builds
with defaults, is deterministic for the same input, handles NaN / empty / one-rank input with a clear
error or a defined result, never mutates its input, survives a round trip of its state mid-stream with
the same results afterwards, and forgets the jobs and nodes it is told to. Every detector class of the
detector modules is a case here or named as no detector (with why), so a new one cannot escape."""

from __future__ import annotations

import ast
import copy
import dataclasses
import importlib
import inspect
import json
import math
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import fleethealth.detectors as detectors
from fleethealth.detectors import (
    Diagnoser,
    FailurePredictor,
    GpuFeatures,
    HangDetector,
    HealthRules,
    LifecycleTracker,
    RackEpisodes,
    SdcDetector,
    SeedRule,
    StragglerDetector,
)
from fleethealth.detectors.assembly import AssembledStep
from fleethealth.detectors.batch import EMPTY, Batch
from fleethealth.detectors.nodestate import NodeStates
from fleethealth.detectors.state import Stateful
from fleethealth.errors import SchemaError
from fleethealth.payloads.job import job_exit_event, job_start_event
from fleethealth.payloads.sdc_check import sdc_check_event
from fleethealth.schema import (
    ClockReason,
    Diagnosis,
    Event,
    EventKind,
    Finding,
    FindingKind,
    StepBatch,
    Telemetry,
    decode,
    encode,
)

Call = tuple[Batch, float]


@dataclass(frozen=True)
class Case:
    """One detector: ``make()`` builds it with defaults; each input is a list of ``(batch, now)`` calls of
    its ``update``."""

    name: str
    make: Callable[[], Any]
    valid: Callable[[], list[Call]]
    nan: Callable[[], list[Call]]
    one: Callable[[], list[Call]]
    nan_raises: bool = False
    expect_valid: bool = True  # the valid input must produce at least one result
    expect_one: bool = False
    lazy: bool = True  # running state (attributes ending in ``_``) is made on the first update, not by __init__
    named: bool = True  # its state names the jobs and nodes of its input (a straggler detector's is by rank)

    @staticmethod
    def feed(det: Any, call: Call) -> list:
        return det.update(*call)


# ---------------------------------------------------------------- inputs
GPUS = 8


def _steps(n_steps: int, n: int = 64, slow: float = 0.3, nan: bool = False, run: int = 5) -> list[Call]:
    """One job's steps on ``n`` ranks (8 a node), rank 5 slow; ``run`` steps completed together per
    update (the block stream's columnar path)."""
    rng = np.random.default_rng(1)
    ranks = np.arange(n, dtype=np.int32)
    nodes = np.array([f"n{r // GPUS:04d}" for r in range(n)], dtype=object)
    steps = []
    for s in range(n_steps):
        t = 2.0 * np.exp(0.02 * rng.standard_normal(n))
        t[5 % n] *= 1 + slow
        if nan:
            t[7] = np.nan
        steps.append(AssembledStep(job="j", step=s, ts=100.0 + 2.0 * s, ranks=ranks,
                                   gpus=(ranks % GPUS).astype(np.int16), nodes=nodes, compute_s=t, groups=None,
                                   complete=True))
    return [(Batch(assembled=steps[k:k + run]), steps[min(k + run, n_steps) - 1].ts) for k in range(0, n_steps, run)]


def _batch(step: int, ts: float, ranks: list[int]) -> StepBatch:
    r = np.asarray(ranks, dtype=np.int32)
    return StepBatch(job="j", step=step, node=f"n{r[0] // 8:04d}", ts=ts, ranks=r, gpus=(r % 8).astype(np.int16),
                     compute_s=np.full(r.size, 1.6))


def _hang_calls(ranks: list[int]) -> list[Call]:
    calls: list[Call] = [(Batch(steps=[_batch(s, 100.0 + 2 * s, ranks)]), 100.0 + 2 * s) for s in range(10)]
    calls.append((Batch(steps=[_batch(10, 120.0, ranks[1:])] if len(ranks) > 1 else []), 120.0))
    calls.append((EMPTY, 1000.0))
    return calls


def _sample(ts: float, n_gpu: int = 4, nan: bool = False, brake: bool = False, dbe: float = 0.0,
            node: str = "n0001", temp: float = 66.0) -> Telemetry:
    if nan:
        return Telemetry.from_columns(node, "r00", ts, np.arange(n_gpu))
    cols = {"ecc_dbe_volatile": np.full(n_gpu, 0.0), "clock_reasons": np.zeros(n_gpu), "temp_c": np.full(n_gpu, temp),
            "retired_sbe": np.zeros(n_gpu), "retired_dbe": np.zeros(n_gpu), "ecc_sbe_volatile": np.zeros(n_gpu)}
    cols["ecc_dbe_volatile"][0] = dbe
    if brake:
        cols["clock_reasons"][0] = int(ClockReason.HW_POWER_BRAKE)
    return Telemetry.from_columns(node, "r00", ts, np.arange(n_gpu), nic_util=0.3, **cols)


def _xid(ts: float, code: int = 79) -> Event:
    return Event(node="n0001", ts=ts, kind=EventKind.XID, gpu=0, code=code)


def _health_valid() -> list[Call]:
    return [(Batch(telemetry=[_sample(0.0)]), 0.0),
            (Batch(telemetry=[_sample(60.0, dbe=2.0)], events=[_xid(61.0)]), 61.0)]


def _sdc(ts: float, passed: bool, **kw: Any) -> Event:
    return sdc_check_event(ts=ts, check="selfcheck", passed=passed, node="n0001", job="j", rank=3, gpu=3, step=50,
                           **kw)


def _nan_sdc() -> Event:
    return Event(node="n0001", ts=1.0, kind=EventKind.SDC_CHECK, job="j", rank=3, gpu=3, step=50,
                 data={"check": "selfcheck", "passed": False, "duration_s": math.nan})


def _predict_calls(n_gpu: int = 4, nan: bool = False) -> list[Call]:
    calls = []
    for i in range(40):
        s = _sample(600.0 * i, n_gpu=n_gpu, nan=nan)
        if not nan:
            s.columns["ecc_sbe_volatile"][0] = 40.0 * i * i
            s.columns["retired_sbe"][0] = i // 4
            s.columns["remap_pending"] = np.where(np.arange(n_gpu) == 0, float(i > 20), 0.0)
        calls.append((Batch(telemetry=[s]), s.ts))
    return calls


def _env(node: str, ts: float, slowdown: float = 0.1) -> Finding:
    return Finding(kind=FindingKind.STRAGGLER, node=node, ts=ts, job="j", rank=8, step=3, slowdown=slowdown,
                   diagnosis=Diagnosis.ENVIRONMENTAL, detector="straggler.cusum")


_RACK = {"n0001": "r00", "n0002": "r00"}.get


def _rack_calls(findings: list[Finding]) -> list[Call]:
    return [(Batch(findings=findings, rack_of=_RACK), max((f.ts for f in findings), default=0.0))]


def _life_calls(ranks: list[int]) -> list[Call]:
    """A run started, 10 steps, a failed exit, restarted from step 5, on past its old step 9."""
    calls: list[Call] = [(Batch(events=[job_start_event(ts=99.0, world=len(ranks), node="n0000", job="j")]), 99.0)]
    calls += [(Batch(steps=[_batch(s, 100.0 + 2 * s, ranks)]), 100.0 + 2 * s) for s in range(10)]
    calls.append((Batch(events=[job_exit_event(ts=125.0, status="failed", last_step=9, node="n0000", job="j")]), 125.0))
    calls.append((Batch(events=[job_start_event(ts=200.0, world=len(ranks), first_step=5, node="n0000", job="j")]),
                  200.0))
    calls += [(Batch(steps=[_batch(s, 200.0 + 2 * s, ranks)]), 200.0 + 2 * s) for s in range(5, 12)]
    return calls


def _table_calls(n_gpu: int = 8, nodes: int = 4, nan: bool = False) -> list[Call]:
    """A rack's nodes every 2 s for 2 minutes; node 1 warms by 0.5 °C a sample from the middle on."""
    calls = []
    for k in range(60):
        ts = 1000.0 + 2.0 * k
        samples = [_sample(ts, n_gpu=n_gpu, nan=nan, node=f"n{i:04d}", temp=66.0 + (0.5 * (k - 30) if i == 1 and k > 30
                                                                                   else 0.0)) for i in range(nodes)]
        calls.append((Batch(telemetry=samples), ts))
    return calls


CASES = [
    Case("SeedRule", SeedRule, lambda: _steps(120), lambda: _steps(120, nan=True), lambda: _steps(5, n=1),
         named=False),
    Case("StragglerDetector", StragglerDetector, lambda: _steps(20), lambda: _steps(20, nan=True),
         lambda: _steps(5, n=1), named=False),
    Case("HangDetector", HangDetector, lambda: _hang_calls(list(range(16))), lambda: [(EMPTY, math.nan)],
         lambda: _hang_calls([0]), nan_raises=True, expect_one=False),
    Case("HealthRules", HealthRules, _health_valid, lambda: [(Batch(telemetry=[_sample(0.0, nan=True)]), 0.0)],
         lambda: [(Batch(telemetry=[_sample(0.0, n_gpu=1, brake=True)]), 0.0)], expect_one=True),
    Case("SdcDetector", SdcDetector, lambda: [(Batch(events=[_sdc(1.0, True), _sdc(2.0, False)]), 2.0)],
         lambda: [(Batch(events=[_nan_sdc()]), 1.0)],
         lambda: [(Batch(events=[_sdc(1.0, False, classification="transient")]), 1.0)], expect_one=True),
    Case("GpuFeatures", GpuFeatures, _predict_calls, lambda: _predict_calls(nan=True), lambda: _predict_calls(n_gpu=1),
         expect_one=True),
    Case("FailurePredictor", FailurePredictor, _predict_calls, lambda: _predict_calls(nan=True),
         lambda: _predict_calls(n_gpu=1), expect_one=True),
    Case("RackEpisodes", RackEpisodes, lambda: _rack_calls([_env("n0001", 10.0), _env("n0002", 11.0)]),
         lambda: _rack_calls([_env("n0001", math.nan)]), lambda: _rack_calls([_env("n0001", 10.0)]),
         nan_raises=True, expect_one=True),
    Case("LifecycleTracker", LifecycleTracker, lambda: _life_calls(list(range(16))), lambda: [(EMPTY, math.nan)],
         lambda: _life_calls([0]), nan_raises=True, expect_one=True),
    Case("NodeStates", NodeStates, _table_calls, lambda: _table_calls(nan=True), lambda: _table_calls(n_gpu=1, nodes=1),
         expect_one=True, lazy=False),
    Case("Diagnoser", Diagnoser, _table_calls, lambda: _table_calls(nan=True), lambda: _table_calls(n_gpu=1, nodes=1),
         expect_one=True),
]
IDS = [c.name for c in CASES]

NOT_DETECTORS = {
    "Pipeline": "the composition of every detector (fed messages, not batches; its own snapshot tests)",
    "StepAssembler": "step assembly: joins step records into steps for the detectors (its own tests)",
    "EventTimeBuffer": "the runner's reorder buffer: holds records until the watermark passes them",
}
"""Stateful classes of the detector modules that are not detectors, with why."""


def _run(case: Case, calls: list[Call]) -> list:
    det = case.make()
    out = []
    for call in calls:
        out += case.feed(det, call)
    return out


def _canon(results: list) -> list:
    """Results as JSON text (NaN, a field not reported, as ``NaN``: NaN != NaN as a float)."""
    return [json.dumps(r.to_obj(), sort_keys=True) if hasattr(r, "to_obj")
            else (r.node, r.ts, r.gpu.tolist(), np.where(np.isnan(r.X), None, r.X.round(9)).tolist())
            for r in results]


def _detector_classes() -> dict[str, type]:
    """Every class defined in a module of the detector package that keeps state (:class:`Stateful`) or
    has an ``update``, by name (the straggler detectors' private base left out)."""
    found: dict[str, type] = {}
    for info in pkgutil.iter_modules(detectors.__path__):
        module = importlib.import_module(f"{detectors.__name__}.{info.name}")
        for name, cls in vars(module).items():
            if (isinstance(cls, type) and cls.__module__ == module.__name__ and not name.startswith("_")
                    and cls is not Stateful
                    and (issubclass(cls, Stateful) or callable(getattr(cls, "update", None)))):
                found[name] = cls
    return found


def test_every_detector_is_a_case_so_none_escapes_the_contract():
    """Scanning the modules: a detector class added anywhere in the package must be added here."""
    classes = _detector_classes()
    assert set(classes) == set(IDS) | set(NOT_DETECTORS), (
        f"not covered: {sorted(set(classes) - set(IDS) - set(NOT_DETECTORS))}; "
        f"gone: {sorted((set(IDS) | set(NOT_DETECTORS)) - set(classes))}")
    exported = {n for n in detectors.__all__ if isinstance(getattr(detectors, n), type)
                and hasattr(getattr(detectors, n), "update")}
    assert exported <= set(IDS)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_has_the_contract(case):
    """``update(batch, now)``, ``forget(jobs, nodes)``, ``state_dict()`` / ``from_state()``; ``update`` of
    anything but a :class:`Batch` (a caller of the per-kind form) is a ``TypeError`` naming ``check``."""
    cls = type(case.make())
    assert issubclass(cls, Stateful)
    assert list(inspect.signature(cls.update).parameters) == ["self", "batch", "now"]
    assert list(inspect.signature(cls.forget).parameters) == ["self", "jobs", "nodes"]
    assert callable(cls.state_dict) and callable(cls.from_state)
    with pytest.raises(TypeError, match=rf"{cls.__name__}\.update takes a Batch.*{cls.__name__}\.check"):
        case.make().update([], 0.0)


_QUERIES = {"rack_of", "diagnose", "latest_", "racks_", "step_timeout", "timeout_s", "takes_whole"}
"""What the pipeline may ask a detector besides ``update`` and ``forget``: questions, no input fed."""


def test_the_pipeline_feeds_each_detector_through_update_alone():
    """Read from ``detectors/pipeline.py``'s source: every method it calls on a part (``self.hang.…``) or a
    job's straggler detector is ``update``, ``forget`` or a question; ``forget_idle`` is the lifecycle's
    forgetting by age."""
    from fleethealth.detectors import pipeline

    tree = ast.parse(Path(pipeline.__file__).read_text())
    parts = {"hang", "diagnoser", "rack_episodes", "health", "sdc", "predictor", "lifecycle"}
    called: set[tuple[str, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) \
                and isinstance(node.value.value, ast.Name) and node.value.value.id == "self" \
                and node.value.attr in parts:
            called.add((node.value.attr, node.attr))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "detector":
            called.add(("straggler", node.attr))
    fed = {(part, name) for part, name in called if name not in _QUERIES | {"update", "forget", "forget_idle"}}
    assert not fed, f"the pipeline feeds detectors other than through update: {sorted(fed)}"
    for part in parts | {"straggler"}:
        assert (part, "update") in called, f"the pipeline never updates its {part}"


def test_exported_names():
    for name in detectors.__all__:
        assert getattr(detectors, name) is not None


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_builds_with_defaults_and_only_stores_params(case):
    det = case.make()
    if case.lazy:
        assert not [k for k in vars(det) if k.endswith("_") and not k.startswith("_")]
    out = _run(case, case.valid())
    if case.expect_valid:
        assert out, f"{case.name} found nothing in its valid input"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_deterministic_for_the_same_input(case):
    assert _canon(_run(case, case.valid())) == _canon(_run(case, case.valid()))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_empty_input_is_a_defined_no_op(case):
    det = case.make()
    assert case.feed(det, (EMPTY, 0.0)) == []


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_nan_input_is_a_clear_error_or_defined(case):
    if case.nan_raises:
        with pytest.raises(SchemaError):
            _run(case, case.nan())
        return
    out = _run(case, case.nan())
    for r in out:  # whatever is produced carries no NaN from the input
        if isinstance(r, Finding):
            assert r.z is None or math.isfinite(r.z)
            assert r.rank != 7  # the rank whose time was NaN is never a straggler


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_one_rank_input(case):
    out = _run(case, case.one())
    if case.expect_one:
        assert out
    elif not case.named:
        assert out == []  # one rank has no peers: nothing to compare, never a straggler


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_findings_survive_the_wire(case):
    """Every finding encodes to JSON and decodes to the same object (no NumPy scalars in evidence)."""
    for f in _run(case, case.valid()) + _run(case, case.one()):
        if isinstance(f, Finding):
            f = dataclasses.replace(f, node=f.node or "n0000")  # stragglers leave the node to the runner
            assert decode(Finding, encode(f)).to_obj() == f.to_obj()
            assert json.loads(json.dumps(f.evidence)) == f.evidence


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_input_not_mutated(case):
    calls = case.valid()
    before = copy.deepcopy(calls)
    _run(case, calls)
    for a, b in zip(calls, before, strict=True):
        assert _same(a, b)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Batch):
        return all(_same(getattr(a, name), getattr(b, name)) for name in Batch._fields)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b, equal_nan=True)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, AssembledStep):
        return a.step == b.step and _same(a.compute_s, b.compute_s) and _same(a.ranks, b.ranks)
    if isinstance(a, Telemetry):
        return a.ts == b.ts and all(_same(a.columns[k], b.columns[k]) for k in a.columns)
    if isinstance(a, StepBatch):
        return a.step == b.step and _same(a.compute_s, b.compute_s) and _same(a.ranks, b.ranks)
    return a == b


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_state_round_trip_gives_the_same_findings(case):
    """``state_dict()`` mid-stream, through a signed snapshot's bytes, and ``from_state`` into a detector
    built from the configuration: the rest of the input gives the same results as the original."""
    from fleethealth.detectors.snapshot import Snapshots
    from fleethealth.detectors.state import Stateful

    calls = case.valid()
    cut = len(calls) // 2
    original = case.make()
    assert isinstance(original, Stateful)
    for call in calls[:cut]:
        case.feed(original, call)
    snaps = Snapshots(key=b"k" * 32)
    state, _ = snaps.open(snaps.seal(original.state_dict(), {}))
    restored = type(original).from_state(state, like=case.make())
    assert type(restored) is type(original) and restored is not original
    before, after = [], []
    for call in calls[cut:]:
        before += case.feed(original, call)
        after += case.feed(restored, call)
    assert _canon(after) == _canon(before)
    if case.expect_valid:
        assert _canon(_run(case, calls)) == _canon(_run(case, calls[:cut])) + _canon(after)


def _names(value: Any, jobs: set[str], nodes: set[str]) -> None:
    """The job and node names ``value`` (a call, or anything in one) carries."""
    if isinstance(value, Batch):
        for part in (value.steps, value.assembled, value.telemetry, value.states, value.events, value.findings):
            _names(part, jobs, nodes)
        return
    if isinstance(value, list | tuple):
        for v in value:
            _names(v, jobs, nodes)
        return
    for attr, into in (("job", jobs), ("node", nodes)):
        name = getattr(value, attr, None)
        if isinstance(name, str) and name:
            into.add(name)


def _strings(tree: Any) -> set[str]:
    """Every string in a state tree, dictionary keys included."""
    if isinstance(tree, str):
        return {tree}
    if isinstance(tree, dict):
        return {s for k, v in tree.items() for s in (*_strings(k), *_strings(v))}
    if isinstance(tree, list | tuple):
        return {s for v in tree for s in _strings(v)}
    return set()


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forget_leaves_no_trace_of_the_jobs_and_nodes_forgotten(case):
    """``forget(jobs, nodes)`` of every job and node the input named: the state names none of them (once
    the outputs the forgetting concluded are out), so a detector's memory is bounded by what is live."""
    calls = case.valid()
    jobs: set[str] = set()
    nodes: set[str] = set()
    _names(calls, jobs, nodes)
    det = case.make()
    for call in calls:
        case.feed(det, call)
    seen = _strings(det.state_dict().tree)
    assert (jobs | nodes) <= seen or not case.named  # it did hold them
    det.forget(jobs=jobs, nodes=nodes)
    case.feed(det, (EMPTY, calls[-1][1]))
    left = _strings(det.state_dict().tree) & (jobs | nodes)
    assert not left, f"{case.name} still holds {sorted(left)} after forgetting them"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forgetting_what_it_never_saw_changes_nothing(case):
    calls = case.valid()
    det = case.make()
    out = []
    for i, call in enumerate(calls):
        if i == len(calls) // 2:
            det.forget(jobs=["another-job"], nodes=["another-node.dc1.example"])
        out += case.feed(det, call)
    assert _canon(out) == _canon(_run(case, calls))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forget_refuses_a_lone_name(case):
    det = case.make()
    with pytest.raises(TypeError, match="collection of names"):
        det.forget(jobs="j")
    with pytest.raises(TypeError, match="collection of names"):
        det.forget(nodes="n0001")
