"""Goodput, ETTR and the per-run timeline of interruptions with the four MTTR phases.

Seed 000 §3/§6: goodput, not uptime, is the headline — a job "up" behind a 20 % straggler runs at
1/1.2 ≈ 0.83 of the rate it costs. Here

    goodput = (1 − overhead) × ideal_step_s / actual_step_s

with ``ideal_step_s`` the mean of the step times at or below median + 3·MAD (checkpoint stalls and
other spikes excluded; MAD unscaled) and ``actual_step_s`` the mean of all of them.

Seed 002: ETTR = productive runtime / available wallclock, and MTTR is recorded in four phases on
one incident timeline — detection, isolation & scheduling, reconfiguration, reload & replay — so
the binding one can be attacked. :class:`Timeline` holds every interruption of a run with its cause,
node, detector, lost steps, restart seconds and those phases.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fleethealth.errors import ConfigError, SchemaError
from fleethealth.schema import Event, EventKind

__all__ = [
    "PHASES",
    "Interruption",
    "GoodputReport",
    "Timeline",
    "ideal_step_time",
    "goodput",
    "ettr",
    "timeline",
    "distinct_stops",
    "window_goodput",
]

PHASES = ("detection_s", "isolation_s", "reconfiguration_s", "reload_s")
"""The four MTTR phases (seed 002): detection, isolation & scheduling, reconfiguration, reload & replay."""


def _field(data: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    value = data.get(name, default)
    if value is None:
        return default
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise SchemaError(f"data.{name}", f"expected a finite number >= 0, got {value!r}")
        return float(value)
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise SchemaError(f"data.{name}", f"expected an integer >= 0, got {value!r}")
        return value
    if not isinstance(value, str):
        raise SchemaError(f"data.{name}", f"expected a string, got {value!r}")
    return value


@dataclass(frozen=True)
class Interruption:
    """One stop of a run (seed 000 §4 ``interruption``), with the four MTTR phases in seconds.

    ``restart_s`` is the measured restart cost; when the record lacks it, the sum of the phases.
    ``step`` is the step at which the run failed (None when unknown). ``node`` is the node that
    caused it, None when the record names none (``data.culprit`` false). ``recompute_s`` is the
    replay's time when the record carries it (the goodput figures count the replay as
    ``lost_steps`` × the ideal step time, so it is not part of :attr:`mttr_s` or ``restart_s``).
    """

    job: str
    ts: float
    node: str | None
    cause: str
    detected_by: str
    step: int | None = None
    lost_steps: int = 0
    restart_s: float = 0.0
    detection_s: float = 0.0
    isolation_s: float = 0.0
    reconfiguration_s: float = 0.0
    reload_s: float = 0.0
    recompute_s: float = 0.0

    @property
    def mttr_s(self) -> float:
        """Sum of the four phases (non-overlapping critical-path durations)."""
        return self.detection_s + self.isolation_s + self.reconfiguration_s + self.reload_s

    @classmethod
    def from_event(cls, ev: Event) -> Interruption:
        """Read an ``interruption`` event (the contract keys); :class:`SchemaError` names a bad field."""
        if ev.kind is not EventKind.INTERRUPTION:
            raise SchemaError("kind", f"expected an interruption event, got {ev.kind.value}")
        if ev.job is None:
            raise SchemaError("job", "an interruption belongs to a job")
        d = ev.data
        phases = {p: _field(d, p, float, 0.0) for p in PHASES}
        restart = _field(d, "restart_s", float, None)
        step = _field(d, "step", int, ev.step)
        culprit = d.get("culprit", True) is not False  # a derived record names its node only for a culprit
        return cls(job=ev.job, ts=ev.ts, node=(ev.node or None) if culprit else None,
                   cause=_field(d, "cause", str, "unknown"),
                   detected_by=_field(d, "detected_by", str, "unknown"), step=step,
                   lost_steps=_field(d, "lost_steps", int, 0),
                   restart_s=sum(phases.values()) if restart is None else restart,
                   recompute_s=_field(d, "recompute_s", float, 0.0), **phases)

    def to_obj(self) -> dict[str, Any]:
        return {"job": self.job, "ts": self.ts, "node": self.node, "cause": self.cause,
                "detected_by": self.detected_by, "step": self.step, "lost_steps": self.lost_steps,
                "restart_s": self.restart_s, **{p: getattr(self, p) for p in PHASES}, "recompute_s": self.recompute_s,
                "mttr_s": self.mttr_s}


@dataclass(frozen=True)
class GoodputReport:
    """``goodput`` in [0, 1]: the fraction of paid time that advanced the run. Higher is better."""

    goodput: float
    ideal_step_s: float
    actual_step_s: float
    overhead: float
    steps: int
    excluded_steps: int

    def to_obj(self) -> dict[str, float | int]:
        return {"goodput": self.goodput, "ideal_step_s": self.ideal_step_s, "actual_step_s": self.actual_step_s,
                "overhead": self.overhead, "steps": self.steps, "excluded_steps": self.excluded_steps}


def _steps(step_s: Sequence[float] | np.ndarray) -> np.ndarray:
    arr = np.asarray(step_s, dtype=np.float64).ravel()
    if arr.size == 0:
        raise ConfigError("goodput needs at least one step time")
    if not np.isfinite(arr).all() or (arr <= 0).any():
        raise ConfigError("step times must be finite and > 0")
    return arr


def _ideal_mask(arr: np.ndarray) -> np.ndarray:
    med = float(np.median(arr))
    return arr <= med + 3.0 * float(np.median(np.abs(arr - med)))


def distinct_stops(events: Iterable[Event]) -> list[Event]:
    """The ``interruption`` events of ``events``, oldest first, one per stop.

    A stop derived twice (the detector restarted while the run was down, so the second record's
    content, and with it its event id, differs) carries the same ``data.interruption_id``; the
    first record of each is kept. A record without one (an outside producer's) is its own stop.
    """
    seen: set[str] = set()
    out = []
    for ev in sorted((e for e in events if e.kind is EventKind.INTERRUPTION), key=lambda e: (e.ts, e.id)):
        key = ev.data.get("interruption_id") if isinstance(ev.data, dict) else None
        key = key if isinstance(key, str) and key else ev.id
        if key not in seen:
            seen.add(key)
            out.append(ev)
    return out


def ideal_step_time(step_s: Sequence[float] | np.ndarray) -> float:
    """Mean of the step times at or below median + 3·MAD (seconds; MAD unscaled, so the cut sits
    near two standard deviations of Gaussian jitter and the ideal leans to the fast side)."""
    arr = _steps(step_s)
    return float(arr[_ideal_mask(arr)].mean())


def goodput(step_s: Sequence[float] | np.ndarray, overhead: float = 0.0) -> GoodputReport:
    """(1 − overhead) × ideal / actual step time for a run's per-step wall times (shape ``(n,)``)."""
    arr = _steps(step_s)
    if not (math.isfinite(overhead) and 0.0 <= overhead <= 1.0):
        raise ConfigError(f"overhead is a fraction in [0, 1], got {overhead!r}")
    keep = _ideal_mask(arr)
    ideal = float(arr[keep].mean())
    actual = float(arr.mean())
    return GoodputReport(goodput=(1.0 - overhead) * ideal / actual, ideal_step_s=ideal, actual_step_s=actual,
                         overhead=float(overhead), steps=int(arr.size), excluded_steps=int((~keep).sum()))


def ettr(productive_s: float, available_s: float) -> float:
    """Effective training time ratio: productive runtime / available wallclock (seed 002)."""
    if not (math.isfinite(available_s) and available_s > 0):
        raise ConfigError(f"available wallclock must be > 0, got {available_s!r}")
    if not (math.isfinite(productive_s) and 0 <= productive_s <= available_s):
        raise ConfigError(f"productive runtime must be in [0, {available_s}], got {productive_s!r}")
    return productive_s / available_s


@dataclass(frozen=True)
class Timeline:
    """Every interruption of one run over ``[start, end]`` (event time, seconds), oldest first."""

    job: str
    start: float
    end: float
    interruptions: tuple[Interruption, ...]
    ideal_step_s: float | None = None

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    @property
    def restart_s(self) -> float:
        return float(sum(i.restart_s for i in self.interruptions))

    @property
    def lost_steps(self) -> int:
        return int(sum(i.lost_steps for i in self.interruptions))

    @property
    def lost_work_s(self) -> float:
        """Replayed work: lost steps × ideal step time (0 when the ideal step time is unknown)."""
        return self.lost_steps * (self.ideal_step_s or 0.0)

    @property
    def overhead(self) -> float:
        """Share of the wallclock spent restarting and replaying."""
        return min(1.0, (self.restart_s + self.lost_work_s) / self.wall_s)

    @property
    def ettr(self) -> float:
        return ettr(self.wall_s * (1.0 - self.overhead), self.wall_s)

    def phase_totals(self) -> dict[str, float]:
        return {p: float(sum(getattr(i, p) for i in self.interruptions)) for p in PHASES}

    @property
    def binding_phase(self) -> str | None:
        """The MTTR phase with the largest total: the one to attack next (seed 002)."""
        totals = self.phase_totals()
        return max(totals, key=totals.__getitem__) if any(totals.values()) else None

    def nodes(self) -> dict[str, int]:
        """Interruptions per node; a node twice means its quarantine did not hold."""
        out: dict[str, int] = {}
        for i in self.interruptions:
            if i.node:
                out[i.node] = out.get(i.node, 0) + 1
        return out

    def to_obj(self) -> dict[str, Any]:
        return {"job": self.job, "start": self.start, "end": self.end, "wall_s": self.wall_s,
                "interruptions": [i.to_obj() for i in self.interruptions], "restart_s": self.restart_s,
                "lost_steps": self.lost_steps, "lost_work_s": self.lost_work_s, "overhead": self.overhead,
                "ettr": self.ettr, "phase_totals": self.phase_totals(), "binding_phase": self.binding_phase,
                "nodes": self.nodes()}


def timeline(job: str, records: Iterable[Event | Interruption], start: float, end: float,
             ideal_step_s: float | None = None) -> Timeline:
    """The run's timeline from interruption events (or records) of ``job`` inside ``[start, end]``."""
    if not (math.isfinite(start) and math.isfinite(end) and end > start):
        raise ConfigError(f"a timeline needs start < end, got {start!r}, {end!r}")
    items = []
    for rec in records:
        if isinstance(rec, Event):
            if rec.kind is not EventKind.INTERRUPTION or rec.job != job:
                continue
            rec = Interruption.from_event(rec)
        if rec.job == job and start <= rec.ts <= end:
            items.append(rec)
    items.sort(key=lambda i: (i.ts, i.node or ""))
    return Timeline(job=job, start=float(start), end=float(end), interruptions=tuple(items),
                    ideal_step_s=ideal_step_s)


def window_goodput(step_end_ts: Sequence[float] | np.ndarray, ideal_step_s: float,
                   interruptions: Iterable[Interruption], now: float, window_s: float = 3600.0) -> float:
    """Goodput over ``[now − window_s, now]``: (steps completed − steps lost) × ideal step / window.

    ``step_end_ts`` holds the completion time of each step (shape ``(n,)``); restarts show up as
    time in which no step completes, replays as lost steps. Clipped to [0, 1].
    """
    if not (math.isfinite(ideal_step_s) and ideal_step_s > 0):
        raise ConfigError(f"ideal_step_s must be > 0, got {ideal_step_s!r}")
    if not (math.isfinite(window_s) and window_s > 0):
        raise ConfigError(f"window_s must be > 0, got {window_s!r}")
    ts = np.asarray(step_end_ts, dtype=np.float64)
    lo = now - window_s
    done = int(((ts > lo) & (ts <= now)).sum())
    lost = sum(i.lost_steps for i in interruptions if lo < i.ts <= now)
    return float(min(1.0, max(0.0, (done - lost) * ideal_step_s / window_s)))
