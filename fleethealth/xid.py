"""The Xid rulebook: what each NVIDIA driver Xid code means, how bad it is and what to do.

The one catalog both sides read: the health rules (:mod:`fleethealth.detectors.health`) turn an
Xid event into a finding with the entry's severity and advice, the failure predictor weighs it, and
the policy engine (:mod:`fleethealth.policy.engine`) falls back on it for a finding that carries no
advice. After NVIDIA's Xid catalog for Ampere and newer data-center GPUs ("Analyzing Xid Errors
with the Xid Catalog", docs.nvidia.com/deploy/xid-errors): its immediate-action buckets map to
``action`` — ``RESET_GPU`` / ``RESET_FABRIC`` / node reboot of a hardware fault → ``drain``;
``RESTART_APP`` and ``IGNORE`` → ``none``.

``severity`` reads: ``critical`` — the GPU or node is unusable until reset or repaired (drain it);
``error`` — a hardware or firmware fault that needs a GPU reset soon; ``warning`` — worth a record
and a trend (often an application's own fault, or a correctable hardware event); ``info`` —
housekeeping. ``action`` is the recommended scheduler action; ``remedy`` says what an operator does;
``hardware`` is False when the usual cause is the application or driver, not the GPU.

The memory codes, which are easy to confuse: 48 a double-bit (uncorrectable) ECC error; 63 a row
remap (or page retirement) recorded, effective after the next reset; 64 that recording failed; 92 a
high rate of *corrected* single-bit errors (a warning and a trend, not a drain); 94 a *contained*
uncorrectable error (only the application touching the memory was stopped; the GPU keeps serving
others); 95 an *uncontained* one (every context on the GPU is suspect: drain). 79 the GPU fell off
the bus; 74 an NVLink error. 13, 31 and 43 are usually the application's (an exception, an MMU
fault, a stopped channel).

Codes not in the catalog resolve to an ``unknown`` entry of severity ``warning`` that pages a
human, so a new driver's codes are never silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from fleethealth.schema import Action

__all__ = ["XidSeverity", "XidInfo", "XID_CATALOG", "DRAIN_CODES", "APPLICATION_CODES", "lookup"]


class XidSeverity(StrEnum):
    """How bad an Xid is; ordered ``info < warning < error < critical`` (see :attr:`rank`)."""

    INFO = "info"
    WARNING = "warning"
    ERROR = "error"
    CRITICAL = "critical"

    @property
    def rank(self) -> int:
        return _ORDER[self]


_ORDER = {XidSeverity.INFO: 0, XidSeverity.WARNING: 1, XidSeverity.ERROR: 2, XidSeverity.CRITICAL: 3}


@dataclass(frozen=True)
class XidInfo:
    """One catalog entry."""

    code: int
    name: str
    severity: XidSeverity
    action: Action
    remedy: str
    hardware: bool = True
    """False when the usual cause is the application or driver, not the GPU."""

    @property
    def drains(self) -> bool:
        """True when the catalog advises taking the node out of the pool."""
        return self.action is Action.DRAIN


_C, _E, _W, _I = XidSeverity.CRITICAL, XidSeverity.ERROR, XidSeverity.WARNING, XidSeverity.INFO
_RESET = "reset the GPU (or reboot the node); drain if it recurs"
_DRAIN = "drain the node, reset the GPU, run the full self-test before return; RMA if it recurs"
_APP = "usually the application or driver: check the job's logs; a trend on one GPU points to hardware"

_ENTRIES = [
    XidInfo(8, "GPU stopped processing (timeout)", _E, Action.NONE, _RESET),
    XidInfo(13, "graphics engine exception", _W, Action.NONE, _APP, hardware=False),
    XidInfo(31, "GPU memory page fault (MMU fault)", _W, Action.NONE, _APP, hardware=False),
    XidInfo(32, "invalid or corrupted push buffer stream", _W, Action.NONE, _APP, hardware=False),
    XidInfo(38, "driver firmware error", _E, Action.NONE, _RESET),
    XidInfo(43, "GPU stopped processing (reset channel)", _W, Action.NONE, _APP, hardware=False),
    XidInfo(44, "graphics engine fault during context switch", _E, Action.NONE, _RESET),
    XidInfo(45, "preemptive cleanup after earlier errors", _I, Action.NONE, "follows another Xid; see that one",
            hardware=False),
    XidInfo(48, "double-bit (uncorrectable) ECC error", _C, Action.DRAIN, _DRAIN),
    XidInfo(56, "display engine error", _I, Action.NONE, "display path only; ignore on compute nodes"),
    XidInfo(57, "error programming video memory interface", _E, Action.DRAIN, _DRAIN),
    XidInfo(61, "internal micro-controller breakpoint / warning", _E, Action.NONE, _RESET),
    XidInfo(62, "internal micro-controller halt", _C, Action.DRAIN, _DRAIN),
    XidInfo(63, "ECC page retirement or row-remap recording event", _W, Action.NONE,
            "reset the GPU at the next convenient point so the remap takes effect; watch the trend"),
    XidInfo(64, "ECC page retirement or row-remap recording failure", _C, Action.DRAIN, _DRAIN),
    XidInfo(68, "video decoder (NVDEC) exception", _W, Action.NONE, _APP, hardware=False),
    XidInfo(69, "graphics engine class error", _W, Action.NONE, _APP, hardware=False),
    XidInfo(74, "NVLink error", _C, Action.DRAIN, "drain; check the NVLink / NVSwitch path, reseat or RMA"),
    XidInfo(79, "GPU has fallen off the bus", _C, Action.DRAIN, _DRAIN),
    XidInfo(92, "high single-bit ECC error rate", _W, Action.NONE,
            "watch the corrected-error trend; drain at the next checkpoint if it keeps rising"),
    XidInfo(94, "contained ECC error", _E, Action.NONE,
            "the affected application was stopped; reset the GPU when convenient"),
    XidInfo(95, "uncontained ECC error", _C, Action.DRAIN, _DRAIN),
    XidInfo(109, "context switch timeout", _E, Action.NONE, _RESET),
    XidInfo(110, "security fault", _C, Action.DRAIN, _DRAIN),
    XidInfo(119, "GSP RPC timeout", _C, Action.DRAIN, _DRAIN),
    XidInfo(120, "GSP error", _C, Action.DRAIN, _DRAIN),
    XidInfo(121, "C2C link corrected error", _W, Action.NONE, "watch the trend"),
    XidInfo(122, "SPI PMU RPC read failure", _W, Action.NONE, _RESET),
    XidInfo(123, "SPI PMU RPC write failure", _W, Action.NONE, _RESET),
    XidInfo(124, "SPI PMU RPC erase failure", _W, Action.NONE, _RESET),
    XidInfo(140, "unrecovered ECC error", _C, Action.DRAIN, _DRAIN),
    XidInfo(143, "GPU initialisation failure", _C, Action.DRAIN, _DRAIN),
    XidInfo(154, "GPU recovery action changed", _W, Action.NONE,
            "read the recovery action the driver reports (reset, reboot or drain) and follow it"),
]

XID_CATALOG: dict[int, XidInfo] = {e.code: e for e in _ENTRIES}
"""Known Xid codes → :class:`XidInfo`."""

DRAIN_CODES = frozenset(code for code, info in XID_CATALOG.items() if info.drains)
"""The codes whose advice is ``drain`` (uncorrectable or uncontained ECC, remap failure, NVLink, off the bus, GSP)."""
APPLICATION_CODES = frozenset(code for code, info in XID_CATALOG.items() if not info.hardware)
"""The codes usually caused by the application or driver: reported, never a node action by themselves."""


def lookup(code: int) -> XidInfo:
    """The catalog entry of ``code``; an ``unknown`` warning entry (action ``page``) when not listed."""
    found = XID_CATALOG.get(int(code))
    if found is not None:
        return found
    return XidInfo(int(code), "unknown Xid (not in this catalog)", XidSeverity.WARNING, Action.PAGE,
                   "look the code up in NVIDIA's Xid documentation for this driver", hardware=False)
