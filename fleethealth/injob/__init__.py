"""The in-job library: runs inside training processes, imports nothing heavier than torch and the wire format.

Names are resolved lazily, so ``import fleethealth.injob`` (and the torch-free modules: records,
report, watermark, invariants, replay, watchdog, timer) work on a node without torch; the torch
modules (digest, guard, crossrank) load on first use of one of their names.

- :class:`StepTimer` — pre-collective compute time per step, to the node probe.
- :class:`SdcGuard` — bitwise self-check, cross-rank replay, invariants, watermark (seed 000 §7, R3, R6).
- :class:`HangWatchdog` — progress watchdog with faulthandler stack dumps.
- :class:`Watermark`, :func:`retention`, :func:`rollback_target` — verification watermark (R6).
"""

from __future__ import annotations

from fleethealth.lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    # torch-free
    "StepTimer": "timer",
    "TimerStats": "timer",
    "CheckKind": "records",
    "Classification": "records",
    "classify": "records",
    "SdcCheck": "records",
    "HangReport": "records",
    "sdc_check_event": "records",
    "hang_report_event": "records",
    "checkpoint_event": "records",
    "event_datagram": "records",
    "Reporter": "report",
    "Watermark": "watermark",
    "CheckpointRecord": "watermark",
    "Retention": "watermark",
    "retention": "watermark",
    "rollback_target": "watermark",
    "Invariants": "invariants",
    "InvariantVerdict": "invariants",
    "NonFiniteLoss": "invariants",
    "ReplayCalibration": "replay",
    "HangWatchdog": "watchdog",
    # torch
    "SdcGuard": "guard",
    "CheckResult": "guard",
    "StepVerdict": "guard",
    "StartupReport": "guard",
    "NondeterminismWarning": "guard",
    "BitDigest": "digest",
    "bit_digest": "digest",
    "fingerprint": "digest",
    "fingerprint_distance": "digest",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
