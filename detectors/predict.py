"""Failure prediction: per-GPU health features over sliding windows → P(failure within a horizon).

Seed 000 §9.6: ECC error rates, thermal trends and NVLink retries often precede hard failures;
draining a node before it dies turns a 600 s interruption into a checkpoint-boundary restart.

:class:`GpuFeatures` turns a node's telemetry stream and its Xid events into one feature row per
GPU for each ``resolution_s`` interval of event time (the interval's first sample, on a grid from
ts 0, so the rows do not depend on where a history began: a restored snapshot, a stage rebuilt from
its group's commit, how the input was batched), columnar over the node's GPUs (names in
:data:`FEATURES`): corrected-ECC rate over three windows, its trend and acceleration, the count
in the short window and the volatile count, retired-page and row-remap growth, pending remaps and
retirements, uncorrected errors, Xid counts by class (ECC, NVLink, other hardware, application), temperature slope and
margin to the slowdown limit, NVLink and PCIe error rates, and NVLink links down. A GPU that
falls off the bus (Xid 79) or is reported lost starts a fresh history: its replacement is judged
on its own counters. Retired-page and row-remap fields a GPU model does not report (Hopper and
Ampere retire no pages, Volta remaps no rows) stay NaN through their features, which the
classifier routes as "not reported" (the shipped model was trained on generated Volta, Ampere
and Hopper runs with those NaNs, and on simulator runs from before the simulated H100 stopped
reporting retired pages; ``bench/predictor_eval.py`` scores it on today's, NaN included); other
missing fields count as zero.

:class:`FailurePredictor` feeds those rows to a scikit-learn ``HistGradientBoostingClassifier``
(the versioned artifact in ``detectors/models/``, trained on simulator and generated runs by
``python -m fleethealth.detectors.predict_train``) and yields a ``failure_risk`` finding per GPU
episode when the probability reaches ``threshold``. ``probability`` is P(failure within
``horizon_s``); ``evidence["top_features"]`` names the features that raise it most: each row is
re-scored with one feature at a time set to its healthy reference value, and the biggest drops
are listed.

Loading an artifact trained with another scikit-learn version raises
:class:`~fleethealth.errors.ConfigError` that says how to retrain; pickled models are not
portable across versions and a silently wrong model is worse than none.
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from fleethealth.detectors.batch import Batch, expect
from fleethealth.detectors.nodestate import nvlink_errors
from fleethealth.detectors.state import StateError, Stateful, names
from fleethealth.detectors.window import TimeRows
from fleethealth.errors import ConfigError
from fleethealth.params import check_int, check_number
from fleethealth.schema import Event, EventKind, Finding, FindingKind, Telemetry
from fleethealth.xid import XidSeverity, lookup

__all__ = ["FEATURES", "MODEL_NAME", "FeatureRows", "GpuFeatures", "ModelArtifact", "load_model",
           "FailurePredictor"]

FEATURES: tuple[str, ...] = (
    "sbe_rate_recent_per_h", "sbe_rate_short_per_h", "sbe_rate_long_per_h", "sbe_trend_per_h",
    "sbe_accel_per_h", "sbe_count_short", "sbe_volatile_log",
    "retired_pages_delta", "row_remap_delta", "remap_pending", "retired_pending", "dbe_volatile",
    "xid_ecc", "xid_nvlink", "xid_hw_other", "xid_app", "temp_slope_c_per_h", "temp_margin_c",
    "nvlink_err_rate_per_h", "pcie_replay_rate_per_h", "nvlink_links_down",
)
"""Feature names, in column order."""

_GATE_COUNT = FEATURES.index("sbe_count_short")
_RULE = [FEATURES.index(n) for n in ("retired_pages_delta", "row_remap_delta", "remap_pending", "retired_pending",
                                    "dbe_volatile")]
"""The ECC rule's features: a memory repair (page retired or row remapped) within the long window,
one pending, or an uncorrected error. Each GPU model reports one repair mechanism and NaN for the
other (Hopper retires no pages), and NaN never holds, so the rule reads whichever is there."""
_GATE_ANY = [FEATURES.index(n) for n in ("retired_pages_delta", "row_remap_delta", "remap_pending", "retired_pending",
                                         "dbe_volatile", "xid_ecc")]

MODEL_NAME = "failure_risk-v1"
"""Base name of the shipped artifact: ``models/<name>.joblib`` plus ``models/<name>.json`` metadata."""

# counters kept per sample: index -> meaning
_SBE, _RETIRED, _REMAP, _PENDING, _RPENDING, _DBE, _TEMP, _NVL, _PCIE, _DOWN = range(10)
_COUNTERS = 10
_XID_ECC = frozenset({48, 63, 64, 92, 94, 95, 140})
_XID_LINK = frozenset({74})
_LOST = frozenset({79})


def _counters(s: Telemetry) -> np.ndarray:
    c = s.columns
    cols = [c["ecc_sbe_volatile"], c["retired_sbe"] + c["retired_dbe"],
            c["remap_correctable"] + c["remap_uncorrectable"], c["remap_pending"], c["retired_pending"],
            c["ecc_dbe_volatile"], c["temp_c"],
            nvlink_errors(c),
            c["pcie_replay"], c["nvlink_links_max"] - c["nvlink_links_up"]]
    out = np.stack(cols, axis=1)
    # a memory-repair field the GPU does not report stays NaN (Hopper retires no pages, Volta remaps
    # no rows): the model tells "not reported" from "none"; every other gap counts as zero
    keep = np.zeros(out.shape[1], dtype=bool)
    keep[[_RETIRED, _REMAP, _PENDING, _RPENDING]] = True
    return np.where(np.isnan(out) & ~keep, 0.0, out)


def _num(v: float) -> float | None:
    """A feature value for evidence: rounded, None where the field is not reported (JSON has no NaN)."""
    return None if math.isnan(v) else round(float(v), 4)


def _xid_class(code: int) -> int:
    if code in _XID_ECC:
        return 0
    if code in _XID_LINK:
        return 1
    info = lookup(code)
    return 2 if info.hardware and info.severity.rank >= XidSeverity.ERROR.rank else 3


@dataclass(frozen=True)
class FeatureRows:
    """Feature rows of one node's GPUs at event time ``ts``: ``X`` has shape ``(len(gpu), len(FEATURES))``."""

    node: str
    ts: float
    gpu: np.ndarray
    X: np.ndarray


class _NodeHistory:
    """One node's rows on the event-time grid (:class:`~fleethealth.detectors.window.TimeRows` of
    (GPUs, counters)), its GPUs' reset times and slowdown limits, and its Xids."""

    def __init__(self, gpus: np.ndarray) -> None:
        self.gpu = gpus.copy()
        self.rows = TimeRows((gpus.size, _COUNTERS))
        self.reset_ts = np.full(gpus.shape, -math.inf)
        self.limit = np.full(gpus.shape, math.nan)  # each GPU's slowdown temperature, from its latest sample
        self.xids: deque[tuple[float, int, int]] = deque()  # (ts, gpu row or -1, class)

    def _state_restored(self, like: object) -> None:
        gpu, rows = getattr(self, "gpu", None), getattr(self, "rows", None)
        if not isinstance(gpu, np.ndarray) or gpu.ndim != 1 or not isinstance(rows, TimeRows) \
                or rows.shape != (gpu.size, _COUNTERS):
            raise StateError(f"a failure-predictor history whose rows {getattr(rows, 'shape', None)} do not fit "
                             f"its GPUs {getattr(gpu, 'shape', None)}")


class GpuFeatures(Stateful):
    """Streaming per-GPU feature extractor (see the module docstring).

    ``recent_s`` / ``short_s`` / ``long_s`` are the window lengths (the corrected-error rate over
    each; ``sbe_trend`` is short minus long, ``sbe_accel`` recent minus short: a failing GPU's
    error rate accelerates, a merely noisy one's stays flat); a row is produced per node from the first
    sample of each ``resolution_s`` interval of event time (intervals from ts 0); the margin is to each
    GPU's own slowdown temperature (``slowdown_temp_c``), ``thermal_limit_c`` only for a GPU that does
    not report one.
    """

    def __init__(self, *, recent_s: float = 900.0, short_s: float = 3600.0, long_s: float = 6 * 3600.0,
                 resolution_s: float = 60.0, thermal_limit_c: float = 85.0) -> None:
        self.recent_s = recent_s
        self.short_s = short_s
        self.long_s = long_s
        self.resolution_s = resolution_s
        self.thermal_limit_c = thermal_limit_c

    def _start(self) -> None:
        check_number("resolution_s", self.resolution_s, above=0, owner=self)
        check_number("recent_s", self.recent_s, at_least=self.resolution_s, owner=self)
        check_number("short_s", self.short_s, at_least=self.recent_s, owner=self)
        check_number("long_s", self.long_s, at_least=self.short_s, owner=self)
        check_number("thermal_limit_c", self.thermal_limit_c, at_least=-273.0, owner=self)
        self.nodes_: dict[str, _NodeHistory] = {}
        self.lost_: dict[tuple[str, int], float] = {}
        self.stale_total_ = 0

    def forget(self, jobs: Iterable[str] = (), nodes: Iterable[str] = ()) -> None:
        """Drop the histories and lost GPUs of ``nodes`` (the features are per GPU: nothing per job)."""
        names("jobs", jobs)
        gone = names("nodes", nodes)
        if not gone or not hasattr(self, "nodes_"):
            return
        for node in gone:
            self.nodes_.pop(node, None)
        self.lost_ = {k: v for k, v in self.lost_.items() if k[0] not in gone}

    def _event(self, e: Event) -> None:
        lost = (e.kind is EventKind.XID and e.code in _LOST) or e.kind is EventKind.GPU_LOST
        if e.kind is EventKind.XID and e.code is not None:
            hist = self.nodes_.get(e.node)
            if hist is not None:
                rows = np.flatnonzero(hist.gpu == e.gpu) if e.gpu is not None else np.array([-1])
                row = int(rows[0]) if rows.size else -1
                hist.xids.append((e.ts, row, _xid_class(e.code)))
        if lost and e.gpu is not None:
            self.lost_[(e.node, int(e.gpu))] = e.ts
            hist = self.nodes_.get(e.node)
            if hist is not None:
                hist.reset_ts[hist.gpu == e.gpu] = e.ts

    def _rows(self, hist: _NodeHistory, node: str, now: float) -> FeatureRows:
        ts, vals = hist.rows.ts, hist.rows.rows  # (n,), (n, g, C)
        cur = vals[-1]
        g = np.arange(cur.shape[0])

        def ref(window: float) -> tuple[np.ndarray, np.ndarray]:
            start = np.maximum(now - window, hist.reset_ts)
            idx = np.minimum(np.searchsorted(ts, start, side="left"), ts.size - 1)
            hours = np.maximum((now - ts[idx]) / 3600.0, self.resolution_s / 3600.0)
            return vals[idx, g], hours

        ref_r, h_r = ref(self.recent_s)
        ref_s, h_s = ref(self.short_s)
        ref_l, h_l = ref(self.long_s)
        grow_s = np.clip(cur - ref_s, 0.0, None)
        grow_l = np.clip(cur - ref_l, 0.0, None)
        rate_r = np.clip(cur - ref_r, 0.0, None)[:, _SBE] / h_r
        rate_s = grow_s[:, _SBE] / h_s
        rate_l = grow_l[:, _SBE] / h_l
        # temperature slope: least squares over the long window, per GPU
        use = ts[:, None] >= np.maximum(now - self.long_s, hist.reset_ts)[None, :]
        th = (ts[:, None] - now) / 3600.0
        n = np.maximum(use.sum(axis=0), 1)
        tm = (th * use).sum(axis=0) / n
        ym = (vals[:, :, _TEMP] * use).sum(axis=0) / n
        cov = ((th - tm) * (vals[:, :, _TEMP] - ym) * use).sum(axis=0)
        var = (((th - tm) ** 2) * use).sum(axis=0)
        slope = np.where(var > 0, cov / np.where(var > 0, var, 1.0), 0.0)
        xid = np.zeros((cur.shape[0], 4))
        for t_x, row, cls in hist.xids:  # the loss event itself belongs to the old GPU
            hit = (t_x >= now - self.long_s) & (t_x > hist.reset_ts)
            if row >= 0:
                hit &= g == row
            xid[hit, cls] += 1
        X = np.column_stack([
            rate_r, rate_s, rate_l, rate_s - rate_l, rate_r - rate_s, grow_s[:, _SBE], np.log1p(cur[:, _SBE]),
            grow_l[:, _RETIRED], grow_l[:, _REMAP], cur[:, _PENDING], cur[:, _RPENDING], cur[:, _DBE],
            xid[:, 0], xid[:, 1], xid[:, 2], xid[:, 3], slope, hist.limit - cur[:, _TEMP],
            grow_s[:, _NVL] / h_s, grow_s[:, _PCIE] / h_s, cur[:, _DOWN],
        ])
        return FeatureRows(node=node, ts=now, gpu=hist.gpu.copy(), X=X)

    def update(self, batch: Batch, now: float) -> list[FeatureRows]:
        """:meth:`check` of ``batch.telemetry`` and ``batch.events`` (``now`` is not read)."""
        batch = expect(batch, self)
        return self.check(batch.telemetry, batch.events)

    def check(self, telemetry: Sequence[Telemetry], events: Sequence[Event] = ()) -> list[FeatureRows]:
        """Fold in samples and events in event-time order; return the rows produced."""
        if not hasattr(self, "nodes_"):
            self._start()
        items = sorted([(s.ts, 1, i) for i, s in enumerate(telemetry)] + [(e.ts, 0, i) for i, e in enumerate(events)])
        out: list[FeatureRows] = []
        for ts, is_sample, i in items:
            if not is_sample:
                self._event(events[i])
                continue
            s = telemetry[i]
            hist = self.nodes_.get(s.node)
            if hist is None or not np.array_equal(hist.gpu, s.gpu):
                hist = self.nodes_[s.node] = _NodeHistory(np.asarray(s.gpu))
            last = float(hist.rows.ts[-1]) if len(hist.rows) else None
            if last is not None and ts <= last:
                self.stale_total_ += 1
                continue
            # the first sample of each resolution_s interval of the event-time grid: where sampling starts
            # (a restored snapshot, a history begun mid-stream) cannot shift the rows that follow
            if last is not None and math.floor(ts / self.resolution_s) <= math.floor(last / self.resolution_s):
                continue
            hist.rows.drop_before(ts - self.long_s - self.resolution_s)
            hist.rows.append(ts, _counters(s))
            hist.limit = s.slowdown_limits(self.thermal_limit_c)
            while hist.xids and hist.xids[0][0] < ts - self.long_s:
                hist.xids.popleft()
            out.append(self._rows(hist, s.node, ts))
        return out


# ---------------------------------------------------------------- model artifact
@dataclass(frozen=True)
class ModelArtifact:
    """A trained classifier with its metadata (``features``, ``sklearn``, ``horizon_s``, ``reference``...)."""

    model: Any
    meta: dict[str, Any]

    @property
    def reference(self) -> np.ndarray:
        """Healthy reference value of each feature (medians over healthy training rows)."""
        return np.asarray(self.meta["reference"], dtype=np.float64)

    def predict_proba(self, X: np.ndarray) -> np.ndarray:
        """P(failure within the horizon) per row of ``X`` (shape ``(n, len(FEATURES))``)."""
        return self.model.predict_proba(X)[:, 1]


def _default_paths() -> tuple[Path, Path]:
    base = resources.files("fleethealth.detectors") / "models"
    return Path(str(base / f"{MODEL_NAME}.joblib")), Path(str(base / f"{MODEL_NAME}.json"))


def load_model(path: str | Path | None = None, *, check_version: bool = True) -> ModelArtifact:
    """Load ``<path>.joblib`` with its ``.json`` metadata (default: the shipped artifact).

    Raises :class:`ConfigError` when the files are missing, the features differ from
    :data:`FEATURES`, or (with ``check_version``) the artifact was trained with another
    scikit-learn version than the one installed.
    """
    if path is None:
        model_path, meta_path = _default_paths()
    else:
        model_path = Path(path)
        meta_path = model_path.with_suffix(".json")
    retrain = "retrain with `python -m fleethealth.detectors.predict_train --out DIR` and pass model=DIR"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"failure model metadata {meta_path}: cannot read ({exc}); {retrain}") from None
    if list(meta.get("features", [])) != list(FEATURES):
        raise ConfigError(f"failure model {model_path}: trained on other features ({meta.get('features')}); {retrain}")
    import sklearn

    if check_version and meta.get("sklearn") != sklearn.__version__:
        raise ConfigError(f"failure model {model_path} was trained with scikit-learn {meta.get('sklearn')} but "
                          f"{sklearn.__version__} is installed; pickled models are not portable: {retrain}")
    import joblib

    try:
        model = joblib.load(model_path)  # trusted: the configured model file, never bytes from the bus or store
    except (OSError, ValueError, EOFError) as exc:
        raise ConfigError(f"failure model {model_path}: cannot load ({exc}); {retrain}") from None
    return ModelArtifact(model=model, meta=meta)


# ---------------------------------------------------------------- detector
class FailurePredictor(Stateful):
    """``failure_risk`` findings from per-GPU features and a trained classifier.

    Parameters (keyword-only): ``model`` an artifact path, a :class:`ModelArtifact`, or None for
    the shipped one (loaded on the first ``update`` / ``check``); ``threshold`` the probability that opens an
    episode (default: the artifact's calibrated ``meta["threshold"]``); an episode closes after
    ``clear_after_s`` below ``threshold / 2``; ``quiet_after_loss_s`` mutes a GPU just reported
    lost (it is already gone); ``top_k`` features listed in the evidence; ``features`` the
    extractor (default :class:`GpuFeatures`).

    A probability is acted on only with hard evidence behind it: at least ``min_corrected``
    corrected errors within the short window, or a retired page, a row remap, a pending remap or
    retirement, an uncorrected error or an ECC Xid. A GPU that merely logs a steady trickle of
    corrected errors is noisy, not failing, however the model scores it.

    ``use_model`` (default False): the classifier is optional. Without it the detector applies the
    ECC rule — a page retired or a row remapped within the long window (on Hopper, which retires
    no pages, the row remaps), a remap or retirement pending, or an uncorrected error — and a
    finding's ``probability`` is 1.0 (the rule holds; no estimate), its ``evidence["rule"]`` the
    reasons. The rule is the default because on held-out runs of the
    harder generator (:mod:`fleethealth.detectors.failure_synth`, ``bench/predictor_eval.py``) the
    model beats it on precision, lead time and false alarms but catches fewer failing GPUs.
    """

    name = "failure_risk"

    def __init__(self, *, model: str | Path | ModelArtifact | None = None, threshold: float | None = None,
                 clear_after_s: float = 3600.0, quiet_after_loss_s: float = 1800.0, top_k: int = 3,
                 min_corrected: float = 50.0, features: GpuFeatures | None = None, use_model: bool = False) -> None:
        self.use_model = use_model
        self.min_corrected = min_corrected
        self.model = model
        self.threshold = threshold
        self.clear_after_s = clear_after_s
        self.quiet_after_loss_s = quiet_after_loss_s
        self.top_k = top_k
        self.features = features

    def _start(self) -> None:
        if self.threshold is not None:
            check_number("threshold", self.threshold, above=0, at_most=1.0, owner=self)
        check_number("clear_after_s", self.clear_after_s, at_least=0, owner=self)
        check_number("quiet_after_loss_s", self.quiet_after_loss_s, at_least=0, owner=self)
        check_int("top_k", self.top_k, at_least=0, owner=self)
        check_number("min_corrected", self.min_corrected, at_least=0, owner=self)
        if not isinstance(self.use_model, bool):
            raise ConfigError(f"FailurePredictor: use_model must be true or false, got {self.use_model!r}")
        if self.use_model:
            self.artifact_ = self.model if isinstance(self.model, ModelArtifact) else load_model(self.model)
            meta = self.artifact_.meta
        else:
            self.artifact_, meta = None, {"threshold": 1.0, "name": "ecc_rule"}
        threshold = meta.get("threshold", 0.5) if self.threshold is None else self.threshold
        self.threshold_ = check_number("threshold", threshold, above=0, at_most=1.0, owner=self)
        self.features_ = self.features if self.features is not None else GpuFeatures()
        self.episodes_: dict[tuple[str, int], float] = {}  # -> last ts at or above threshold / 2
        self.horizon_s_ = float(meta.get("horizon_s", 86_400.0))
        self.model_name_ = str(meta.get("name", MODEL_NAME))

    _state_skip = ("model", "artifact_")
    """Not state: the model comes from the configuration (``like``) or its configured path, never
    from a snapshot (:mod:`fleethealth.detectors.state`)."""

    def _state_restored(self, like: FailurePredictor | None) -> None:
        """After a restore: the model of ``like`` (the configured predictor), loaded from the
        configured path when ``like`` has not loaded it yet; the shipped one without ``like``."""
        self.model = like.model if like is not None else None
        if not hasattr(self, "threshold_"):  # not started: it starts on its first update
            return
        if not self.use_model:
            self.artifact_ = None
        elif like is not None and getattr(like, "artifact_", None) is not None:
            self.artifact_ = like.artifact_
        else:
            self.artifact_ = self.model if isinstance(self.model, ModelArtifact) else load_model(self.model)

    def _explain(self, x: np.ndarray, p: float) -> list[dict[str, Any]]:
        ref = self.artifact_.reference
        trial = np.repeat(x[None, :], len(FEATURES), axis=0)
        trial[np.arange(len(FEATURES)), np.arange(len(FEATURES))] = ref
        drop = p - self.artifact_.predict_proba(trial)
        order = [int(i) for i in np.argsort(-drop)[: self.top_k] if drop[i] > 1e-6]
        return [{"feature": FEATURES[i], "value": _num(x[i]), "reference": _num(ref[i]),
                 "probability_without": round(float(p - drop[i]), 4)} for i in order]

    def forget(self, jobs: Iterable[str] = (), nodes: Iterable[str] = ()) -> None:
        """Drop the features and the risk episodes of ``nodes``' GPUs."""
        names("jobs", jobs)
        gone = names("nodes", nodes)
        if not gone or not hasattr(self, "artifact_"):
            return
        self.features_.forget(nodes=gone)
        self.episodes_ = {k: v for k, v in self.episodes_.items() if k[0] not in gone}

    def update(self, batch: Batch, now: float) -> list[Finding]:
        """:meth:`check` of ``batch.telemetry`` and ``batch.events`` (``now`` is not read)."""
        batch = expect(batch, self)
        return self.check(batch.telemetry, batch.events)

    def check(self, telemetry: Sequence[Telemetry], events: Sequence[Event] = ()) -> list[Finding]:
        """Fold in telemetry and events; return ``failure_risk`` findings for GPUs that just crossed."""
        if not hasattr(self, "artifact_"):
            self._start()
        rows = self.features_.check(telemetry, events)
        if not rows:
            return []
        X = np.concatenate([r.X for r in rows])
        p = self.artifact_.predict_proba(X) if self.artifact_ is not None else (X[:, _RULE] > 0).any(axis=1) * 1.0
        return self.decide(rows, p, self.features_.lost_)

    def decide(self, rows: Sequence[FeatureRows], probabilities: np.ndarray,
               lost: dict[tuple[str, int], float]) -> list[Finding]:
        """The episode logic on scored rows (``probabilities`` concatenated in row order).

        ``check`` calls it; calibration replays cached scores through it. ``lost`` maps
        ``(node, gpu)`` to the event time the GPU was lost (rows shortly after are muted).
        """
        if not hasattr(self, "artifact_"):
            self._start()
        out: list[Finding] = []
        at = 0
        for r in rows:
            p = probabilities[at: at + len(r.gpu)]
            at += len(r.gpu)
            X = r.X
            hard = ((X[:, _GATE_COUNT] >= self.min_corrected) | (X[:, _GATE_ANY] > 0).any(axis=1)
                    if self.artifact_ is not None else (X[:, _RULE] > 0).any(axis=1))
            for i in np.flatnonzero((p >= self.threshold_ / 2) & hard).tolist():
                gpu = int(r.gpu[i])
                key = (r.node, gpu)
                gone = lost.get(key)
                if gone is not None and 0.0 <= r.ts - gone < self.quiet_after_loss_s:
                    continue
                last = self.episodes_.get(key)
                fresh = last is None or r.ts - last > self.clear_after_s
                if fresh and p[i] < self.threshold_:
                    continue
                self.episodes_[key] = r.ts
                if not fresh:
                    continue
                evidence = {"horizon_s": self.horizon_s_, "threshold": self.threshold_, "model": self.model_name_,
                            **({"top_features": self._explain(r.X[i], float(p[i]))} if self.artifact_ is not None
                               else {"rule": [FEATURES[j] for j in _RULE if r.X[i, j] > 0]}),
                            "features": {n: _num(v) for n, v in zip(FEATURES, r.X[i], strict=True)}}
                out.append(Finding(kind=FindingKind.FAILURE_RISK, node=r.node, ts=r.ts, gpu=gpu,
                                   probability=round(float(p[i]), 4), detector=self.name, evidence=evidence,
                                   episode_ts=float(r.ts)))
        return out
