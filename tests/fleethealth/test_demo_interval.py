"""The checkpoint interval end to end: ``fleethealth demo`` on ``fleethealth/scenarios/flaky_rack.yaml``
(a job of 4 nodes, one stop early on, then rack r01 hanging three times in 60 steps), the detectors
deriving each interruption with its MTTR phases, the simulator's in-job records reporting each
checkpoint and its cost — then ``GET /v1/runs/train-f/health`` on the demo's chDB store.

The test recomputes the route's inputs from the stored events with its own SQL and arithmetic, and
checks that the recommended interval after the flaky rack is shorter than before it.
"""

from __future__ import annotations

import math
import subprocess
import sys
from importlib import resources
from pathlib import Path

import numpy as np
import orjson
import pytest

DAY = 86400.0


@pytest.mark.slow
def test_the_flaky_rack_shortens_the_interval_the_health_route_recommends(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from fleethealth.api import create_app
    from fleethealth.policy.interval import advise
    from fleethealth.store import open_store

    scenario = resources.files("fleethealth.scenarios") / "flaky_rack.yaml"
    run = subprocess.run([sys.executable, "-m", "fleethealth", "demo", "--json", "--no-report",
                          "--scenario", str(scenario), "--out", str(tmp_path / "out"),
                          "--data", str(tmp_path / "data")],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    with open_store(f"chdb://{tmp_path / 'data' / 'store'}") as store:
        with TestClient(create_app(store, token=None, open_reads=True)) as client:
            cp = client.get("/v1/runs/train-f/health").json()["checkpoint"]

        # the inputs, from the stored events
        stops = {}
        for ts, data in store.query("SELECT ts_s, data FROM events FINAL WHERE job = 'train-f' AND "
                                    "kind = 'interruption' ORDER BY ts_s").rows:
            d = orjson.loads(data)
            stops.setdefault(d["interruption_id"], (ts, d))
        assert len(stops) == 4 and all(d["cause"] == "hang" and d["restarted"] for _, d in stops.values())
        r_s = sum(d["detection_s"] + d["isolation_s"] + d["reconfiguration_s"] + d["reload_s"]
                  for _, d in stops.values()) / 4
        costs = [orjson.loads(d) for (d,) in store.query(
            "SELECT data FROM events FINAL WHERE job = 'train-f' AND kind = 'checkpoint_cost' ORDER BY ts_s").rows]
        assert len(costs) >= 10
        c_s = sum(c["blocking_s"] for c in costs[-20:]) / len(costs[-20:])
        write_s = max(c["write_s"] for c in costs[-20:])
        nodes, lo, hi = store.query("SELECT uniqExact(node), min(toUnixTimestamp64Milli(ts)) / 1000, "
                                    "max(toUnixTimestamp64Milli(ts)) / 1000 FROM rank_steps "
                                    "WHERE job = 'train-f'").rows[0]
        prior_mtbf = DAY / (6.5e-3 * nodes)          # no other job: the configured rate per node-day
        mtbf = (DAY + (hi - lo)) / (DAY / prior_mtbf + 4)
        ckpt_ts = [ts for (ts,) in store.query("SELECT ts_s FROM events FINAL WHERE job = 'train-f' AND "
                                               "kind = 'checkpoint' ORDER BY ts_s").rows]

        assert (nodes, cp["basis"]["mtbf"]["job_interruptions"]) == (4, 4)
        assert cp["r_s"] == pytest.approx(r_s) and cp["c_s"] == pytest.approx(c_s)
        assert cp["mtbf_s"] == pytest.approx(mtbf)
        assert cp["interval_s_recommended"] == pytest.approx(max(math.sqrt(2 * c_s * mtbf), 60.0, write_s))
        gaps = np.diff(np.unique(ckpt_ts)[-21:])
        assert cp["interval_s_now"] == pytest.approx(float(np.median(gaps[gaps > 0])))
        assert 38.0 < cp["interval_s_now"] < 44.0          # every 20 steps of about 2 s
        assert cp["restart_term"] == pytest.approx(r_s / mtbf)

        # before the rack turned flaky (just before its first stop) the interval was longer
        first_rack_stop = sorted(ts for ts, _ in stops.values())[1]
        before = advise(store, "train-f", at=first_rack_stop - 1.0)
        assert before is not None and before.basis["mtbf"]["job_interruptions"] == 1
        assert cp["interval_s_recommended"] < 0.75 * before.interval_s_recommended
