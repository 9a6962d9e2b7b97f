"""The Grafana dashboard's ClickHouse panels run as written on the real schema (chDB).

Grafana's ClickHouse plugin expands ``$__timeFilter(col)`` and ``$__timeInterval(col)``; the
test expands them the same way and runs every panel (and the ``job`` variable) on a store filled
by the simulator, so a renamed column breaks this test, not an operator's dashboard.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from fleethealth.sim import FleetSim, Scenario

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "fleethealth.json"


def _expand(sql: str, *, hours: float = 24.0 * 3650) -> str:
    """The panel's SQL as Grafana sends it for a range of ``hours`` ending now (the simulator's times
    are older: ``$__timeFilter`` lets every row through, the range length picks raw or rollup)."""
    sql = re.sub(r"\$__timeFilter\((\w+)\)", r"\1 >= toDateTime64(0, 3) AND \1 <= now64(3) + INTERVAL 3650 DAY", sql)
    sql = re.sub(r"\$__timeInterval\((\w+)\)", r"toStartOfInterval(\1, INTERVAL 1 MINUTE)", sql)
    sql = sql.replace("$__fromTime", f"(now() - INTERVAL {int(hours * 3600)} SECOND)").replace("$__toTime", "now()")
    return sql.replace("${job}", "train-1")


def test_every_clickhouse_panel_runs_on_the_schema(store) -> None:
    sim = FleetSim(Scenario.from_obj({"fleet": {"racks": 1, "nodes_per_rack": 2, "gpus_per_node": 2},
                                      "job": {"steps": 60},
                                      "faults": [{"kind": "sdc_transient", "node": "n0001", "gpu": 1,
                                                  "start_step": 10}]}))
    ticks = list(sim.run())
    store.insert_telemetry([t for s in ticks for t in s.telemetry])
    store.insert_steps([b for s in ticks for b in s.batches])
    store.insert_events([e for s in ticks for e in s.events])
    dash = json.loads(DASHBOARD.read_text())
    queries = [(p["title"], t["rawSql"]) for p in dash["panels"] for t in p["targets"] if "rawSql" in t]
    queries += [(v["name"], v["query"]) for v in dash["templating"]["list"] if v["type"] == "query"]
    assert len(queries) >= 8
    rows = {title: store.query(_expand(sql)).rows for title, sql in queries}
    assert rows["job"] == [("train-1",)]
    assert rows["SDC check failures"][0][1:4] == ("n0001", 1, 3)
    hottest = next(sql for title, sql in queries if title.startswith("Hottest GPUs"))
    long_range, short_range = rows[next(t for t, _ in queries if t.startswith("Hottest GPUs"))], \
        store.query(_expand(hottest, hours=1.0)).rows
    assert long_range and [r[:2] for r in long_range] == [r[:2] for r in short_range]  # rollup and raw: same cells
    ratio = rows["Step time: slowest rank over median (the straggler ratio, seed 000 §6)"]
    assert ratio and all(1.0 <= r[1] < 1.2 for r in ratio)


def test_panel_ids_are_unique_and_prometheus_panels_use_the_probes_default_names() -> None:
    """Every probe metric a Prometheus panel uses is served by a probe with default flags (the
    simulator source here), so the dashboard works beside dcgm-exporter without its names."""
    from fleethealth.probe.metrics import ProbeMetrics

    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"] if "expr" in t]
    assert not [e for e in exprs if "DCGM_FI_" in e]
    sim = FleetSim(Scenario.from_obj({"fleet": {"racks": 1, "nodes_per_rack": 1, "gpus_per_node": 2},
                                      "job": {"steps": 2}}))
    metrics = ProbeMetrics("n0000")
    metrics.observe(next(iter(sim.run())).telemetry[0])
    served = {f.name for f in metrics.families() if f.samples or f.name.endswith("xid_errors_total")}
    used = set()
    for expr in exprs:
        used |= set(re.findall(r"\bfleethealth_(?:gpu|nic|probe)_\w+", expr))
        for pattern in re.findall(r'__name__=~"([^"]+)"', expr):
            used |= {name for name in served if re.fullmatch(pattern, name)}
    assert {"fleethealth_gpu_temperature_celsius", "fleethealth_gpu_xid_errors_total",
            "fleethealth_nic_transmit_wait_ticks_total", "fleethealth_nic_receive_bytes_total"} <= used
    assert used <= served, sorted(used - served)
