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


def test_changes_judged_for_a_wave_at_once_are_those_judged_one_by_one() -> None:
    """``changed_many`` (a wave's states judged in NumPy passes) says what ``changed`` says of each pair:
    moves just under and at each step, bands crossed, bits, links, ports, NaN appearing, a rack change, pairs
    of other GPU or port counts (alone, or as a group of their own) and arrays of another length (alone)."""
    from fleethealth.detectors.nodestate import changed, changed_many
    from fleethealth.schema import NodeState

    rng = np.random.default_rng(28)
    rule = StateRule()

    def state(k: int, n: int = 8, p: int = 1, **over: object) -> NodeState:
        ports = {} if p == 0 else {"has_nic": True, "nic_port": tuple(f"mlx5_{i}/1" for i in range(p)),
                                   "nic_port_util": np.full(p, 0.5), "nic_port_wait": np.full(p, 0.02),
                                   "nic_port_down": np.zeros(p, dtype=bool)}
        base = {"node": f"n{k}", "rack": "r1", "ts": 100.0, "gpu": np.arange(n, dtype=np.int16),
                "temp_c": np.full(n, 60.0), "slowdown_temp_c": np.full(n, 87.0), "clock_reasons": np.zeros(n),
                "nvlink_links_up": np.full(n, 18.0), "nvlink_links_max": np.full(n, 18.0),
                "reports": np.ones(n, dtype=bool), "nvlink_errors_per_min": 5.0, "nic_util": 0.3,
                "power_w": np.full(n, 500.0), "load_power_w": np.full(n, 500.0), "residual_c": np.zeros(n), **ports}
        base.update(over)
        return NodeState(**base)  # type: ignore[arg-type]

    def bump(name: str, by: float, n: int = 8) -> np.ndarray:
        arr = np.asarray(getattr(state(0, n), name), dtype=np.float64).copy()
        arr[rng.integers(arr.size)] += by
        return arr

    olds, news = [], []
    for k in range(400):
        old = state(k)
        kind = k % 20
        over: dict[str, object] = {}
        if kind == 1:
            over["temp_c"] = bump("temp_c", rule.temp_step_c * rng.choice([0.99, 1.0, -1.0]))
        elif kind == 2:
            over["power_w"] = bump("power_w", rule.power_step_w * rng.choice([0.99, 1.0]))
        elif kind == 3:
            over["residual_c"] = bump("residual_c", np.nan)
        elif kind == 4:
            over["clock_reasons"] = bump("clock_reasons", float(rng.choice([int(ClockReason.SW_THERMAL), 1.0])))
        elif kind == 5:
            over["nvlink_errors_per_min"] = float(rng.choice([np.nan, 5.9, 6.0, 10.5]))
        elif kind == 6:
            over["nic_port_util"] = np.array([float(rng.choice([0.54, 0.55, 0.9]))])
        elif kind == 7:
            over["nic_port_wait"] = np.array([float(rng.choice([0.06, 0.2, np.nan]))])
        elif kind == 8:
            over["nic_port_down"] = np.array([True])
        elif kind == 9:
            over["nic_util"] = float(rng.choice([np.nan, 0.34, 0.36, 0.9]))
        elif kind == 10:
            over["rack"] = "r2"
        elif kind == 11:
            over["nvlink_links_up"] = bump("nvlink_links_up", -1.0)
        elif kind == 12:
            over["reports"] = np.array([True] * 7 + [False])
        elif kind == 13:
            over["load_power_w"] = bump("load_power_w", np.inf)
        elif kind == 14:
            over["slowdown_temp_c"] = bump("slowdown_temp_c", np.nan)
        new = state(k, **over)
        if kind == 15:
            new = state(k, n=4)
        elif kind == 16:
            new = state(k, p=2)
        elif kind == 17:
            new = state(k, temp_c=np.full(3, 60.0))  # an array of another length
        elif kind == 18:
            old = None  # type: ignore[assignment]
        elif kind == 19:  # a pair of another GPU and port count, judged in NumPy passes of its own
            old = state(k, n=4, p=2)
            new = state(k, n=4, p=2, temp_c=np.full(4, 60.0 + float(rng.choice([0.5, 1.0]))))
        olds.append(old)
        news.append(new)
    want = [changed(o, s, rule) for o, s in zip(olds, news, strict=True)]
    got = changed_many(olds, news, rule).tolist()
    wrong = [k for k, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
    assert not wrong, f"changed_many differs from changed on pairs {wrong[:5]}"
    assert 0 < sum(want) < len(want)
    assert any(want[k] for k in range(19, 400, 20)) and not all(want[k] for k in range(19, 400, 20))
    # a wave with no odd pair goes through the NumPy passes alone, and still agrees
    even = [k for k in range(len(news)) if k % 20 not in (15, 16, 17, 18)]
    assert changed_many([olds[k] for k in even], [news[k] for k in even], rule).tolist() == [want[k] for k in even]
