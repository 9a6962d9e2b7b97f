"""The in-job library: runs inside training processes, imports nothing heavier than torch and the wire format.

Names are resolved lazily, so ``import fleethealth.injob`` (and the torch-free modules: reporter,
watermark, invariants, replay, results, watchdog, timer, inbox, ckptcost, advisor) work on a node
without torch; the torch modules (digest, recompute, selfcheck, crossrank, distributed, guard,
instrument) load on first use of one of their names. The check records on the wire live in
:mod:`fleethealth.payloads`, which the streaming side reads too; they are re-exported here.

- :func:`instrument` — times each step's local compute on the right side of the collective (plain,
  DDP, FSDP2, gradient accumulation; CUDA events on a GPU) and reports it through a :class:`StepTimer`.
- :class:`StepTimer` — pre-collective compute time per step, to the node probe.
- :class:`SdcGuard` — bitwise self-check, cross-rank replay, invariants, watermark (seed 000 §7, R3, R6).
- :class:`HangWatchdog` — progress watchdog with faulthandler stack dumps.
- :class:`Watermark`, :func:`retention`, :func:`rollback_target` — verification watermark (R6).
- :class:`JobLife` — ``job_start`` / ``job_exit`` events of the run.
- :class:`RollbackInbox` — the policy's ``rollback`` for this job, relayed by the node's probe, read without blocking.
- :class:`FaultInjector` — a transient or deterministic fault, off unless a loop attaches one (demos, drills).
- :class:`CheckpointValidator` — each checkpoint validated after its save in a background thread
  (:mod:`fleethealth.injob.ckptcheck`: shards, digests, a CPU test load, norms), ``checkpoint_validated`` events.
- :class:`SaveTimer`, :func:`report_checkpoint_cost` — how long each checkpoint save blocked training and
  how long its background write took (``checkpoint_cost``).
- :func:`recommended_checkpoint_interval`, :class:`IntervalAdvisor` — the service's checkpoint interval for
  this job from its measured failure rate and costs, polled in the background, read without waiting.
"""

from __future__ import annotations

from fleethealth.lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    # torch-free
    "StepTimer": "timer",
    "TimerStats": "timer",
    "CheckKind": "fleethealth.payloads.sdc_check",
    "Classification": "fleethealth.payloads.sdc_check",
    "classify": "fleethealth.payloads.sdc_check",
    "SdcCheck": "fleethealth.payloads.sdc_check",
    "sdc_check_event": "fleethealth.payloads.sdc_check",
    "HangReport": "fleethealth.payloads.hang_report",
    "hang_report_event": "fleethealth.payloads.hang_report",
    "CheckpointRecord": "fleethealth.payloads.checkpoint",
    "checkpoint_event": "fleethealth.payloads.checkpoint",
    "rollback_target": "fleethealth.payloads.rollback",
    "event_datagram": "fleethealth.wire",
    "Reporter": "reporter",
    "JobLife": "lifecycle",
    "ExitStatus": "fleethealth.payloads.job",
    "job_start_event": "fleethealth.payloads.job",
    "job_exit_event": "fleethealth.payloads.job",
    "Watermark": "watermark",
    "RollbackInbox": "inbox",
    "SaveTimer": "ckptcost",
    "report_checkpoint_cost": "ckptcost",
    "CheckpointCost": "fleethealth.payloads.checkpoint_cost",
    "checkpoint_cost_event": "fleethealth.payloads.checkpoint_cost",
    "IntervalAdvisor": "advisor",
    "recommended_checkpoint_interval": "advisor",
    "Advice": "fleethealth.payloads.advice",
    "Retention": "watermark",
    "retention": "watermark",
    "Invariants": "invariants",
    "InvariantVerdict": "invariants",
    "NonFiniteLoss": "invariants",
    "NonFiniteAction": "invariants",
    "ReplayCalibration": "replay",
    "HangWatchdog": "watchdog",
    "CheckResult": "results",
    "StepVerdict": "results",
    "StartupReport": "results",
    "NondeterminismWarning": "results",
    # torch
    "instrument": "instrument",
    "Instrumented": "instrument",
    "SdcGuard": "guard",
    "FaultInjector": "faults",
    "CheckpointValidator": "fleethealth.injob.ckptcheck.background",
    "BitDigest": "digest",
    "bit_digest": "digest",
    "fingerprint": "digest",
    "fingerprint_distance": "digest",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
