"""The node-state table: a state is republished when something a diagnosis compares moved, or on its
heartbeat; a job stage applying the published states diagnoses as a runner that saw the samples."""

from __future__ import annotations

import numpy as np

from fleethealth.detectors.diagnosis import Diagnoser
from fleethealth.detectors.nodestate import NodeStates, StateRule
from fleethealth.schema import ClockReason, Diagnosis, NicPorts, Telemetry

GPUS = 4


def _sample(node: str, ts: float, temp: float = 60.0, *, reasons: float = 0.0, tx: float = 0.0,
            rack: str = "r1") -> Telemetry:
    nic = NicPorts.from_columns(["mlx5_0/1"], ["ib"], tx_bytes=[tx], rx_bytes=[0.0], xmit_wait=[0.0],
                                link_gbps=[400.0], up=[1.0], link_downed=[0.0])
    return Telemetry.from_columns(node, rack, ts, list(range(GPUS)), temp_c=[temp] * GPUS,
                                  slowdown_temp_c=[87.0] * GPUS, clock_reasons=[reasons] * GPUS,
                                  nvlink_links_up=[18.0] * GPUS, nvlink_links_max=[18.0] * GPUS, nic=nic)


def test_noise_below_the_steps_is_not_republished_until_the_heartbeat() -> None:
    table = NodeStates(rule=StateRule(heartbeat_s=5.0))
    published = [len(table.observe([_sample("n1", 100.0 + k, 60.0 + 0.3 * (k % 2), tx=k * 1e9)]))
                 for k in range(12)]
    # the first sample; the second, whose NIC rate is the first known; then a heartbeat every 5 s:
    # 0.3 °C of noise and a steady NIC rate are not news
    assert published == [1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1], published
    assert table.samples_total_ == 12 and table.published_total_ == 4


def test_what_a_diagnosis_compares_is_republished_at_once() -> None:
    table = NodeStates()
    table.observe([_sample("n1", 100.0, tx=0.0), _sample("n1", 101.0, tx=1e9)])
    assert table.observe([_sample("n1", 102.0, 62.0, tx=2e9)])  # 2 °C warmer
    assert table.observe([_sample("n1", 103.0, 62.0, reasons=float(ClockReason.SW_THERMAL), tx=3e9)])  # throttles
    assert table.observe([_sample("n1", 104.0, 62.0, reasons=float(ClockReason.SW_THERMAL), tx=3e9 + 45e9)])  # NIC 90 %
    assert not table.observe([_sample("n1", 104.0, 70.0)])  # not newer: ignored
    assert table.stale_total_ == 1


def test_a_job_stage_applying_published_states_diagnoses_like_the_runner_that_saw_the_samples() -> None:
    seen, applied = Diagnoser(), Diagnoser()
    rng = np.random.default_rng(3)
    for k in range(40):
        ts = 1000.0 + k
        hot = 95.0 if k >= 30 else 60.0 + rng.normal(0, 0.4)
        samples = [_sample("n1", ts, hot, reasons=float(ClockReason.SW_THERMAL) if k >= 30 else 0.0, tx=k * 1e9)]
        samples += [_sample(f"n{i}", ts, 60.0 + rng.normal(0, 0.4), tx=k * 1e9) for i in range(2, 6)]
        applied.apply(seen.observe(samples))
    a, b = seen.diagnose("n1", 0, at=1039.0), applied.diagnose("n1", 0, at=1039.0)
    assert a.diagnosis is b.diagnosis is Diagnosis.NODE_THERMAL
    assert a.evidence == b.evidence
