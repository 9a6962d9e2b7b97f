"""Fields a GPU does not report are NaN end to end: probe -> wire -> store -> features -> rules.

The simulated H100 retires no pages (as NVML answers NOT_SUPPORTED on Hopper); its ECC
precursor shows as remapped rows. The samples go through the simulator source, the wire codec
and the store, and what comes back out of the store drives the ECC health rule and the default
failure predictor (the ECC rule): both must find the failing GPU from its row remaps, before it
falls off the bus, with the retired-page features NaN throughout.
"""

from __future__ import annotations

import numpy as np

from fleethealth.detectors.health import HealthRules
from fleethealth.detectors.predict import FEATURES, FailurePredictor, GpuFeatures
from fleethealth.probe.simsource import SimSource
from fleethealth.schema import EventKind, FindingKind, Telemetry, decode, encode
from fleethealth.sim import FleetSim, Scenario

_SCENARIO = {"seed": 5, "fleet": {"racks": 1, "nodes_per_rack": 2, "gpus_per_node": 4},
             "job": {"id": "hopper-1", "steps": 90, "step_time_s": 60.0, "jitter": 0.02},
             "faults": [{"kind": "ecc_precursor", "node": "n0001", "gpu": 2, "start_step": 5, "fail_step": 80}]}


def test_retired_pages_are_nan_from_the_probe_through_the_store_and_the_rules_use_remaps(store) -> None:
    sim = FleetSim(Scenario.from_obj(_SCENARIO))
    moments = sum(1 for _ in sim.run())
    source = SimSource("n0001", sim=sim)
    source.open()
    samples = [source.sample(0.0) for _ in range(moments)]
    wire = [decode(Telemetry, encode(s.telemetry)) for s in samples]
    events = [e for s in samples for e in s.events]
    store.insert_telemetry(wire)
    back = store.telemetry(node="n0001")
    assert len(back) == len(wire) and back[0].model == "NVIDIA H100 80GB HBM3"
    for t in back:
        assert np.isnan(t.columns["retired_sbe"]).all() and np.isnan(t.columns["retired_pending"]).all()
    assert max(t.columns["remap_correctable"][2] for t in back) > 0

    fail_ts = min(e.ts for e in events if e.kind is EventKind.XID and e.code == 79)
    rows = GpuFeatures().check(back, events)
    retired = FEATURES.index("retired_pages_delta")
    assert all(np.isnan(r.X[:, retired]).all() for r in rows)
    [risk] = FailurePredictor().check(back, events)
    assert risk.kind is FindingKind.FAILURE_RISK and (risk.node, risk.gpu) == ("n0001", 2) and risk.ts < fail_ts
    assert "row_remap_delta" in risk.evidence["rule"] and risk.evidence["features"]["retired_pages_delta"] is None
    ecc = [f for f in HealthRules().check(back, events) if f.kind is FindingKind.ECC]
    assert ecc and ecc[0].gpu == 2 and ecc[0].ts < fail_ts and "remap_growth" in ecc[0].evidence["reasons"]
    assert ecc[0].evidence["retired_pages"] is None
