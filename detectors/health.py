"""Telemetry health rules: ECC, Xid, power brake, PCIe, NVLink and stalled driver calls, in episodes.

Rules (per GPU, on each node's telemetry and the node's events):

=========  ==================================================================================
``ecc``    uncorrectable errors since driver load (``critical``), a row-remap failure
           (``critical``), a row remap or page retirement pending (``warning``), retired pages
           or remapped rows growing since the node's previous sample (``warning``). A GPU
           reports one repair mechanism (Volta retires pages; Ampere, Hopper and later remap
           rows and answer NOT_SUPPORTED, NaN, for retired pages): each rule reads the fields
           that are there, and a NaN field never holds
``xid``    each Xid event, read through the Xid rulebook :mod:`fleethealth.xid` (severity,
           action, remedy); codes below ``min_xid_severity`` are counted, not reported
``power_brake`` the hardware power brake clock-event bit (``HW_POWER_BRAKE``): an external
           power event (the node's power supply or the facility asserts the brake), the kind that
           hits several nodes at once; one finding per node, listing the GPUs braked — not a
           thermal fault, whatever the temperature
``link``   PCIe link trained below its maximum generation or width (generation only while the
           GPU is busy: idle GPUs lower their PCIe generation to save power); and NVLink error
           counters (CRC flit and data, replay, recovery: ``nodestate.nvlink_errors``, the one
           NVLink error measure the diagnosis and the predictor read too) climbing at ``nvlink_errors_per_min``
           or more over ``nvlink_window_s``, with hysteresis: the rule keeps holding until the
           rate falls below ``nvlink_clear_per_min``; one finding per node (``gpu`` set when a
           single GPU holds, ``evidence["gpus"]`` lists them), ``warning``, escalating to
           ``critical`` at ``nvlink_critical_per_min``. Slow or not: a degrading link is
           reported on its own, and the policy reads a critical one as a failure risk
``stall``  the node's probe reported ``telemetry_stalled`` (a driver call that did not return
           within ``probe.stall_timeout_s``) ``stall_count`` times or more within
           ``stall_window_s`` of event time: a degrading GPU that wedges NVML or DCGM again and
           again, which skipped samples alone would hide. One ``telemetry_stall`` finding per node
           (``warning``), with the stalls' times and sources; ``gpu`` is set when every stall
           named the same GPU
``fabric`` NVSwitch systems (:mod:`fleethealth.detectors.fabric`): a GPU whose fabric registration
           completed with an error (``critical``), whose fabric manager is disconnected
           (``warning``), or that stays NOT_STARTED / IN_PROGRESS longer than ``fabric_grace_s``
           after the probe first read that state (``warning``). One ``fabric`` finding per node and
           reason (``gpu`` set when one GPU holds, ``evidence["gpus"]`` lists them, each GPU's
           fabric values in ``evidence["fabric"]``); reported, not acted on
=========  ==================================================================================

Debounced with hysteresis: an episode per (node, GPU, rule) — per Xid code for ``xid`` — opens
on the first sample (event) where the rule holds and emits one finding; it stays open while the
rule keeps holding, and closes only after ``clear_after_s`` of event time without it. A flapping
signal (a power-brake storm at 10 per second) therefore yields one finding, not thousands. An
episode whose severity rises (a pending remap that becomes uncorrectable errors) emits once more,
with ``evidence["escalated_from"]``.

Corroboration (docs/architecture.md, "Corroboration"): a finding that would remove a node — a
``critical`` ECC episode, an Xid that is critical or whose rulebook entry drains — carries
``evidence["corroboration"]`` (:class:`~fleethealth.evidence.Corroboration`): what in the node's own
stream supports it. When nothing does at once, the finding waits (at most ``corroborate_window_s``
of event time) for the node's next sample (the GPU off the bus, its ECC counters, the condition
still holding) or for the node to fall silent for ``silence_s`` while others report; then it is
emitted with what was found, or with ``by`` empty and ``missing`` saying what was not. An Xid for a
node with no telemetry in the window is emitted at once, uncorroborated.

``update(Batch(telemetry=…, events=…), now)`` or ``check(telemetry, events) -> list[Finding]``: pure, event
time only. Samples of a node older
than its newest one are ignored (``stale_total_``); NaN fields never satisfy a rule; an Xid event
without a code is counted in ``invalid_events_total_`` and skipped.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fleethealth.detectors.batch import Batch, expect
from fleethealth.detectors.fabric import fabric_faults
from fleethealth.detectors.nodestate import NVLINK_COUNTERS, nvlink_errors, stacked, zeroed
from fleethealth.detectors.state import Stateful, names
from fleethealth.detectors.window import TimeRows
from fleethealth.errors import ConfigError
from fleethealth.evidence import Corroboration, EccEvidence, XidEvidence
from fleethealth.params import check_number
from fleethealth.schema import ClockReason, Event, EventKind, Finding, FindingKind, Telemetry
from fleethealth.xid import XidSeverity, lookup

__all__ = ["HealthRules"]

_WARN, _CRIT = XidSeverity.WARNING, XidSeverity.CRITICAL


_MAX_PENDING = 10_000


@dataclass
class _Pending:
    finding: Finding
    age_s: float | None   # seconds from the node's last sample before it to the finding (None: no sample)


@dataclass
class _Episode:
    opened_ts: float
    last_ts: float
    severity: XidSeverity
    count: int = 1


_CHECKED = ("ecc_dbe_volatile", "remap_failure", "remap_pending", "retired_pending", "retired_sbe", "retired_dbe",
            "remap_correctable", "remap_uncorrectable", "clock_reasons", "util_pct", "pcie_gen", "pcie_gen_max",
            "pcie_width", "pcie_width_max", *NVLINK_COUNTERS)
"""The columns the rules read, stacked for a poll's samples (one row a sample)."""


def _col(sample: Telemetry, name: str) -> np.ndarray:
    return sample.columns[name]


class HealthRules(Stateful):
    """ECC / Xid / power-brake / PCIe / NVLink rules with episode debouncing (see the module docstring).

    Parameters (keyword-only, checked on the first ``update``): ``clear_after_s`` quiet event
    time that closes an episode; ``pcie_busy_util_pct`` utilisation above which a lower PCIe
    generation counts as downtraining; ``min_xid_severity`` the least severe Xid reported;
    ``corroborate_window_s`` how recent a node's telemetry must be, and how long a removing finding waits
    for support; ``silence_s`` how long a reporting node must stay silent to support an Xid;
    ``nvlink_errors_per_min`` the NVLink error rate (all four counters summed, over
    ``nvlink_window_s``, measured once at least half the window is seen) that opens a ``link``
    episode and ``nvlink_clear_per_min`` the rate below which it stops holding; at
    ``nvlink_critical_per_min`` the episode escalates to ``critical``; ``stall_count`` the
    ``telemetry_stalled`` events of one node within ``stall_window_s`` that make a finding;
    ``fabric_grace_s`` how long a GPU may stay NOT_STARTED / IN_PROGRESS on the fabric.
    """

    name = "health"
    fabric_grace_s = 900.0
    """The class default too: a snapshot written before the fabric rule existed restores with it."""

    def __init__(self, *, clear_after_s: float = 3600.0, pcie_busy_util_pct: float = 10.0,
                 min_xid_severity: str = "warning", nvlink_errors_per_min: float = 10.0,
                 nvlink_clear_per_min: float = 2.0, nvlink_critical_per_min: float = 100.0,
                 nvlink_window_s: float = 300.0, corroborate_window_s: float = 600.0,
                 silence_s: float = 30.0, stall_count: int = 3, stall_window_s: float = 3600.0,
                 fabric_grace_s: float = 900.0) -> None:
        self.clear_after_s = clear_after_s
        self.corroborate_window_s = corroborate_window_s
        self.silence_s = silence_s
        self.pcie_busy_util_pct = pcie_busy_util_pct
        self.min_xid_severity = min_xid_severity
        self.nvlink_errors_per_min = nvlink_errors_per_min
        self.nvlink_clear_per_min = nvlink_clear_per_min
        self.nvlink_critical_per_min = nvlink_critical_per_min
        self.nvlink_window_s = nvlink_window_s
        self.stall_count = stall_count
        self.stall_window_s = stall_window_s
        self.fabric_grace_s = fabric_grace_s

    def _start(self) -> None:
        check_number("clear_after_s", self.clear_after_s, above=0, owner=self)
        check_number("pcie_busy_util_pct", self.pcie_busy_util_pct, at_least=0, at_most=100.0, owner=self)
        check_number("nvlink_errors_per_min", self.nvlink_errors_per_min, above=0, owner=self)
        check_number("nvlink_clear_per_min", self.nvlink_clear_per_min, at_least=0,
                     at_most=self.nvlink_errors_per_min, owner=self)
        check_number("nvlink_critical_per_min", self.nvlink_critical_per_min, at_least=self.nvlink_errors_per_min,
                     owner=self)
        check_number("nvlink_window_s", self.nvlink_window_s, above=0, owner=self)
        check_number("corroborate_window_s", self.corroborate_window_s, above=0, owner=self)
        check_number("silence_s", self.silence_s, above=0, at_most=self.corroborate_window_s, owner=self)
        check_number("stall_count", self.stall_count, at_least=1, owner=self)
        check_number("stall_window_s", self.stall_window_s, above=0, owner=self)
        check_number("fabric_grace_s", self.fabric_grace_s, above=0, owner=self)
        try:
            self.min_severity_ = XidSeverity(self.min_xid_severity)
        except ValueError:
            known = ", ".join(s.value for s in XidSeverity)
            raise ConfigError(f"HealthRules: min_xid_severity must be one of {known}, "
                              f"got {self.min_xid_severity!r}") from None
        self.episodes_: dict[tuple[str, int | None, str], _Episode] = {}
        self.previous_: dict[str, Telemetry] = {}
        self.nvlink_: dict[str, TimeRows] = {}  # node -> errors per GPU in the window
        self.nvlink_hot_: set[tuple[str, int]] = set()
        self.stale_total_ = 0
        self.suppressed_total_ = 0
        self.xid_below_min_total_ = 0
        self.invalid_events_total_ = 0
        self.stalls_: dict[str, deque[Event]] = {}  # node -> its telemetry_stalled events within the window
        self.pending_: dict[tuple[str, int | None, str], _Pending] = {}
        self.newest_ts_ = float("-inf")
        self.sample_before_: float | None = None  # the previous sample's time of the node being read

    def forget(self, jobs: Iterable[str] = (), nodes: Iterable[str] = ()) -> None:
        """Drop ``nodes``' previous samples, episodes, NVLink windows and the findings waiting for their
        corroboration (the rules are per node: they hold nothing per job)."""
        names("jobs", jobs)
        gone = names("nodes", nodes)
        if not gone or not hasattr(self, "episodes_"):
            return
        for node in gone:
            self.previous_.pop(node, None)
            self.nvlink_.pop(node, None)
        self.episodes_ = {k: v for k, v in self.episodes_.items() if k[0] not in gone}
        self.pending_ = {k: v for k, v in self.pending_.items() if k[0] not in gone}
        self.nvlink_hot_ = {k for k in self.nvlink_hot_ if k[0] not in gone}

    # ------------------------------------------------------------ episodes
    def _hit(self, key: tuple[str, int | None, str], ts: float, severity: XidSeverity) -> XidSeverity | None:
        """Record that a rule holds; return None if suppressed, else the severity it rose from (or itself)."""
        ep = self.episodes_.get(key)
        if ep is None or ts - ep.last_ts > self.clear_after_s:
            self.episodes_[key] = _Episode(ts, ts, severity)
            return severity
        ep.last_ts = max(ep.last_ts, ts)
        ep.count += 1
        if severity.rank > ep.severity.rank:
            before, ep.severity = ep.severity, severity
            return before
        self.suppressed_total_ += 1
        return None

    def _emit(self, kind: FindingKind, node: str, gpu: int | None, ts: float, severity: XidSeverity,
              facts: XidEvidence | EccEvidence | dict[str, Any], *, rule: str, job: str | None = None,
              step: int | None = None) -> list[Finding]:
        """One finding when the episode opens or escalates; typed ``facts`` get severity and escalation set."""
        before = self._hit((node, gpu, rule), ts, severity)
        if before is None:
            return []
        escalated = before.value if before is not severity else None
        if isinstance(facts, dict):
            evidence = {"severity": severity.value, **facts}
            if escalated is not None:
                evidence["escalated_from"] = escalated
        else:
            evidence = dataclasses.replace(facts, severity=severity.value, escalated_from=escalated).to_evidence()
        # the episode (at this severity) begins with this sample or event: an escalation is its own
        finding = Finding(kind=kind, node=node, ts=float(ts), job=job, gpu=gpu, step=step,
                          detector=f"{self.name}.{kind.value}", evidence=evidence, episode_ts=float(ts))
        if not _removes(kind, severity, facts):
            return [finding]
        return self._corroborate(finding, rule, escalated is not None)

    # ------------------------------------------------------------ corroboration
    def _corroborate(self, f: Finding, rule: str, escalated: bool) -> list[Finding]:
        """``f`` with what supports it now, or nothing yet (held in ``pending_`` for the node's next signal)."""
        last = self.sample_before_ if f.kind is FindingKind.ECC else (
            self.previous_[f.node].ts if f.node in self.previous_ else None)
        age = None if last is None or f.ts - last > self.corroborate_window_s else max(f.ts - last, 0.0)
        by = []
        if escalated or any(k[0] == f.node and k != (f.node, f.gpu, rule) and (k[2] == "ecc" or k[2].startswith("xid"))
                            and ep.opened_ts < f.ts and f.ts - ep.last_ts <= self.corroborate_window_s
                            for k, ep in self.episodes_.items()):
            by.append("prior_fault")
        if (f.kind is FindingKind.XID and age is not None and f.gpu is not None
                and _off_bus(self.previous_[f.node], f.gpu)):
            by.append("gpu_off_bus")
        if by:
            return [_with(f, by, age, "")]
        if age is None and f.kind is FindingKind.XID:
            return [_with(f, (), None, f"no telemetry from {f.node} in the {self.corroborate_window_s:.0f} s before "
                          "the event")]
        if len(self.pending_) >= _MAX_PENDING:
            return [_with(f, (), age, "not held for corroboration: too many findings waiting")]
        self.pending_[(f.node, f.gpu, rule)] = _Pending(f, age)
        return []

    def _resolve(self, s: Telemetry) -> list[Finding]:
        """Findings of ``s.node`` waiting for its next sample, decided by ``s``."""
        out: list[Finding] = []
        for key, p in list(self.pending_.items()):
            f = p.finding
            if key[0] != s.node or s.ts <= f.ts:
                continue
            del self.pending_[key]
            by: list[str] = []
            if f.kind is FindingKind.XID:
                if f.gpu is not None and _off_bus(s, f.gpu):
                    by.append("gpu_off_bus")
                if f.gpu is not None and _ecc_bad(s, f.gpu):
                    by.append("ecc_counters")
                missing = f"{s.node}'s next sample shows GPU {f.gpu} on the bus with sound ECC counters"
            else:
                if f.gpu is not None and _ecc_critical(s, f.gpu):
                    by.append("counters_persist")
                missing = f"{s.node}'s next sample does not show GPU {f.gpu}'s uncorrectable errors again"
            out.append(_with(f, by, p.age_s, "" if by else missing))
        return out

    def _expire(self) -> list[Finding]:
        """Held Xids of a node silent for ``silence_s`` (supported), and findings waiting past the window (not)."""
        out: list[Finding] = []
        for key, p in list(self.pending_.items()):
            f = p.finding
            waited = self.newest_ts_ - f.ts
            last = self.previous_.get(f.node)
            silent = last is None or last.ts <= f.ts
            if f.kind is FindingKind.XID and p.age_s is not None and silent and waited >= self.silence_s:
                del self.pending_[key]
                out.append(_with(f, ["telemetry_silent"], p.age_s, ""))
            elif waited > self.corroborate_window_s:
                del self.pending_[key]
                out.append(_with(f, (), p.age_s, f"nothing in {f.node}'s own stream supported it within "
                                 f"{self.corroborate_window_s:.0f} s"))
        return out

    # ------------------------------------------------------------ rules
    def _telemetry_many(self, samples: list[Telemetry]) -> list[Finding]:
        """:meth:`_telemetry` of each sample (in event-time order), the thresholds checked in one NumPy pass
        over the samples of one GPU count: a sample that trips no ECC, power-brake or PCIe rule (and has no
        fabric rows) only has its NVLink history kept, with its NVLink errors from the same pass; the rest
        go through :meth:`_telemetry` whole."""
        prevs: list[Telemetry | None] = []
        last: dict[str, Telemetry] = {}
        for s in samples:  # each sample's previous one, as _telemetry will find it
            p = last.get(s.node) or self.previous_.get(s.node)
            prevs.append(p)
            if p is None or s.ts > p.ts:
                last[s.node] = s
        tripped = np.ones(len(samples), dtype=bool)
        errors: list[np.ndarray | None] = [None] * len(samples)
        shapes: dict[tuple[int, ...], list[int]] = {}
        for j, s in enumerate(samples):
            if s.fabric is None:
                shapes.setdefault(s.gpu.shape, []).append(j)
        for rows in shapes.values():
            part = [samples[j] for j in rows]
            cols = {name: stacked([s.columns[name] for s in part]) for name in _CHECKED}
            trip = (cols["ecc_dbe_volatile"] > 0) | (cols["remap_failure"] > 0) | (cols["remap_pending"] > 0) \
                | (cols["retired_pending"] > 0)
            trip |= (zeroed(cols["clock_reasons"]).astype(np.int64) & int(ClockReason.HW_POWER_BRAKE)) != 0
            busy = ~(cols["util_pct"] < self.pcie_busy_util_pct)
            trip |= ((cols["pcie_gen"] < cols["pcie_gen_max"]) & busy) | (cols["pcie_width"] < cols["pcie_width_max"])
            hit = trip.any(axis=1)
            # retired pages or remapped rows grown since the node's previous sample (same GPUs)
            have = [k for k, j in enumerate(rows)
                    if prevs[j] is not None and prevs[j].gpu.shape == samples[j].gpu.shape]  # type: ignore[union-attr]
            if have:
                before = [prevs[rows[k]] for k in have]
                gpus = stacked([s.gpu for s in part])[have]
                same = (stacked([p.gpu for p in before]) == gpus).all(axis=1)  # type: ignore[union-attr]
                for now, names in ((cols["retired_sbe"] + cols["retired_dbe"], ("retired_sbe", "retired_dbe")),
                                   (cols["remap_correctable"] + cols["remap_uncorrectable"],
                                    ("remap_correctable", "remap_uncorrectable"))):
                    then = stacked([p.columns[names[0]] for p in before]) + \
                        stacked([p.columns[names[1]] for p in before])  # type: ignore[union-attr]
                    hit[have] |= same & ((now[have] - then) > 0).any(axis=1)
            errs = nvlink_errors(cols)
            for k, j in enumerate(rows):
                tripped[j] = hit[k]
                errors[j] = errs[k]
        out: list[Finding] = []
        for s, trip_, errs_ in zip(samples, tripped.tolist(), errors, strict=True):
            if trip_:
                out += self._telemetry(s)
                continue
            prev = self.previous_.get(s.node)
            if prev is not None and s.ts <= prev.ts:
                self.stale_total_ += 1
                continue
            self.previous_[s.node] = s
            self.newest_ts_ = max(self.newest_ts_, s.ts)
            self.sample_before_ = None if prev is None else prev.ts
            if self.pending_:
                out += self._resolve(s)
            out += self._nvlink(s, errs_)
        return out

    def _telemetry(self, s: Telemetry) -> list[Finding]:
        prev = self.previous_.get(s.node)
        if prev is not None and s.ts <= prev.ts:
            self.stale_total_ += 1
            return []
        self.previous_[s.node] = s
        self.newest_ts_ = max(self.newest_ts_, s.ts)
        self.sample_before_ = None if prev is None else prev.ts
        out: list[Finding] = self._resolve(s) if self.pending_ else []
        dbe = _col(s, "ecc_dbe_volatile")
        failure = _col(s, "remap_failure") > 0
        pending = (_col(s, "remap_pending") > 0) | (_col(s, "retired_pending") > 0)
        retired = _col(s, "retired_sbe") + _col(s, "retired_dbe")
        remapped = _col(s, "remap_correctable") + _col(s, "remap_uncorrectable")
        grown = remapped_grown = np.zeros(s.gpu.shape, dtype=bool)
        if prev is not None and prev.gpu.shape == s.gpu.shape and np.array_equal(prev.gpu, s.gpu):
            grown = retired - (_col(prev, "retired_sbe") + _col(prev, "retired_dbe")) > 0
            remapped_grown = remapped - (_col(prev, "remap_correctable") + _col(prev, "remap_uncorrectable")) > 0
        critical = (dbe > 0) | failure
        ecc = critical | pending | grown | remapped_grown
        for i in np.flatnonzero(ecc).tolist():
            reasons = [name for name, hit in (("uncorrectable", dbe[i] > 0), ("remap_failure", failure[i]),
                                              ("pending", pending[i]), ("retired_growth", grown[i]),
                                              ("remap_growth", remapped_grown[i])) if hit]
            ev = EccEvidence(reasons=tuple(reasons), uncorrectable=_f(dbe[i]), remap_failure=bool(failure[i]),
                             remap_pending=_f(_col(s, "remap_pending")[i]), retired_pages=_f(retired[i]),
                             corrected_volatile=_f(_col(s, "ecc_sbe_volatile")[i]), remapped_rows=_f(remapped[i]))
            out += self._emit(FindingKind.ECC, s.node, int(s.gpu[i]), s.ts, _CRIT if critical[i] else _WARN, ev,
                              rule="ecc")
        bits = zeroed(_col(s, "clock_reasons")).astype(np.int64)
        braked = np.flatnonzero(bits & int(ClockReason.HW_POWER_BRAKE))
        if braked.size:
            power, limit = _col(s, "power_w"), _col(s, "power_limit_w")
            ev = {"gpus": [int(g) for g in s.gpu[braked]],
                  "clock_reasons": sorted({r.name for i in braked.tolist() for r in ClockReason if r & int(bits[i])}),
                  "power_w": [_f(power[i]) for i in braked.tolist()],
                  "power_limit_w": [_f(limit[i]) for i in braked.tolist()],
                  "temp_c": [_f(_col(s, "temp_c")[i]) for i in braked.tolist()]}
            out += self._emit(FindingKind.POWER_BRAKE, s.node, None, s.ts, _WARN, ev, rule="power_brake")
        out += self._nvlink(s)
        gen, gen_max = _col(s, "pcie_gen"), _col(s, "pcie_gen_max")
        width, width_max = _col(s, "pcie_width"), _col(s, "pcie_width_max")
        util = _col(s, "util_pct")
        busy = ~(util < self.pcie_busy_util_pct)  # unknown utilisation counts as busy
        low = ((gen < gen_max) & busy) | (width < width_max)
        for i in np.flatnonzero(low).tolist():
            ev = {"pcie_gen": _f(gen[i]), "pcie_gen_max": _f(gen_max[i]), "pcie_width": _f(width[i]),
                  "pcie_width_max": _f(width_max[i]), "util_pct": _f(util[i])}
            out += self._emit(FindingKind.LINK, s.node, int(s.gpu[i]), s.ts, _WARN, ev, rule="pcie")
        out += self._fabric(s)
        return out

    def _fabric(self, s: Telemetry) -> list[Finding]:
        """GPUs not (properly) on the NVSwitch fabric: one finding per node and reason (module docstring)."""
        out: list[Finding] = []
        for reason, rows in fabric_faults(s, self.fabric_grace_s):
            gpus = [int(g) for g in s.gpu[rows]]
            fabric = s.fabric
            ev = {"rule": "fabric", "reason": reason, "gpus": gpus, "grace_s": self.fabric_grace_s,
                  "fabric": [] if fabric is None else [fabric.describe(int(i)) for i in rows.tolist()]}
            severity = _CRIT if reason == "registration_failed" else _WARN
            out += self._emit(FindingKind.FABRIC, s.node, gpus[0] if len(gpus) == 1 else None, s.ts, severity, ev,
                              rule=f"fabric_{reason}")
        return out

    def _nvlink(self, s: Telemetry, errors: np.ndarray | None = None) -> list[Finding]:
        """NVLink error counters climbing: the rate over the window, with hysteresis (see the module docstring).
        ``errors``: the sample's :func:`nvlink_errors` (a poll's are computed at once)."""
        if errors is None:
            errors = nvlink_errors(s.columns)
        hist = self.nvlink_.get(s.node)
        if hist is None or not len(hist) or hist.shape != errors.shape or (errors < hist.rows[-1]).any():
            hist = self.nvlink_[s.node] = TimeRows(errors.shape)  # a new GPU set or a counter reset (driver reload)
        hist.append(s.ts, errors)
        hist.keep_covering(s.ts - self.nvlink_window_s, least=2)
        t0, first = float(hist.ts[0]), hist.rows[0]
        span = s.ts - t0
        if span < self.nvlink_window_s / 2:
            return []
        rate = (errors - first) / span * 60.0
        if not self.nvlink_hot_ and not (rate >= min(self.nvlink_errors_per_min, self.nvlink_clear_per_min)).any():
            return []  # no GPU over either threshold and none holding: nothing starts, holds or clears
        holding: list[int] = []
        for i, g in enumerate(s.gpu.tolist()):
            key = (s.node, int(g))
            hot = key in self.nvlink_hot_
            if rate[i] >= self.nvlink_errors_per_min or (hot and rate[i] >= self.nvlink_clear_per_min):
                self.nvlink_hot_.add(key)
                holding.append(i)
            elif hot:
                self.nvlink_hot_.discard(key)
        if not holding:
            return []
        # one episode per node: a degraded NVSwitch or bridge shows on every GPU behind it
        worst = max(holding, key=lambda i: rate[i])
        ev = {"rule": "nvlink", "gpus": [int(s.gpu[i]) for i in holding],
              "errors_per_min": round(float(rate[worst]), 3), "window_s": round(span, 3),
              "errors_total": float(errors[worst]), "threshold_per_min": self.nvlink_errors_per_min,
              **{name: _f(_col(s, name)[worst]) for name in ("nvlink_crc_flit", "nvlink_crc_data",
                                                                "nvlink_replay", "nvlink_recovery")}}
        gpu = int(s.gpu[worst]) if len(holding) == 1 else None
        severity = _CRIT if rate[worst] >= self.nvlink_critical_per_min else _WARN
        return self._emit(FindingKind.LINK, s.node, gpu, s.ts, severity, ev, rule="nvlink")

    def _xid(self, e: Event) -> list[Finding]:
        if e.code is None:
            self.invalid_events_total_ += 1  # an Xid without its code says nothing to act on
            return []
        info = lookup(e.code)
        severity = info.severity
        claimed = e.data.get("severity")
        if isinstance(claimed, str) and claimed.lower() in {s.value for s in XidSeverity}:
            severity = max(severity, XidSeverity(claimed.lower()), key=lambda s: s.rank)
        if severity.rank < self.min_severity_.rank:
            self.xid_below_min_total_ += 1
            return []
        ev = XidEvidence(code=e.code, name=info.name, action=info.action, remedy=info.remedy,
                         hardware=info.hardware, message=e.message)
        return self._emit(FindingKind.XID, e.node, e.gpu, e.ts, severity, ev, rule=f"xid{e.code}", job=e.job,
                          step=e.step)

    def _stall(self, e: Event) -> list[Finding]:
        """A ``telemetry_stalled`` event: a finding once ``stall_count`` fall within ``stall_window_s``."""
        window = self.stalls_.setdefault(e.node, deque())
        window.append(e)
        while window and window[0].ts <= e.ts - self.stall_window_s:
            window.popleft()
        while len(window) > self.stall_count:  # bounded: only the last stall_count are evidence
            window.popleft()
        if len(window) < self.stall_count:
            return []
        gpus = {s.gpu for s in window}
        gpu = gpus.pop() if len(gpus) == 1 else None
        ev = {"rule": "stall", "stalls": len(window), "window_s": self.stall_window_s,
              "first_ts": window[0].ts, "stall_ts": [s.ts for s in window],
              "sources": sorted({str(s.data.get("source", "")) for s in window} - {""}),
              "threshold": self.stall_count}
        return self._emit(FindingKind.TELEMETRY_STALL, e.node, gpu, e.ts, _WARN, ev, rule="stall")

    def update(self, batch: Batch, now: float) -> list[Finding]:
        """:meth:`check` of ``batch.telemetry`` and ``batch.events`` (``now`` is not read)."""
        batch = expect(batch, self)
        return self.check(batch.telemetry, batch.events)

    def check(self, telemetry: Sequence[Telemetry], events: Sequence[Event] = ()) -> list[Finding]:
        """Apply the rules to new samples and events (each in event-time order); return new findings."""
        if not hasattr(self, "episodes_"):
            self._start()
        out: list[Finding] = []
        samples = sorted(telemetry, key=lambda s: s.ts)
        if len(samples) > 1:
            out += self._telemetry_many(samples)
        else:
            for sample in samples:
                out += self._telemetry(sample)
        for event in sorted(events, key=lambda e: e.ts):
            if event.kind is EventKind.XID:
                out += self._xid(event)
            elif event.kind is EventKind.TELEMETRY_STALLED:
                out += self._stall(event)
        if self.pending_:
            for node in {k[0] for k in self.pending_}:  # a sample already newer than a held event decides it
                if node in self.previous_:
                    out += self._resolve(self.previous_[node])
            out += self._expire()
        return out


def _removes(kind: FindingKind, severity: XidSeverity, facts: Any) -> bool:
    """Whether the policy would take the node out for this finding (so it needs corroboration)."""
    if kind is FindingKind.ECC:
        return severity is _CRIT
    if kind is FindingKind.XID:
        return severity is _CRIT or (isinstance(facts, XidEvidence) and facts.code is not None
                                     and lookup(facts.code).drains)
    return False


def _with(f: Finding, by: Sequence[str], age: float | None, missing: str) -> Finding:
    c = Corroboration(by=tuple(by), missing=missing, telemetry_age_s=None if age is None else round(age, 3))
    return dataclasses.replace(f, evidence={**f.evidence, "corroboration": c.to_evidence()})


def _gpu_index(s: Telemetry, gpu: int) -> int | None:
    hit = np.flatnonzero(s.gpu == gpu)
    return int(hit[0]) if hit.size else None


def _off_bus(s: Telemetry, gpu: int) -> bool:
    """The GPU is missing from the sample, or reads as NaN in temperature and power (fallen off the bus)."""
    i = _gpu_index(s, gpu)
    return i is None or bool(np.isnan(_col(s, "temp_c")[i]) and np.isnan(_col(s, "power_w")[i]))


def _ecc_critical(s: Telemetry, gpu: int) -> bool:
    i = _gpu_index(s, gpu)
    return i is not None and bool(_col(s, "ecc_dbe_volatile")[i] > 0 or _col(s, "remap_failure")[i] > 0)


def _ecc_bad(s: Telemetry, gpu: int) -> bool:
    i = _gpu_index(s, gpu)
    return i is not None and bool(_ecc_critical(s, gpu) or _col(s, "remap_pending")[i] > 0
                                  or _col(s, "retired_pending")[i] > 0)


def _f(x: float) -> float | None:
    return None if not np.isfinite(x) else float(x)
