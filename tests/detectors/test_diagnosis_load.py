"""Diagnosis across load steps, on telemetry from independent GPU physics (``thermal_fleet.py``):
a job's start, its end, a neighbouring job starting and a power-cap change must not look like a
cooling failure; a GPU whose cooling fails at each of those moments is ``NODE_THERMAL``, a true hot
aisle at each of them ``ENVIRONMENTAL``, and a second failing GPU inside a hot aisle gets its own
diagnosis. A fleet with no fault (per-GPU thermal offsets, power-cap dips) flags no node.

Each scenario: a first job on every rack for 600 s (the thermal models learn), idle, then the
moment at ``T``; four racks of three nodes with four GPUs, data-centre names, a sample every 8 s.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fleethealth.detectors.diagnosis import Diagnoser, RackEpisodes
from fleethealth.schema import Diagnosis, Finding, FindingKind
from tests.detectors.thermal_fleet import Change, ThermalFleet

T = 900.0
THERMAL = {Diagnosis.NODE_THERMAL, Diagnosis.ENVIRONMENTAL}


def _fleet(moment: str, seed: int = 7) -> tuple[ThermalFleet, dict[str, object], tuple[float, float]]:
    """The fleet, its faults (``hot``: (node, gpu); ``aisle``: rack; ``second``: (node, gpu) failing
    in the aisle; ``also_hot``: another failing GPU) and the window in which stragglers are diagnosed."""
    f = ThermalFleet(racks=4, nodes_per_rack=3, gpus=4, every_s=8.0, seed=seed)
    r0, r1, r2, r3 = f.rack_names
    every = {r: True for r in f.rack_names}
    f.timeline.append(Change(0.0, busy=every))
    f.timeline.append(Change(600.0, busy={r: False for r in f.rack_names}))
    hot, second = (f.nodes[1], 2), (f.nodes[4], 1)
    faults: dict[str, object] = {"hot": hot, "aisle": r1, "second": second,
                                 "second_ts": T - 250 if moment == "end" else T + 150}
    if moment == "start":  # idle -> busy on three racks; the aisle was already hot, the GPU fails at the start
        f.timeline += [Change(T - 250, aisle={r1: 20.0}), Change(T, busy={r0: True, r1: True, r2: True}),
                       Change(T, cooling={hot: 2.2}), Change(T + 150, cooling={second: 2.2})]
        window = (T, T + 400)
    elif moment == "end":  # busy -> idle; the GPU and the aisle went bad before the end
        f.timeline += [Change(600.0, busy={r0: True, r1: True, r2: True}),
                       Change(T - 400, aisle={r1: 20.0}, cooling={hot: 2.2}), Change(T - 250, cooling={second: 2.2}),
                       Change(T, busy={r0: False, r1: False, r2: False})]
        window = (T - 300, T + 60)
    elif moment == "neighbour":  # a second job starts on racks 2 and 3 next to a running one
        also = (f.nodes[10], 3)
        faults["also_hot"] = also
        f.timeline += [Change(600.0, busy={r0: True, r1: True}), Change(T - 250, aisle={r1: 20.0}),
                       Change(T, busy={r2: True, r3: True}, cooling={hot: 2.2, also: 2.2}),
                       Change(T + 150, cooling={second: 2.2})]
        window = (T, T + 400)
    elif moment == "cap":  # the fleet's power cap falls from 700 W to 450 W
        f.timeline += [Change(600.0, busy={r0: True, r1: True, r2: True}),
                       Change(T - 400, aisle={r1: 32.0}, cooling={hot: 2.2}), Change(T, cap_w=450.0),
                       Change(T + 150, cooling={second: 2.2})]
        window = (T, T + 400)
    else:
        raise ValueError(moment)
    return f, faults, window


def _run(moment: str, *, faults_on: bool = True):
    """Feed the fleet to a Diagnoser; at each sample time in the window, diagnose every GPU that runs
    hot (over its limit or throttling thermally) as a straggler would be. Returns {(node, gpu): [(ts, result)]}."""
    fleet, faults, (w0, w1) = _fleet(moment)
    if not faults_on:  # the null: from the first job's end on
        w0 = 600.0
        for ch in fleet.timeline:
            ch.aisle, ch.cooling = {}, {}
    diag = Diagnoser()
    out: dict[tuple[str, int], list] = {}
    batch: list = []
    for sample in fleet.run(0.0, w1 + 4.0):
        if batch and sample.ts != batch[0].ts:
            _diagnose(diag, batch, out, w0)
            batch = []
        batch.append(sample)
    _diagnose(diag, batch, out, w0)
    return fleet, faults, out, diag


def _diagnose(diag: Diagnoser, batch: list, out: dict, w0: float) -> None:
    diag.observe(batch)
    ts = batch[0].ts
    if ts < w0:
        return
    worst = out.setdefault("worst", {"rack": -np.inf, "excess": -np.inf})
    for s in batch[::3]:  # one node per rack: what a straggler's diagnosis would compare now
        ev = diag.diagnose(s.node, None, at=ts).evidence
        worst["excess"] = max(worst["excess"], ev["excess_c"])
        if ev["rack_residual_c"] is not None:
            worst["rack"] = max(worst["rack"], ev["rack_residual_c"])
    for s in batch:
        temp = s.columns["temp_c"]
        hot = (temp >= s.columns["slowdown_temp_c"]) | (s.columns["clock_reasons"].astype(np.int64) & 0x60 != 0)
        for g in np.flatnonzero(hot).tolist():
            out.setdefault((s.node, g), []).append((ts, diag.diagnose(s.node, g, at=ts)))


MOMENTS = ["start", "end", "neighbour", "cap"]


@pytest.mark.parametrize("moment", MOMENTS)
def test_a_failing_gpu_at_a_load_step_is_node_thermal_and_a_hot_aisle_environmental(moment: str) -> None:
    fleet, faults, out, _ = _run(moment)
    out.pop("worst")
    hot = faults["hot"]
    seen = out.get(hot)
    assert seen, f"{moment}: the failing GPU {hot} never ran hot"
    kinds = {r.diagnosis for _, r in seen}
    assert kinds == {Diagnosis.NODE_THERMAL}, [(ts, r.diagnosis, r.evidence) for ts, r in seen
                                                if r.diagnosis is not Diagnosis.NODE_THERMAL][:2]
    first = seen[0][1].evidence  # the quantities compared, in the evidence from the first diagnosis on
    assert first["excess_c"] >= first["node_excess_limit_c"] and first["gpu_power_w"] is not None
    assert {"temp_c", "peer_temp_at_power_c", "peer_median_power_w", "rack_residual_c",
            "rack_residual_limit_c", "gpu_residual_c"} <= set(first)
    if "also_hot" in faults:  # the neighbouring job's own failing GPU, at its start
        also = out.get(faults["also_hot"])
        assert also and {r.diagnosis for _, r in also} == {Diagnosis.NODE_THERMAL}
    aisle = faults["aisle"]
    second = faults["second"]
    in_aisle = {k: v for k, v in out.items() if fleet.rack_of[k[0]] == aisle and k != second}
    assert in_aisle, f"{moment}: no GPU of the hot aisle ran hot"
    aisle_kinds = [(ts, k, r) for k, v in in_aisle.items() for ts, r in v]
    wrong = [(ts, k, r.diagnosis, r.evidence) for ts, k, r in aisle_kinds if r.diagnosis is not Diagnosis.ENVIRONMENTAL]
    assert len(wrong) <= 0.05 * len(aisle_kinds), wrong[:2]
    assert all(r.evidence["rack_residual_c"] is not None for _, _, r in aisle_kinds if r.evidence["cause"]
               == "rack hotter than its load explains")
    # a second GPU failing inside the hot aisle is its own node signature, not the aisle
    two = out.get(second)
    assert two, f"{moment}: the second failing GPU never ran hot"
    late = [r for ts, r in two if ts >= faults["second_ts"] + 60.0]
    assert late and {r.diagnosis for r in late} == {Diagnosis.NODE_THERMAL}, [r.evidence for r in late][:1]


@pytest.mark.parametrize("moment", MOMENTS)
def test_no_fault_no_flag_through_every_load_step(moment: str) -> None:
    """Per-GPU thermal offsets and power-cap dips, no fault: no GPU runs hot, and at every sample from
    the first job's end on, the quantities a straggler's diagnosis compares stay inside their limits
    (with a margin)."""
    fleet, _, out, diag = _run(moment, faults_on=False)
    worst = out.pop("worst")
    assert out == {}
    th = diag.thresholds
    assert worst["rack"] < th.rack_residual_c - 1.0 and worst["excess"] < th.node_excess_c - 2.0, worst
    for node in fleet.nodes:
        assert diag.diagnose(node, 0).diagnosis not in THERMAL


def test_a_rack_episode_keeps_a_node_signature_as_its_own_finding() -> None:
    fleet, faults, out, diag = _run("start")
    out.pop("worst")
    second = faults["second"]
    rack = fleet.rack_of[second[0]]
    env = sorted(((ts, k, r) for k, v in out.items() if fleet.rack_of[k[0]] == rack and k != second
                  for ts, r in v if r.diagnosis is Diagnosis.ENVIRONMENTAL), key=lambda x: x[0])
    assert env, "the aisle opened no environmental episode"
    ts2, res2 = [(ts, r) for ts, r in out[second] if r.diagnosis is Diagnosis.NODE_THERMAL and ts > env[0][0]][0]
    env = [(k, ts, r) for ts, k, r in env if ts < ts2]

    def finding(node: str, gpu: int, ts: float, result) -> Finding:
        return Finding(kind=FindingKind.STRAGGLER, node=node, ts=ts, job="j", gpu=gpu, rank=gpu, step=int(ts),
                       z=4.0, slowdown=0.2, diagnosis=result.diagnosis, detector="straggler.cusum",
                       evidence=dict(result.evidence))

    episodes = RackEpisodes()
    findings = [finding(k[0], k[1], ts, r) for k, ts, r in env[:5]] + [finding(*second, ts2, res2)]
    outcome = episodes.check(findings, diag.rack_of)
    assert [f.detector for f in outcome] == ["straggler.rack", "straggler.cusum"]
    own = outcome[1]
    assert own.node == second[0] and own.diagnosis is Diagnosis.NODE_THERMAL
    assert own.evidence["excess_c"] >= own.evidence["node_excess_limit_c"]
    assert dataclasses.asdict(own)["evidence"]["rack"] == rack
