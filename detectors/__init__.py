"""Streaming detectors (pure ``update(...) -> list[Finding]``) and the runner that feeds them.

Every detector here is an estimator in scikit-learn's manner: keyword-only parameters stored by
``__init__``, checked on the first ``update`` (:class:`~fleethealth.errors.ConfigError`), running
state in attributes ending in ``_``, no I/O and no wall clock — event time comes in with the
data. ``tests/detectors/test_common.py`` runs them all through one set of checks.

What the runner calls, per input:

* **an assembled step** of one job (all ranks, columnar) — one straggler detector *per job*
  (its state is indexed by rank)::

      findings = straggler.update(step.step, step.ranks, step.compute_s, step.groups,
                                  placement=step)                        # StragglerDetector()
      # each finding already names its job, node, GPU and time; diagnose it once telemetry caught up:
      res = diagnoser.diagnose(f.node, f.gpu)                            # Diagnoser()
      f = dataclasses.replace(f, diagnosis=res.diagnosis, evidence={**f.evidence, **res.evidence})
      findings = rack_episodes.update(findings, diagnoser.rack_of)      # RackEpisodes()

  ``SeedRule()`` has the same interface (seed 000's rule, the benchmark baseline).
* **step batches, events and the event-time watermark** — ``hang.update(batches, events, now, alive=...)``
  (:class:`HangDetector`; one instance for all jobs).
* **telemetry samples and events** — ``diagnoser.observe(samples)``;
  ``health.update(samples, events)`` (:class:`HealthRules`: ``ecc`` / ``xid`` /
  ``power_brake`` / ``link``); ``predictor.update(samples, events)`` (:class:`FailurePredictor`:
  ``failure_risk``; loads the shipped model on first use, needs scikit-learn).
* **events** — ``sdc.update(events)`` (:class:`SdcDetector`: ``sdc`` from ``sdc_check`` records).
* **step batches, events and the findings above** — ``lifecycle.update(batches, events, now,
  findings=...)`` (:class:`LifecycleTracker`: one ``interruption`` *event* per stop of a job, with
  its MTTR phases, from ``job_start`` / ``job_exit``, step progress and the hang and Xid findings).

Every detector also has ``forget(jobs=…, nodes=…)`` (drop what it holds about ended jobs and gone
nodes: afterwards its state names none of them) and ``state_dict()`` / ``from_state()`` (its state as
plain data, :mod:`fleethealth.detectors.state`).

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
