"""Streaming detectors (pure ``update(batch, now) -> list``) and the runner that feeds them.

Every detector here is an estimator in scikit-learn's manner: keyword-only parameters stored by
``__init__``, checked on the first update (:class:`~fleethealth.errors.ConfigError`), running
state in attributes ending in ``_``, no I/O and no wall clock — event time comes in with the
data. ``tests/detectors/test_common.py`` runs them all through one set of checks.

**The detector contract.** Every detector has one entry point, ``update(batch, now)``: ``batch`` a
:class:`~fleethealth.detectors.batch.Batch` (step records, one job's assembled steps, telemetry, node
states, events, findings, each possibly empty, plus what the caller knows that a detector asks about:
``alive``, ``owns``, ``rack_of``), ``now`` the event time; it returns what it concluded — findings;
the node-state table the states it published; the job lifecycle its restart markers and
``interruption`` events. Each also has ``forget(jobs=…, nodes=…)`` (drop what it holds about ended
jobs and gone nodes: afterwards its state names none of them) and ``state_dict()`` / ``from_state()``
(its state as plain data, :mod:`fleethealth.detectors.state`). What the pipeline feeds each, in order:

* **an assembled step** of one job (all ranks, columnar) — one straggler detector *per job*
  (:class:`StragglerDetector`; :class:`SeedRule`, seed 000's rule, the benchmark baseline), its
  state indexed by rank: ``Batch(assembled=steps)``; then :class:`Diagnoser` ``diagnose(node, gpu)``
  and :class:`RackEpisodes` ``Batch(findings=…, rack_of=diagnoser.rack_of)``;
* **step records, events and the event-time watermark** — :class:`HangDetector`
  ``Batch(steps=…, events=…, alive=…)`` (one instance for all jobs);
* **telemetry samples and events** — the :class:`Diagnoser` (its node-state table)
  ``Batch(telemetry=…)`` or, in a job stage, ``Batch(states=…)``; :class:`HealthRules` (``ecc`` /
  ``xid`` / ``power_brake`` / ``link``) and :class:`FailurePredictor` (``failure_risk``; loads the
  shipped model on first use, needs scikit-learn) ``Batch(telemetry=…, events=…)``;
* **events** — :class:`SdcDetector` ``Batch(events=…, owns=…)`` (``sdc`` from ``sdc_check`` records);
* **step records, events and the findings above** — :class:`LifecycleTracker` (one ``interruption``
  *event* per stop of a job, with its MTTR phases): each record as it comes with
  ``Batch(conclude=False)`` (a restart it sees restarts the step assembly), then the feed's findings.

Each detector's per-kind form, ``check(...)`` (``StragglerDetector.check(step, ranks, compute_s,
groups, placement=…)`` and ``check_many``, ``HealthRules.check(telemetry, events)``, …), is what
``update`` calls, kept for tests and benchmarks that drive one detector by hand.

Bad values inside otherwise valid input have a defined behaviour (dropped and counted in a
``*_total_`` attribute); malformed calls raise :class:`~fleethealth.errors.SchemaError`.
"""

from fleethealth.detectors.diagnosis import (
    Diagnoser,
    DiagnosisResult,
    DiagnosisThresholds,
    RackEpisodes,
    diagnose_straggler,
)
from fleethealth.detectors.hang import HangDetector
from fleethealth.detectors.health import HealthRules
from fleethealth.detectors.lifecycle import LifecycleTracker
from fleethealth.detectors.predict import FailurePredictor, GpuFeatures, load_model
from fleethealth.detectors.sdc import SdcDetector
from fleethealth.detectors.straggler import SeedRule, StragglerDetector, robust_z

__all__ = [
    "SeedRule",
    "StragglerDetector",
    "robust_z",
    "HangDetector",
    "Diagnoser",
    "DiagnosisResult",
    "DiagnosisThresholds",
    "RackEpisodes",
    "diagnose_straggler",
    "HealthRules",
    "LifecycleTracker",
    "SdcDetector",
    "FailurePredictor",
    "GpuFeatures",
    "load_model",
]
