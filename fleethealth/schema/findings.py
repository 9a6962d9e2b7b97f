"""What the detectors conclude (``fh.findings``) and what the policy recommends (``fh.recommendations``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar, Self

from fleethealth.errors import SchemaError
from fleethealth.ids import digest as _digest
from fleethealth.ids import episode as _episode
from fleethealth.schema.fields import (
    GPU_INDEX_MAX,
    MAX_TS,
    RANK_MAX,
    SCHEMA_VERSION,
    Topic,
    _enum,
    _float,
    _int,
    _obj,
    _str,
    _ts,
)


class FindingKind(StrEnum):
    STRAGGLER = "straggler"
    HANG = "hang"
    SDC = "sdc"
    FAILURE_RISK = "failure_risk"
    XID = "xid"
    ECC = "ecc"
    THERMAL = "thermal"
    POWER_BRAKE = "power_brake"
    LINK = "link"
    TELEMETRY_STALL = "telemetry_stall"  # a node's driver calls stalled repeatedly (health rule ``stall``)
    FABRIC = "fabric"  # a GPU not (properly) registered with the NVSwitch fabric (health rule ``fabric``)


class Diagnosis(StrEnum):
    """Why a straggler is slow (seed 000, revision R2)."""

    NODE_THERMAL = "NODE_THERMAL"
    ENVIRONMENTAL = "ENVIRONMENTAL"
    NODE_LINK = "NODE_LINK"
    NETWORK_CONTENTION = "NETWORK_CONTENTION"
    UNKNOWN = "UNKNOWN"


class Action(StrEnum):
    EVICT = "evict"
    DRAIN = "drain"
    QUARANTINE = "quarantine"
    ALERT_FACILITIES = "alert_facilities"
    PAGE = "page"
    ROLLBACK = "rollback"
    NONE = "none"


class Guard(StrEnum):
    ALLOWED = "allowed"
    RATE_LIMITED = "rate_limited"
    NEEDS_HUMAN = "needs_human"


@dataclass(frozen=True)
class Finding:
    """What a detector concluded (topic ``fh.findings``).

    ``z`` is the detector's score for the rank (robust z or sequential statistic: higher is more
    abnormal); ``slowdown`` is the estimated compute-time ratio to peers minus one (0.2 = 20 %
    slower). ``probability`` is a failure probability for ``failure_risk``. ``step`` is the first
    step at which the detector concluded, ``ts`` its event time. ``episode_ts`` is the event time
    the episode began (a straggler's first slow step, a hang's last progress, the sample or event
    that opened a health episode): ``id`` names the kind, detector, job, node, GPU, rank and the
    episode start — not when the detector concluded — so a restart or a replay that detects the same
    episode again, at another step or time, derives the same id (:func:`fleethealth.ids.episode`).
    Without ``episode_ts`` (a message from before it existed) the id names ``step`` and ``ts`` instead.
    """

    kind: FindingKind
    node: str
    ts: float
    job: str | None = None
    gpu: int | None = None
    rank: int | None = None
    step: int | None = None
    diagnosis: Diagnosis | None = None
    z: float | None = None
    slowdown: float | None = None
    probability: float | None = None
    detector: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)
    episode_ts: float | None = None
    TOPIC: ClassVar[Topic] = Topic.FINDINGS

    @property
    def key(self) -> str:
        return self.job or self.node

    @property
    def id(self) -> str:
        if self.episode_ts is None:
            return _digest(self.kind, self.detector, self.job, self.node, self.gpu, self.rank, self.step, self.ts)
        return _digest(self.kind, self.detector, self.job, self.node, self.gpu, self.rank, _episode(self.episode_ts))

    def to_obj(self) -> dict[str, Any]:
        return {"v": SCHEMA_VERSION, "id": self.id, "kind": self.kind.value, "job": self.job, "node": self.node,
                "gpu": self.gpu, "rank": self.rank, "step": self.step, "ts": self.ts,
                "diagnosis": None if self.diagnosis is None else self.diagnosis.value,
                "z": self.z, "slowdown": self.slowdown, "probability": self.probability,
                "detector": self.detector, "evidence": self.evidence, "episode_ts": self.episode_ts}

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> Self:
        detector = obj.get("detector", "")
        if not isinstance(detector, str):
            raise SchemaError("detector", "expected a string")
        return cls(kind=_enum(obj, "kind", FindingKind), node=_str(obj, "node"), ts=_ts(obj),
                   job=_str(obj, "job", optional=True), gpu=_int(obj, "gpu", optional=True, maximum=GPU_INDEX_MAX),
                   rank=_int(obj, "rank", optional=True, maximum=RANK_MAX), step=_int(obj, "step", optional=True),
                   diagnosis=_enum(obj, "diagnosis", Diagnosis, optional=True),
                   z=_float(obj, "z", optional=True, minimum=None),
                   slowdown=_float(obj, "slowdown", optional=True, minimum=None),
                   probability=_float(obj, "probability", optional=True),
                   detector=detector, evidence=_obj(obj, "evidence"),
                   episode_ts=_float(obj, "episode_ts", optional=True, maximum=MAX_TS))


@dataclass(frozen=True)
class Recommendation:
    """What a scheduler should do about a node (topic ``fh.recommendations``, key node).

    ``guard`` says whether the action may be taken automatically; ``reason`` says why in words,
    ``evidence`` in numbers (payback time, P(healthy), the guard that fired). ``id`` is derived
    from the finding and the action, so a replayed finding yields the same recommendation.
    """

    action: Action
    node: str
    ts: float
    reason: str
    guard: Guard = Guard.ALLOWED
    job: str | None = None
    finding_id: str | None = None
    dry_run: bool = False
    evidence: dict[str, Any] = field(default_factory=dict)
    TOPIC: ClassVar[Topic] = Topic.RECOMMENDATIONS

    @property
    def key(self) -> str:
        return self.node

    @property
    def id(self) -> str:
        return _digest(self.finding_id or self.ts, self.action, self.node, self.job)

    def to_obj(self) -> dict[str, Any]:
        return {"v": SCHEMA_VERSION, "id": self.id, "action": self.action.value, "node": self.node,
                "job": self.job, "reason": self.reason, "guard": self.guard.value, "ts": self.ts,
                "finding_id": self.finding_id, "dry_run": self.dry_run, "evidence": self.evidence}

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> Self:
        dry = obj.get("dry_run", False)
        if not isinstance(dry, bool):
            raise SchemaError("dry_run", "expected true or false")
        return cls(action=_enum(obj, "action", Action), node=_str(obj, "node"), ts=_ts(obj),
                   reason=_str(obj, "reason"), guard=_enum(obj, "guard", Guard),
                   job=_str(obj, "job", optional=True), finding_id=_str(obj, "finding_id", optional=True),
                   dry_run=dry, evidence=_obj(obj, "evidence"))
