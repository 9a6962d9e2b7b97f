"""Budget arithmetic: the Young/Daly checkpoint interval, the three overhead terms, an automatic
interval from measured MTBF, and seed 003's charged-accelerator-hour ledger.

Seed 000 §6: overhead = C/T (checkpointing) + T/2M (lost work) + R/M (restart), minimised at
Young's T* = √(2CM); Daly's higher-order interval refines it when C is not small against M. The
restart term R/M does not depend on T at all, which is why the restart is where the leverage is.

Seed 003: compare reliability designs by correct completed work per *charged* accelerator-hour.
Each loss category is one ledger line in accelerator-hours and dollars, rounded to cents the way a
ledger is; totals and differences are sums of the rounded lines, which is how the seed's worked
example reads (375.47 − 34.13 = 341.34 accelerator-hours, $938.67 − $85.33 = $853.34).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from fleethealth.errors import ConfigError
from fleethealth.params import check_number

__all__ = [
    "OverheadTerms",
    "YoungDaly",
    "AutoInterval",
    "CATEGORIES",
    "Config",
    "Ledger",
    "Comparison",
    "overhead_terms",
    "young_interval",
    "daly_interval",
    "young_daly",
    "measured_mtbf_s",
    "scale_mtbf",
    "auto_interval",
    "load_comparison",
    "compare",
]




# ---------------------------------------------------------------- Young / Daly
@dataclass(frozen=True)
class OverheadTerms:
    """Fractions of wall-clock lost at checkpoint interval ``interval_s`` (0.05 = 5 %)."""

    interval_s: float
    checkpoint_term: float
    lost_work_term: float
    restart_term: float

    @property
    def overhead(self) -> float:
        return self.checkpoint_term + self.lost_work_term + self.restart_term


@dataclass(frozen=True)
class YoungDaly:
    """The docs/architecture.md "Budget arithmetic" result; the terms are evaluated at ``interval_s`` (the
    interval asked for, else Young's optimum)."""

    checkpoint_s: float
    mtbf_s: float
    restart_s: float
    optimal_interval_s: float
    daly_interval_s: float
    overhead_at_optimum: float
    at: OverheadTerms

    def to_obj(self) -> dict[str, float]:
        return {
            "checkpoint_s": self.checkpoint_s, "mtbf_h": self.mtbf_s / 3600.0, "restart_s": self.restart_s,
            "optimal_interval_s": self.optimal_interval_s, "daly_interval_s": self.daly_interval_s,
            "overhead_at_optimum": self.overhead_at_optimum, "interval_s": self.at.interval_s,
            "checkpoint_term": self.at.checkpoint_term, "lost_work_term": self.at.lost_work_term,
            "restart_term": self.at.restart_term, "overhead": self.at.overhead,
        }

    def to_text(self) -> str:
        a = self.at
        return "\n".join([
            f"C = {self.checkpoint_s:g} s, MTBF = {self.mtbf_s / 3600:g} h, R = {self.restart_s:g} s",
            f"Young optimum  T* = sqrt(2CM) = {self.optimal_interval_s:.1f} s ({self.optimal_interval_s / 60:.1f} min)"
            f" at {self.overhead_at_optimum:.2%} overhead",
            f"Daly interval  {self.daly_interval_s:.1f} s ({self.daly_interval_s / 60:.1f} min)",
            f"at T = {a.interval_s:.1f} s: checkpoint C/T {a.checkpoint_term:.2%} + lost work T/2M "
            f"{a.lost_work_term:.2%} + restart R/M {a.restart_term:.2%} = {a.overhead:.2%}",
        ])


def overhead_terms(checkpoint_s: float, interval_s: float, mtbf_s: float, restart_s: float) -> OverheadTerms:
    """C/T, T/2M and R/M for one interval (seed 000 §6)."""
    c = check_number("checkpoint_s", checkpoint_s, at_least=0)
    t = check_number("interval_s", interval_s, above=0)
    m = check_number("mtbf_s", mtbf_s, above=0)
    r = check_number("restart_s", restart_s, at_least=0)
    return OverheadTerms(interval_s=t, checkpoint_term=c / t, lost_work_term=t / (2.0 * m), restart_term=r / m)


def young_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum T* = √(2CM), seconds."""
    c = check_number("checkpoint_s", checkpoint_s, above=0)
    m = check_number("mtbf_s", mtbf_s, above=0)
    return math.sqrt(2.0 * c * m)


def daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (FGCS 2006), seconds of compute between checkpoints.

    √(2CM)·[1 + ⅓·√(C/2M) + ⅑·(C/2M)] − C for C < 2M, else M.
    """
    c = check_number("checkpoint_s", checkpoint_s, above=0)
    m = check_number("mtbf_s", mtbf_s, above=0)
    if c >= 2.0 * m:
        return m
    x = c / (2.0 * m)
    return math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - c


def young_daly(checkpoint_s: float, mtbf_s: float, restart_s: float,
               interval_s: float | None = None) -> YoungDaly:
    """Both optima and the overhead terms at ``interval_s`` (default: Young's optimum)."""
    t_star = young_interval(checkpoint_s, mtbf_s)
    at = overhead_terms(checkpoint_s, t_star if interval_s is None else interval_s, mtbf_s, restart_s)
    return YoungDaly(checkpoint_s=float(checkpoint_s), mtbf_s=float(mtbf_s), restart_s=float(restart_s),
                     optimal_interval_s=t_star, daly_interval_s=daly_interval(checkpoint_s, mtbf_s),
                     overhead_at_optimum=overhead_terms(checkpoint_s, t_star, mtbf_s, restart_s).overhead,
                     at=at)


# ---------------------------------------------------------------- automatic interval
@dataclass(frozen=True)
class AutoInterval:
    """The checkpoint interval derived from a measured failure rate (seed 000 §3 ``interval: "auto"``).

    ``censored`` is True when no interruption was seen in the window: the MTBF is then only known to
    be at least the window, and the window is used (the conservative, shorter interval).
    """

    interval_s: float
    method: str
    mtbf_s: float
    checkpoint_s: float
    interruptions: int
    window_s: float
    censored: bool
    overhead: float

    def to_obj(self) -> dict[str, Any]:
        return {"interval_s": self.interval_s, "method": self.method, "mtbf_s": self.mtbf_s,
                "mtbf_h": self.mtbf_s / 3600.0, "checkpoint_s": self.checkpoint_s,
                "interruptions": self.interruptions, "window_s": self.window_s, "censored": self.censored,
                "overhead_excl_restart": self.overhead}

    def to_text(self) -> str:
        seen = "" if self.interruptions < 0 else f" from {self.interruptions} interruptions in " \
            f"{self.window_s / 3600:g} h" + (" (none seen: MTBF at least the window)" if self.censored else "")
        return (f"MTBF {self.mtbf_s / 3600:.2f} h{seen}; checkpoint every {self.interval_s:.0f} s "
                f"({self.interval_s / 60:.1f} min, {self.method}) for C = {self.checkpoint_s:g} s; "
                f"checkpoint + lost-work overhead {self.overhead:.2%}")


def measured_mtbf_s(interruptions: int, window_s: float) -> tuple[float, bool]:
    """MTBF from a count of job interruptions over a window: ``(window / count, censored)``."""
    if isinstance(interruptions, bool) or not isinstance(interruptions, int) or interruptions < 0:
        raise ConfigError(f"interruptions must be a count >= 0, got {interruptions!r}")
    w = check_number("window_s", window_s, above=0)
    return (w / interruptions, False) if interruptions else (w, True)


def scale_mtbf(mtbf_s: float, measured_gpus: int, gpus: int) -> float:
    """A synchronous job fails when any rank fails, so MTBF scales as 1 / GPU count (seed 000)."""
    mtbf = check_number("mtbf_s", mtbf_s, above=0)
    return mtbf * check_number("measured_gpus", measured_gpus, above=0) / check_number("gpus", gpus, above=0)


def auto_interval(checkpoint_s: float, *, mtbf_s: float | None = None, interruptions: int | None = None,
                  window_s: float | None = None, interruption_ts: Sequence[float] | None = None,
                  method: str = "young", min_s: float = 60.0, max_s: float = 6 * 3600.0) -> AutoInterval:
    """The interval for the measured MTBF and checkpoint cost, clamped to ``[min_s, max_s]``.

    Give ``mtbf_s`` directly, or ``interruptions`` over ``window_s``, or the event times
    ``interruption_ts`` (with ``window_s``; default their span). A flaky rack lowers the MTBF and so
    shortens the interval automatically.
    """
    if method not in ("young", "daly"):
        raise ConfigError(f"unknown interval method {method!r} (known: young, daly)")
    censored = False
    if mtbf_s is None:
        if interruption_ts is not None:
            ts = np.sort(np.asarray(interruption_ts, dtype=np.float64))
            if ts.size and not np.isfinite(ts).all():
                raise ConfigError("interruption times must be finite")
            interruptions = int(ts.size)
            if window_s is None:
                if ts.size < 2:
                    raise ConfigError("give window_s: fewer than two interruption times have no span")
                window_s = float(ts[-1] - ts[0]) * ts.size / (ts.size - 1)
        if interruptions is None or window_s is None:
            raise ConfigError("give mtbf_s, or interruptions with window_s, or interruption_ts")
        mtbf_s, censored = measured_mtbf_s(interruptions, window_s)
    m = check_number("mtbf_s", mtbf_s, above=0)
    lo, hi = check_number("min_s", min_s, above=0), check_number("max_s", max_s, above=0)
    if lo > hi:
        raise ConfigError(f"min_s {lo} exceeds max_s {hi}")
    raw = young_interval(checkpoint_s, m) if method == "young" else daly_interval(checkpoint_s, m)
    t = min(max(raw, lo), hi)
    terms = overhead_terms(checkpoint_s, t, m, 0.0)
    return AutoInterval(interval_s=t, method=method, mtbf_s=m, checkpoint_s=float(checkpoint_s),
                        interruptions=-1 if interruptions is None else int(interruptions),
                        window_s=math.nan if window_s is None else float(window_s), censored=censored,
                        overhead=terms.overhead)


# ---------------------------------------------------------------- seed 003 ledger
CATEGORIES = ("healthy", "checkpoint_interference", "detection", "replacement", "restore", "repeated_work",
              "false_terminations", "idle_spares")
"""Ledger lines of charged accelerator-hours (seed 003 "Calculate effective calendar rate")."""

_CONFIG_KEYS = {
    "name": "label", "incidents": "incidents per period", "detection_min": "minutes to detect one incident",
    "replacement_min": "minutes to find and provision a replacement",
    "restore_min": "minutes to restart and restore", "repeated_work_min": "minutes of work redone per incident",
    "checkpoint_overhead": "fraction of healthy time lost to checkpoint interference",
    "probe_overhead": "fraction by which probes slow healthy steps",
    "false_terminations": "false terminations per period",
    "false_termination_restore_min": "minutes to restart and restore after one",
    "false_termination_repeated_min": "minutes of repeated work after one",
    "spare_accelerators": "idle spare accelerators charged to the workload",
}
_TOP_KEYS = {"name", "accelerators", "price_per_accelerator_hour", "period_h", "baseline", "candidate"}


@dataclass(frozen=True)
class Config:
    """One reliability design, in the units of the seed 003 worked example (minutes per incident)."""

    name: str
    incidents: float = 0.0
    detection_min: float = 0.0
    replacement_min: float = 0.0
    restore_min: float = 0.0
    repeated_work_min: float = 0.0
    checkpoint_overhead: float = 0.0
    probe_overhead: float = 0.0
    false_terminations: float = 0.0
    false_termination_restore_min: float = 0.0
    false_termination_repeated_min: float = 0.0
    spare_accelerators: float = 0.0

    @classmethod
    def from_obj(cls, where: str, obj: Any) -> Config:
        if not isinstance(obj, Mapping):
            raise ConfigError(f"{where}: expected a mapping of {', '.join(sorted(_CONFIG_KEYS))}")
        unknown = set(obj) - set(_CONFIG_KEYS)
        if unknown:
            raise ConfigError(f"{where}: unknown field {sorted(unknown)[0]!r} "
                              f"(known: {', '.join(sorted(_CONFIG_KEYS))})")
        values: dict[str, Any] = {"name": str(obj.get("name", where))}
        for key in _CONFIG_KEYS:
            if key != "name" and key in obj:
                values[key] = check_number(f"{where}.{key}", obj[key], at_least=0)
        for key in ("checkpoint_overhead", "probe_overhead"):
            if values.get(key, 0.0) >= 1.0:
                raise ConfigError(f"{where}.{key} is a fraction below 1, got {values[key]}")
        return cls(**values)


@dataclass(frozen=True)
class Ledger:
    """Charged accelerator-hours of one design over the period, by category (each rounded to 0.01)."""

    config: Config
    hours: dict[str, float]
    dollars: dict[str, float]
    charged_h: float
    useful_h: float

    @property
    def lost_h(self) -> float:
        return round(sum(v for k, v in self.hours.items() if k != "healthy"), 2)

    @property
    def lost_usd(self) -> float:
        return round(sum(v for k, v in self.dollars.items() if k != "healthy"), 2)

    @property
    def healthy_rate(self) -> float:
        """Correct work per accelerator-hour while healthy (1 − probe overhead)."""
        return 1.0 - self.config.probe_overhead

    @property
    def effective_rate(self) -> float:
        """Correct completed work per charged accelerator-hour (seed 003: U / A)."""
        return self.useful_h / self.charged_h

    def to_obj(self) -> dict[str, Any]:
        return {"name": self.config.name, "hours": self.hours, "dollars": self.dollars,
                "charged_h": self.charged_h, "lost_h": self.lost_h, "lost_usd": self.lost_usd,
                "useful_h": self.useful_h, "healthy_rate": self.healthy_rate,
                "effective_rate": self.effective_rate}


@dataclass(frozen=True)
class Comparison:
    """A baseline and a candidate priced over the same period; ``saved_*`` is baseline − candidate
    per category (positive: the candidate charges less), and ``net_*`` the sum over loss categories."""

    name: str
    accelerators: float
    price: float
    period_h: float
    baseline: Ledger
    candidate: Ledger
    saved_h: dict[str, float] = field(default_factory=dict)
    saved_usd: dict[str, float] = field(default_factory=dict)

    @property
    def net_saved_h(self) -> float:
        return round(self.baseline.lost_h - self.candidate.lost_h, 2)

    @property
    def net_saved_usd(self) -> float:
        return round(self.baseline.lost_usd - self.candidate.lost_usd, 2)

    def to_obj(self) -> dict[str, Any]:
        return {"name": self.name, "accelerators": self.accelerators, "price_per_accelerator_hour": self.price,
                "period_h": self.period_h, "baseline": self.baseline.to_obj(),
                "candidate": self.candidate.to_obj(), "saved_h": self.saved_h, "saved_usd": self.saved_usd,
                "net_saved_h": self.net_saved_h, "net_saved_usd": self.net_saved_usd}

    def to_text(self) -> str:
        b, c = self.baseline, self.candidate
        lines = [f"{self.name}: {self.accelerators:g} accelerators, {self.period_h:g} h, "
                 f"${self.price:.2f} per accelerator-hour",
                 f"{'category':<24}{'baseline h':>12}{'candidate h':>13}{'saved h':>11}{'saved $':>12}"]
        for k in CATEGORIES:
            saved = (f"{self.saved_h[k]:>11.2f}{self.saved_usd[k]:>12.2f}" if k in self.saved_h
                     else f"{'':>11}{'':>12}")
            lines.append(f"{k:<24}{b.hours[k]:>12.2f}{c.hours[k]:>13.2f}{saved}")
        lines += [f"effective useful rate: baseline {b.effective_rate:.5f}, candidate {c.effective_rate:.5f}",
                  f"net saved: {self.net_saved_h:.2f} accelerator-hours, ${self.net_saved_usd:.2f} per period"]
        return "\n".join(lines)


def _ledger(cfg: Config, accelerators: float, price: float, period_h: float) -> Ledger:
    n = accelerators
    raw = {
        "checkpoint_interference": n * period_h * cfg.checkpoint_overhead,
        "detection": cfg.incidents * cfg.detection_min * n / 60.0,
        "replacement": cfg.incidents * cfg.replacement_min * n / 60.0,
        "restore": cfg.incidents * cfg.restore_min * n / 60.0,
        "repeated_work": cfg.incidents * cfg.repeated_work_min * n / 60.0,
        "false_terminations": cfg.false_terminations * (cfg.false_termination_restore_min
                                                        + cfg.false_termination_repeated_min) * n / 60.0,
        "idle_spares": cfg.spare_accelerators * period_h,
    }
    charged = (n + cfg.spare_accelerators) * period_h
    healthy = charged - sum(raw.values())
    if healthy < 0:
        raise ConfigError(f"{cfg.name}: losses of {charged - healthy:.2f} accelerator-hours exceed the "
                          f"{charged:.2f} charged in the period")
    raw = {"healthy": healthy, **raw}
    hours = {k: round(raw[k], 2) for k in CATEGORIES}
    dollars = {k: round(raw[k] * price, 2) for k in CATEGORIES}
    return Ledger(config=cfg, hours=hours, dollars=dollars, charged_h=round(charged, 2),
                  useful_h=round(healthy * (1.0 - cfg.probe_overhead), 2))


def compare(baseline: Config, candidate: Config, *, accelerators: float, price: float, period_h: float,
            name: str = "comparison") -> Comparison:
    """Price both designs and their difference (seed 003 "Worked example: Valuing faster detection")."""
    n = check_number("accelerators", accelerators, above=0)
    p = check_number("price_per_accelerator_hour", price, at_least=0)
    h = check_number("period_h", period_h, above=0)
    a, b = _ledger(baseline, n, p, h), _ledger(candidate, n, p, h)
    keys = CATEGORIES[1:]
    return Comparison(name=name, accelerators=n, price=p, period_h=h, baseline=a, candidate=b,
                      saved_h={k: round(a.hours[k] - b.hours[k], 2) for k in keys},
                      saved_usd={k: round(a.dollars[k] - b.dollars[k], 2) for k in keys})


def load_comparison(path: str | Path) -> Comparison:
    """Read a budget file (YAML or JSON) and price it; unknown fields are a :class:`ConfigError`."""
    p = Path(path)
    try:
        obj = yaml.safe_load(p.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read budget file {p}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML ({exc})") from exc
    if not isinstance(obj, Mapping):
        raise ConfigError(f"{p}: expected a mapping with {', '.join(sorted(_TOP_KEYS))}")
    unknown = set(obj) - _TOP_KEYS
    if unknown:
        raise ConfigError(f"{p}: unknown field {sorted(unknown)[0]!r} (known: {', '.join(sorted(_TOP_KEYS))})")
    for key in ("accelerators", "period_h", "baseline", "candidate"):
        if key not in obj:
            raise ConfigError(f"{p}: missing field {key!r}")
    return compare(Config.from_obj("baseline", obj["baseline"]), Config.from_obj("candidate", obj["candidate"]),
                   accelerators=obj["accelerators"], price=obj.get("price_per_accelerator_hour", 0.0),
                   period_h=obj["period_h"], name=str(obj.get("name", p.stem)))
