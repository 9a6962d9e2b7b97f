"""A harder generator of GPU memory-error telemetry for training and judging the failure predictor.

The fleet simulator (:mod:`fleethealth.sim`) gives every failing GPU the same precursor: corrected
errors rising to thousands, pages retired, rows remapped, then uncorrectable errors. On that data a
three-line threshold rule is as good as any model. This generator is built to be harder and closer
to what fleets report:

- **GPU models** differ per node: ``V100`` retires pages and has no row remapper (remap fields NaN);
  ``A100``, ``H100`` and ``H200`` remap rows and do not retire pages (retired-page fields NaN).
  NVLink width, temperature and corrected-error noise differ per model.
- **Healthy GPUs are not clean**: most log no corrected errors, some a trickle, a few a heavy
  steady rate with occasional bursts; a few remap a row (or retire a page) once, which stays
  pending until a reset that never comes in the run, and never fail. Application Xids, contained
  ECC Xids (94) and NVLink errors land on healthy GPUs.
- **Failures** (Xid 79, the GPU falls off the bus; a replacement reports ``replace_gap_s`` later
  with fresh counters) come in four kinds: ``strong`` (corrected errors accelerating to
  hundreds or thousands, rows remapped, a few uncorrectable errors in the last minutes), ``weak``
  (tens of corrected errors over many hours, maybe one remap), ``fading`` (a burst of corrected
  errors and a remap 6–20 h before the failure, then quiet) and ``none`` (no precursor at all).

``make_synth_run(seed)`` is deterministic for its seed; ``stream(run)`` yields ``(telemetry,
events)`` per sampling tick in event time, the same shape :class:`~fleethealth.sim.fleet.FleetSim`
frames have, so the detectors consume both alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from fleethealth.schema import Event, EventKind, Telemetry

__all__ = ["GPU_MODELS", "KINDS", "SynthRun", "make_synth_run", "stream"]

GPU_MODELS: dict[str, dict[str, float | bool]] = {
    "V100": {"pages": True, "remap": False, "links": 6, "temp": 62.0, "noise": 1.0},
    "A100": {"pages": False, "remap": True, "links": 12, "temp": 60.0, "noise": 0.6},
    "H100": {"pages": False, "remap": True, "links": 18, "temp": 64.0, "noise": 0.8},
    "H200": {"pages": False, "remap": True, "links": 18, "temp": 66.0, "noise": 0.8},
}
"""Per model: reports retired pages, has a row remapper, NVLink links, base temperature, noise scale."""

KINDS = ("strong", "weak", "fading", "none")
"""Failure kinds, by how much warning the GPU gives."""

_KIND_P = (0.3, 0.3, 0.2, 0.2)


@dataclass(frozen=True)
class SynthRun:
    """One generated run: its ticks are built by :func:`stream` from these fields.

    ``failures`` maps ``(node, gpu)`` to the event time of the loss, ``kinds`` the same keys to the
    failure kind; ``gpu_days`` is GPUs × run length.
    """

    seed: int
    name: str
    nodes: tuple[str, ...]
    models: tuple[str, ...]
    gpus_per_node: int
    tick_s: float
    ticks: int
    failures: dict[tuple[str, int], float]
    kinds: dict[tuple[str, int], str]
    replace_gap_s: float = 600.0
    t0: float = 1_780_000_000.0

    @property
    def gpu_days(self) -> float:
        return len(self.nodes) * self.gpus_per_node * self.ticks * self.tick_s / 86_400.0


def make_synth_run(seed: int, *, nodes: int = 8, gpus_per_node: int = 8, days: float = 2.0) -> SynthRun:
    """A run of ``nodes`` × ``gpus_per_node`` GPUs over ``days``, failures and models drawn from ``seed``."""
    rng = np.random.default_rng([seed, 1414])
    tick_s = float(rng.choice([120.0, 180.0, 300.0]))
    ticks = int(days * 86_400.0 / tick_s)
    models = tuple(str(m) for m in rng.choice(list(GPU_MODELS), size=nodes, p=[0.15, 0.25, 0.35, 0.25]))
    names = tuple(f"n{i:04d}" for i in range(nodes))
    n_fail = int(np.clip(rng.poisson(3.0), 1, 6))
    cells = rng.choice(nodes * gpus_per_node, size=n_fail, replace=False)
    t0 = 1_780_000_000.0
    failures, kinds = {}, {}
    for c in cells:
        key = (names[c // gpus_per_node], int(c % gpus_per_node))
        tick = int(rng.uniform(0.3, 0.97) * ticks)
        failures[key] = t0 + tick * tick_s
        kinds[key] = str(rng.choice(KINDS, p=_KIND_P))
    return SynthRun(seed=int(seed), name=f"synth-{seed}", nodes=names, models=models, gpus_per_node=gpus_per_node,
                    tick_s=tick_s, ticks=ticks, failures=failures, kinds=kinds, t0=t0)


def _precursor(kind: str, rng: np.random.Generator, t_h: np.ndarray, fail_h: float) -> dict[str, np.ndarray]:
    """Cumulative extra counters of one failing GPU over hours ``t_h`` (failure at ``fail_h``)."""
    n = t_h.size
    sbe, remap, dbe = np.zeros(n), np.zeros(n), np.zeros(n)
    if kind == "strong":
        span = rng.uniform(2.0, 12.0)
        x = np.clip((t_h - (fail_h - span)) / span, 0.0, 1.0)
        sbe = np.floor(rng.lognormal(np.log(1500.0), 0.8) * x ** rng.uniform(1.5, 3.0))
        remap = np.floor(rng.uniform(1.0, 6.0) * x ** 2)
        dbe = np.where(t_h >= fail_h - rng.uniform(0.05, 0.5), float(rng.integers(1, 4)), 0.0)
    elif kind == "weak":
        span = rng.uniform(6.0, 20.0)
        x = np.clip((t_h - (fail_h - span)) / span, 0.0, 1.0)
        sbe = np.floor(rng.uniform(10.0, 150.0) * x ** rng.uniform(1.0, 2.0))
        if rng.random() < 0.5:
            remap = np.where(x >= rng.uniform(0.3, 0.95), 1.0, 0.0)
        if rng.random() < 0.4:
            dbe = np.where(t_h >= fail_h - rng.uniform(0.03, 0.2), 1.0, 0.0)
    elif kind == "fading":
        end = fail_h - rng.uniform(6.0, 20.0)
        span = rng.uniform(1.0, 4.0)
        x = np.clip((t_h - (end - span)) / span, 0.0, 1.0)
        sbe = np.floor(rng.lognormal(np.log(600.0), 0.7) * x)
        remap = np.floor(rng.uniform(1.0, 2.99) * np.minimum(x * 2.0, 1.0))
    return {"sbe": sbe, "remap": remap, "dbe": dbe}


def stream(run: SynthRun) -> Iterator[tuple[list[Telemetry], list[Event]]]:
    """Telemetry of every node and the events of each tick, in event time."""
    rng = np.random.default_rng([run.seed, 1415])
    g, T = run.gpus_per_node, run.ticks
    N = len(run.nodes) * g
    t_h = np.arange(T) * run.tick_s / 3600.0
    model_of = np.repeat(np.array([GPU_MODELS[m]["noise"] for m in run.models]), g)
    # healthy corrected-error noise: per GPU a steady rate per hour plus rare bursts
    cls = rng.choice(3, size=N, p=[0.7, 0.25, 0.05])
    rate = np.where(cls == 0, 0.0, np.where(cls == 1, rng.lognormal(np.log(0.5), 1.0, N),
                                            rng.lognormal(np.log(40.0), 0.9, N))) * model_of
    inc = rng.poisson(np.outer(np.full(T, run.tick_s / 3600.0), rate)).astype(np.float64)
    bursts = rng.random((T, N)) < np.where(cls == 2, 1.5, 0.1) / 86_400.0 * run.tick_s
    inc += bursts * np.floor(rng.lognormal(np.log(60.0), 1.0, (T, N)))
    sbe = np.cumsum(inc, axis=0)
    # a few healthy GPUs remap one row (or retire one page) and never fail
    remap = np.zeros((T, N))
    once = rng.random(N) < 0.04
    at = rng.integers(0, T, N)
    remap[:, once] = (np.arange(T)[:, None] >= at[None, once]).astype(np.float64)
    sbe[:, once] += remap[:, once] * np.floor(rng.uniform(5.0, 60.0, int(once.sum())))  # the errors behind it
    dbe = np.zeros((T, N))
    temp = (np.repeat(np.array([GPU_MODELS[m]["temp"] for m in run.models]), g) + rng.normal(0.0, 3.0, N)
            + rng.normal(0.0, 0.8, (T, N)))
    nvl_rate = np.where(rng.random(N) < 0.05, rng.lognormal(np.log(30.0), 1.0, N), 0.0)
    nvl = np.cumsum(rng.poisson(np.outer(np.full(T, run.tick_s / 3600.0), nvl_rate)), axis=0).astype(np.float64)
    pcie = np.cumsum(rng.poisson(0.02, (T, N)), axis=0).astype(np.float64)
    # failing GPUs: precursor on top of their noise; after the loss a fresh GPU with clean counters
    gone = np.zeros((T, N), dtype=bool)
    events: dict[int, list[Event]] = {}
    gap = int(np.ceil(run.replace_gap_s / run.tick_s))
    for (node, gpu), fail_ts in run.failures.items():
        j = run.nodes.index(node) * g + gpu
        fail_tick = int(round((fail_ts - run.t0) / run.tick_s))
        extra = _precursor(run.kinds[(node, gpu)], rng, t_h, t_h[fail_tick])
        sbe[:, j] += extra["sbe"]
        remap[:, j] = np.maximum(remap[:, j], extra["remap"])
        dbe[:, j] += extra["dbe"]
        if run.kinds[(node, gpu)] == "strong":
            temp[:, j] += np.clip(t_h - t_h[fail_tick] + 2.0, 0.0, None) * rng.uniform(0.0, 2.0)
        events.setdefault(fail_tick, []).append(Event(node=node, ts=fail_ts, kind=EventKind.XID, gpu=gpu, code=79,
                                                      message="GPU has fallen off the bus"))
        first_dbe = np.flatnonzero(extra["dbe"] > 0)
        if first_dbe.size:
            k = int(first_dbe[0])
            events.setdefault(k, []).append(Event(node=node, ts=run.t0 + k * run.tick_s + 1.0, kind=EventKind.XID,
                                                  gpu=gpu, code=48, message="double-bit ECC error"))
        after = slice(fail_tick, None)
        gone[fail_tick: fail_tick + gap, j] = True
        for arr in (sbe, remap, dbe, nvl, pcie):
            arr[after, j] -= arr[fail_tick, j]
        sbe[after, j] = np.cumsum(rng.poisson(0.02, T - fail_tick)).astype(np.float64)
        remap[after, j] = 0.0
        dbe[after, j] = 0.0
    # distractor Xids on healthy GPUs: application faults, contained ECC (94), NVLink (74)
    for _ in range(int(rng.poisson(6.0))):
        k, j = int(rng.integers(1, T)), int(rng.integers(0, N))
        code = int(rng.choice([13, 31, 43, 94, 74], p=[0.35, 0.3, 0.2, 0.1, 0.05]))
        events.setdefault(k, []).append(Event(node=run.nodes[j // g], ts=run.t0 + k * run.tick_s + 2.0,
                                              kind=EventKind.XID, gpu=j % g, code=code))
    gpus = np.arange(g)
    for k in range(T):
        ts = run.t0 + k * run.tick_s
        tel: list[Telemetry] = []
        for n, node in enumerate(run.nodes):
            spec = GPU_MODELS[run.models[n]]
            cols = slice(n * g, (n + 1) * g)
            lost = gone[k, cols]
            nan = np.full(g, np.nan)

            def col(a: np.ndarray, lost: np.ndarray = lost, nan: np.ndarray = nan) -> np.ndarray:
                return np.where(lost, nan, a)

            rm = remap[k, cols]
            pend = (rm > 0).astype(np.float64)
            zero = np.zeros(g)
            fields = {
                "temp_c": col(temp[k, cols]), "ecc_sbe_volatile": col(sbe[k, cols]),
                "ecc_dbe_volatile": col(dbe[k, cols]), "ecc_sbe_aggregate": col(sbe[k, cols]),
                "ecc_dbe_aggregate": col(dbe[k, cols]),
                "nvlink_links_up": col(np.full(g, float(spec["links"]))),
                "nvlink_links_max": col(np.full(g, float(spec["links"]))),
                "nvlink_crc_flit": col(nvl[k, cols]), "nvlink_crc_data": col(zero), "nvlink_replay": col(zero),
                "nvlink_recovery": col(zero), "pcie_replay": col(pcie[k, cols]),
            }
            if spec["pages"]:
                fields.update(retired_sbe=col(rm), retired_dbe=col(np.minimum(dbe[k, cols], 1.0)),
                              retired_pending=col(pend))
            if spec["remap"]:
                fields.update(remap_correctable=col(rm), remap_uncorrectable=col(np.minimum(dbe[k, cols], 1.0)),
                              remap_pending=col(pend), remap_failure=col(zero))
            tel.append(Telemetry.from_columns(node, f"r{n // 4:02d}", ts, gpus, model=run.models[n], **fields))
        yield tel, events.get(k, [])
