"""Power-capped stragglers: a chain of samples in which the straggler's own GPU sits at its power cap
is measured over the window before the straggler, carried as evidence, and read by the policy as a
node power fault — evicted only when the cap is persistent and the slowdown material."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fleethealth.detectors.diagnosis import Diagnoser, DiagnosisThresholds
from fleethealth.errors import ConfigError
from fleethealth.policy.engine import PolicyEngine
from fleethealth.schema import Action, ClockReason, Diagnosis, Finding, FindingKind, Guard, Telemetry

CAP = float(ClockReason.SW_POWER_CAP)
T0 = 10_000.0
RACK = "row3-rack11"


def _sample(node: str, ts: float, capped_gpu: int | None = None) -> Telemetry:
    bits = np.zeros(4)
    if capped_gpu is not None:
        bits[capped_gpu] = CAP
    return Telemetry.from_columns(node, RACK, ts, np.arange(4), temp_c=np.full(4, 60.0), clock_reasons=bits,
                                  power_w=np.full(4, 600.0), power_limit_w=np.full(4, 700.0),
                                  util_pct=np.full(4, 97.0), nvlink_links_up=np.full(4, 18.0),
                                  nvlink_links_max=np.full(4, 18.0), nic_util=0.3)


def _chain(node: str, capped: callable) -> list[Telemetry]:
    """Samples every 10 s over 600 s; GPU 2 capped where ``capped(k)`` holds for sample k."""
    return [_sample(node, T0 + 10.0 * k, 2 if capped(k) else None) for k in range(61)]


def _diagnosed(diagnoser: Diagnoser, node: str, slowdown: float) -> Finding:
    at = T0 + 600.0
    res = diagnoser.diagnose(node, 2, at=at)
    return Finding(kind=FindingKind.STRAGGLER, node=node, ts=at, job="train-1", gpu=2, rank=2, step=300,
                   diagnosis=res.diagnosis, z=9.0, slowdown=slowdown, detector="straggler",
                   evidence={**res.evidence, "rack": RACK})


@pytest.fixture
def diagnoser() -> Diagnoser:
    d = Diagnoser(thresholds=DiagnosisThresholds(power_cap_window_s=600.0, power_capped_share=0.5))
    samples = [*_chain("gpu-a", lambda k: True),                 # capped throughout
               *_chain("gpu-b", lambda k: k % 3 != 0),           # capped two samples in three
               *_chain("gpu-c", lambda k: 30 <= k < 33),         # one 30 s dip
               *_chain("gpu-d", lambda k: False)]                # a rack peer, never capped
    d.observe(sorted(samples, key=lambda s: s.ts))
    return d


def test_the_window_of_power_cap_clock_events_is_evidence(diagnoser) -> None:
    a, b, c = (_diagnosed(diagnoser, n, 0.2) for n in ("gpu-a", "gpu-b", "gpu-c"))
    assert a.diagnosis is Diagnosis.UNKNOWN and a.evidence["power_capped"] is True
    assert a.evidence["power_cap_share"] == pytest.approx(1.0) and a.evidence["cause"] == "power cap"
    assert b.evidence["power_capped"] is True and b.evidence["power_cap_share"] == pytest.approx(2 / 3, abs=0.02)
    assert c.evidence["power_capped"] is False and c.evidence["power_cap_share"] == pytest.approx(0.05, abs=0.01)
    assert "cause" not in c.evidence
    # another GPU of the node capped is not the straggler's own cap
    assert diagnoser.diagnose("gpu-a", 1, at=T0 + 600.0).evidence["power_capped"] is False


def test_the_policy_evicts_a_power_capped_straggler_only_when_persistent_and_material(diagnoser) -> None:
    eng = PolicyEngine(power_fault_share=0.9, power_fault_min_slowdown=0.1)
    (persistent,) = eng.decide([_diagnosed(diagnoser, "gpu-a", 0.2)], now=T0 + 600.0)
    assert persistent.action is Action.EVICT and persistent.guard is Guard.ALLOWED
    assert persistent.evidence["power_fault"] is True and persistent.reason.startswith("node power fault")
    eng = PolicyEngine(power_fault_share=0.9, power_fault_min_slowdown=0.1)
    (slight,) = eng.decide([_diagnosed(diagnoser, "gpu-a", 0.05)], now=T0 + 600.0)     # not material
    (intermittent,) = eng.decide([_diagnosed(diagnoser, "gpu-b", 0.3)], now=T0 + 600.0)  # not persistent
    for rec in (slight, intermittent):
        assert rec.action is Action.NONE and rec.evidence["power_fault"] is True and "power fault" in rec.reason
    # a straggler whose cap was a brief dip is judged as any other UNKNOWN straggler
    (other,) = eng.decide([_diagnosed(diagnoser, "gpu-c", 0.3)], now=T0 + 600.0)
    assert other.action is Action.EVICT and "power_fault" not in other.evidence
    with pytest.raises(ConfigError, match="power_fault_share"):
        PolicyEngine(power_fault_share=0.0)
    with pytest.raises(ConfigError, match="power_capped_share"):
        dataclasses.replace(DiagnosisThresholds(), power_capped_share=1.5)


def test_a_new_gpu_set_starts_the_power_cap_window_again() -> None:
    """GPU 2 capped for 400 s, then it falls off the bus and the node reports GPUs 0, 1 and 3: the
    window starts again with the new set, so what the lost GPU's cap said no longer counts."""
    d = Diagnoser(thresholds=DiagnosisThresholds(power_cap_window_s=600.0, power_capped_share=0.5))
    gpus = np.array([0, 1, 3])
    after = [Telemetry.from_columns("gpu-e", RACK, T0 + 10.0 * k, gpus, temp_c=np.full(3, 60.0),
                                    clock_reasons=np.zeros(3), power_w=np.full(3, 600.0),
                                    power_limit_w=np.full(3, 700.0), util_pct=np.full(3, 97.0),
                                    nvlink_links_up=np.full(3, 18.0), nvlink_links_max=np.full(3, 18.0), nic_util=0.3)
             for k in range(40, 61)]
    d.observe([_sample("gpu-e", T0 + 10.0 * k, 2) for k in range(40)])
    assert d.states.power_cap_share("gpu-e", None, T0 + 395.0) == pytest.approx(1.0)
    d.observe(after)
    assert d.states.power_cap_share("gpu-e", None, T0 + 600.0) == 0.0
    assert d.states.power_cap_share("gpu-e", 2, T0 + 600.0) == 0.0  # a GPU the node no longer has
    assert d.states.power_cap_gpu_["gpu-e"].tolist() == [0, 1, 3]
