"""Typed evidence of findings: what the health rules fill and the policy reads.

On the wire and in the store a finding's ``evidence`` stays a JSON object (docs/architecture.md "Findings and
recommendations"); these frozen dataclasses are its shape for the two kinds the policy acts on by
their facts. A detector builds one and writes :meth:`to_evidence`; the policy reads
:meth:`from_evidence`, which tolerates a finding from another producer (a missing key reads as
"not said", never as a fault).

=================  ===========================================================================
:class:`XidEvidence`  an ``xid`` finding: the code, the catalog's name / advice / remedy
                      (:mod:`fleethealth.xid`), whether the usual cause is hardware, the driver message
:class:`EccEvidence`  an ``ecc`` finding: which rules held, uncorrectable errors since driver load,
                      row-remap failure / pending, retired pages, corrected errors
:class:`StragglerEvidence`  what the policy reads of a straggler's evidence besides the finding's
                      own fields: the rack its diagnosis named, an explicit remaining run time, a
                      slowdown carried only in the evidence (a finding from another producer)
=================  ===========================================================================

The two hardware kinds carry ``severity`` (``info`` / ``warning`` / ``error`` / ``critical``, lower case; ``""``
when unsaid) and ``escalated_from`` (the severity an open episode rose from, else None).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

from fleethealth.schema import Action

__all__ = ["XidEvidence", "EccEvidence", "StragglerEvidence", "Corroboration", "MIN_COMPARABLE_RANKS"]

MIN_COMPARABLE_RANKS = 8
"""The fewest comparable ranks (one group of a step) the straggler detector scores by default
(``detect.straggler.min_group``); a smaller job is reported as not scored (the detector, the runner's
log and metric, the report)."""


def _number(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, int | float) and not (isinstance(v, float) and math.isnan(v)):
        return float(v)
    return None


def _severity(m: Mapping[str, Any]) -> str:
    v = m.get("severity", "")
    return v.lower() if isinstance(v, str) else ""


def _escalated(m: Mapping[str, Any]) -> str | None:
    v = m.get("escalated_from")
    return v if isinstance(v, str) else None


@dataclass(frozen=True)
class XidEvidence:
    """The facts of one Xid finding. ``action`` is the catalog's advice (None when unsaid)."""

    code: int | None
    severity: str = ""
    name: str = ""
    action: Action | None = None
    remedy: str = ""
    hardware: bool = True
    message: str = ""
    escalated_from: str | None = None

    def to_evidence(self) -> dict[str, Any]:
        out: dict[str, Any] = {"severity": self.severity, "code": self.code, "name": self.name,
                               "action": None if self.action is None else self.action.value,
                               "remedy": self.remedy, "hardware": self.hardware, "message": self.message}
        if self.escalated_from is not None:
            out["escalated_from"] = self.escalated_from
        return out

    @classmethod
    def from_evidence(cls, m: Mapping[str, Any]) -> Self:
        code = m.get("code", m.get("xid"))
        action = m.get("action")
        known = {a.value for a in Action}
        return cls(code=code if isinstance(code, int) and not isinstance(code, bool) else None,
                   severity=_severity(m), name=str(m.get("name", "")),
                   action=Action(action) if isinstance(action, str) and action in known else None,
                   remedy=str(m.get("remedy", "")), hardware=bool(m.get("hardware", True)),
                   message=str(m.get("message", "")), escalated_from=_escalated(m))


@dataclass(frozen=True)
class EccEvidence:
    """The facts of one ECC finding. ``reasons`` names the rules that held: ``uncorrectable``,
    ``remap_failure``, ``pending`` (a row remap or page retirement waits for a reset),
    ``retired_growth`` (retired pages grew since the node's previous sample) and ``remap_growth``
    (remapped rows grew: the same on GPUs that remap rows instead of retiring pages). Counts are
    None where the telemetry did not say (``retired_pages`` on Hopper, ``remapped_rows`` on Volta)."""

    severity: str = ""
    reasons: tuple[str, ...] = ()
    uncorrectable: float | None = None
    remap_failure: bool = False
    remap_pending: float | None = None
    retired_pages: float | None = None
    corrected_volatile: float | None = None
    escalated_from: str | None = None
    remapped_rows: float | None = None

    def to_evidence(self) -> dict[str, Any]:
        out: dict[str, Any] = {"severity": self.severity, "reasons": list(self.reasons),
                               "uncorrectable": self.uncorrectable, "remap_failure": self.remap_failure,
                               "remap_pending": self.remap_pending, "retired_pages": self.retired_pages,
                               "remapped_rows": self.remapped_rows, "corrected_volatile": self.corrected_volatile}
        if self.escalated_from is not None:
            out["escalated_from"] = self.escalated_from
        return out

    @classmethod
    def from_evidence(cls, m: Mapping[str, Any]) -> Self:
        reasons = m.get("reasons", ())
        return cls(severity=_severity(m),
                   reasons=tuple(str(r) for r in reasons) if isinstance(reasons, list | tuple) else (),
                   uncorrectable=_number(m.get("uncorrectable", m.get("dbe"))),
                   remap_failure=bool(m.get("remap_failure")), remap_pending=_number(m.get("remap_pending")),
                   retired_pages=_number(m.get("retired_pages")), remapped_rows=_number(m.get("remapped_rows")),
                   corrected_volatile=_number(m.get("corrected_volatile")), escalated_from=_escalated(m))

    @property
    def uncorrectable_seen(self) -> bool:
        """True when uncorrectable errors were counted since driver load."""
        return self.uncorrectable is not None and self.uncorrectable > 0


def _finite(v: Any) -> float | None:
    if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    return None


@dataclass(frozen=True)
class StragglerEvidence:
    """The policy's reading of a straggler finding's evidence. ``rack`` is the one the diagnosis
    named (None: derive it from the node name); ``remaining_s`` the job's remaining run time when
    the producer knew it (None: the engine's own figure); ``slowdown`` the evidence's slowdown,
    used when the finding's field is empty; ``power_capped`` whether the diagnosis found the GPU held
    at its power cap for ``power_cap_share`` (0 to 1) of the window before the straggler. The
    detector's and the diagnosis's own keys (CUSUM arm, temperatures, peer shares) stay in the JSON
    object for people to read."""

    rack: str | None = None
    remaining_s: float | None = None
    slowdown: float | None = None
    power_capped: bool = False
    power_cap_share: float | None = None

    @classmethod
    def from_evidence(cls, m: Mapping[str, Any]) -> Self:
        rack = m.get("rack")
        remaining = _finite(m.get("remaining_s"))
        share = _finite(m.get("power_cap_share"))
        return cls(rack=rack if isinstance(rack, str) and rack else None,
                   remaining_s=remaining if remaining is not None and remaining >= 0 else None,
                   slowdown=_finite(m.get("slowdown")), power_capped=m.get("power_capped") is True,
                   power_cap_share=share if share is not None and 0 <= share <= 1 else None)


@dataclass(frozen=True)
class Corroboration:
    """What in a node's own stream supports a finding that would remove the node (``evidence["corroboration"]``).

    ``by`` names the supporting signals (empty: none, the finding stands alone); ``missing`` says in
    words what was looked for and not found. The signals, per kind (docs/architecture.md, "Corroboration"):

    ==========  ==============================================================================
    ``xid``     ``prior_fault`` (another Xid or ECC episode on the node within the window),
                ``gpu_off_bus`` (the node's next sample lacks the GPU or reads it as NaN),
                ``ecc_counters`` (the next sample shows the GPU's uncorrectable, pending or failed
                remap counters), ``telemetry_silent`` (a node that was reporting sends nothing
                for ``silence_s`` while the rest of the fleet's samples move on)
    ``ecc``     ``prior_fault`` (a lower-severity episode of the GPU before it), ``counters_persist``
                (the condition holds in the node's next sample too)
    ``sdc``     ``second_check`` (another failing check of the node's GPU), ``failed_selftest``
                (a failing self-test result of the node)
    ==========  ==============================================================================
    """

    by: tuple[str, ...] = ()
    missing: str = ""
    telemetry_age_s: float | None = None

    def to_evidence(self) -> dict[str, Any]:
        return {"by": list(self.by), "missing": self.missing, "telemetry_age_s": self.telemetry_age_s}

    @classmethod
    def from_evidence(cls, m: Mapping[str, Any]) -> Self:
        c = m.get("corroboration")
        if not isinstance(c, Mapping):
            return cls(missing="the finding carries no corroboration")
        by = c.get("by", ())
        return cls(by=tuple(str(b) for b in by) if isinstance(by, list | tuple) else (),
                   missing=str(c.get("missing", "")), telemetry_age_s=_finite(c.get("telemetry_age_s")))
