"""Node-stage throughput: Kafka -> telemetry decode -> health rules, predictor, node states -> chDB.

GPU samples per CPU second through the production node stage, against a per-GPU-row baseline
measured in the same run, each at ``--gpus`` (default 1,024 and 16,384):

* **node stage** — :class:`fleethealth.detectors.runner.Runner` with ``stage="node"`` (the core
  :func:`~fleethealth.detectors.cores.make_core` builds for it): telemetry messages of 8 GPUs and one
  NIC port each (what a probe sends), polled from an embedded Tansu broker, decoded, run through the
  node-side pipeline (node states, the health rules, the failure predictor), the node states that
  changed published on ``fh.nodestate``, the samples written to ``gpu_samples`` in chDB with
  deduplication tokens, offsets committed after the write. ``--samples`` samples per node at 1 Hz
  of event time are timed, after one untimed warm-up round (model loading, first states, the store
  client's first insert). The timed rounds
  lie within the runner's lateness of each other, so they are released together: one batch of
  ``nodes x samples`` messages through the core.
* **baseline** — one message per GPU, processed row by row by a plain kafka-python consumer: each
  value decoded with ``json.loads`` and checked field by field in Python (physical range, the
  thresholds the health rules read: uncorrected ECC growth, retirement or remap pending, power
  brake, temperature against the slowdown limit, NVLink error growth), inserted into ``gpu_samples``
  ``--baseline-batch`` rows at a time; offsets committed after each poll.

Rates are GPU samples per CPU second of this process (``time.process_time()``: the main thread,
kafka-python's threads and chDB's threads; the broker runs in a separate process and is not
counted). Publishing happens before the timed part and is not counted. Each size runs ``--repeat``
times on a fresh broker and store; the best run of each pipeline counts (other load on the machine
only ever slows a run down). ``conditions`` gives the load average before and after and the CPUs.

``floor`` prices, at the largest size, the parts of a GPU sample's cost outside the stage's own code:
chDB's insert of a poll's ``gpu_samples`` block (with the table's materialized views and without them),
kafka-python's fetch of a telemetry record and send of a node state, orjson's parse of a telemetry value;
their sum per GPU sample bounds the rate the stage can reach with this store schema and client.

Targets (issue 28 §2): >= 200,000 GPU samples per CPU second per replica (<= 5 us each) and >= 20x
the baseline. ``--quick`` is a smoke test (128 GPUs, 2 samples, one repeat); ``--profile FILE``
writes a cProfile of the largest size's first timed node-stage run.

    python bench/node_throughput.py [--gpus 1024 16384] [--samples 4] [--repeat 2] [--quick]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import orjson
from prometheus_client import CollectorRegistry

from fleethealth.broker import EmbeddedBroker
from fleethealth.bus import Producer, ensure_topics, parse_dsn
from fleethealth.detectors.runner import Runner, tune_gc
from fleethealth.schema import GPU_FIELD_RANGES, GPU_FIELDS, NicPorts, NodeState, Telemetry
from fleethealth.store import Store, open_store, synthetic

TARGET_PER_CORE = 200_000
TARGET_RATIO = 20.0
GPUS_PER_NODE = 8
NODES_PER_RACK = 16
T0 = 1_767_225_600.0


@dataclass(frozen=True)
class Rate:
    """GPU samples processed and the CPU and wall seconds it took."""

    samples: int
    messages: int
    cpu_s: float
    wall_s: float

    @property
    def per_core(self) -> float:
        return self.samples / max(self.cpu_s, 1e-9)

    def to_obj(self) -> dict[str, float]:
        return {**asdict(self), "samples_per_cpu_s": round(self.per_core),
                "samples_per_wall_s": round(self.samples / max(self.wall_s, 1e-9)),
                "us_per_sample": round(1e6 * self.cpu_s / max(self.samples, 1), 2)}


class Fleet:
    """Healthy telemetry of ``nodes`` nodes of 8 GPUs at 1 Hz: every GPU field populated, counters
    that rise now and then, one InfiniBand port a node. Deterministic for its seed."""

    def __init__(self, nodes: int, seed: int = 2026) -> None:
        rng = np.random.default_rng(seed)
        self.nodes = nodes
        shape = (nodes, GPUS_PER_NODE)
        self.rng = rng
        self.names = [f"node-{i:05d}" for i in range(nodes)]
        self.racks = [f"rack-{i // NODES_PER_RACK:03d}" for i in range(nodes)]
        self.base_temp = 66.0 + rng.normal(0.0, 2.0, shape)
        self.base_power = 560.0 + rng.normal(0.0, 15.0, shape)
        self.counters = {name: rng.integers(0, 20, shape).astype(np.float64)
                         for name in ("ecc_sbe_volatile", "ecc_sbe_aggregate", "nvlink_replay", "pcie_replay")}
        self.energy = rng.uniform(1e9, 2e9, shape)
        self.nic = {"tx_bytes": rng.uniform(1e12, 2e12, nodes), "rx_bytes": rng.uniform(1e12, 2e12, nodes),
                    "xmit_wait": rng.uniform(1e6, 2e6, nodes)}
        self.uuid = [tuple(f"GPU-{i:08x}-{g:04x}" for g in range(GPUS_PER_NODE)) for i in range(nodes)]

    def columns(self) -> dict[str, np.ndarray]:
        """The next second's GPU columns, each of shape ``(nodes, 8)``."""
        rng, shape = self.rng, (self.nodes, GPUS_PER_NODE)
        for counter in self.counters.values():
            counter += rng.random(shape) < 0.01
        power = self.base_power + rng.normal(0.0, 5.0, shape)
        self.energy += power * 1000.0
        full = lambda v: np.full(shape, float(v))  # noqa: E731
        return {
            "temp_c": np.round(self.base_temp + rng.normal(0.0, 0.5, shape)),
            "mem_temp_c": np.round(self.base_temp + 6),
            "power_w": np.round(power, 3), "power_limit_w": full(700), "sm_clock_mhz": full(1980),
            "sm_clock_max_mhz": full(1980), "mem_clock_mhz": full(2619), "clock_reasons": full(0),
            "util_pct": np.round(rng.uniform(90, 100, shape)), "ecc_dbe_volatile": full(0),
            "ecc_dbe_aggregate": full(0),
            "retired_sbe": full(1), "retired_dbe": full(0), "retired_pending": full(0), "remap_correctable": full(0),
            "remap_uncorrectable": full(0), "remap_pending": full(0), "remap_failure": full(0),
            "nvlink_links_up": full(18), "nvlink_links_max": full(18), "nvlink_crc_flit": full(0),
            "nvlink_crc_data": full(0), "nvlink_recovery": full(0), "pcie_gen": full(5), "pcie_gen_max": full(5),
            "pcie_width": full(16), "pcie_width_max": full(16), "fb_used_mib": full(65_000),
            "fb_free_mib": full(16_000), "energy_mj": np.round(self.energy), "tensor_active": np.round(
                rng.uniform(0.5, 0.7, shape), 3), "slowdown_temp_c": full(87),
            **{name: c.copy() for name, c in self.counters.items()},
        }

    def tick(self, ts: float) -> list[Telemetry]:
        """One sample per node at event time ``ts``."""
        cols = self.columns()
        for name in self.nic:
            self.nic[name] += self.rng.uniform(1e9, 2e9, self.nodes) if name != "xmit_wait" else 1000.0
        gpu = np.arange(GPUS_PER_NODE, dtype=np.int16)
        out = []
        for n, node in enumerate(self.names):
            nic = NicPorts.from_columns(("mlx5_0/1",), ("ib",), up=[1.0], link_gbps=[400.0],
                                        **{k: v[n:n + 1] for k, v in self.nic.items()},
                                        rx_errors=[0.0], symbol_errors=[0.0], link_downed=[0.0], link_recovery=[0.0])
            out.append(Telemetry(node=node, rack=self.racks[n], ts=ts, gpu=gpu,
                                 columns={k: v[n] for k, v in cols.items()}, nic_util=0.35, model="H100-SXM5",
                                 uuid=self.uuid[n], nic=nic))
        return out


def _publish(dsn: str, rounds: list[list[Telemetry]]) -> int:
    sent = 0
    with Producer(dsn, client_id="bench-node", event_time_stamps=True) as producer:
        for samples in rounds:
            for s in samples:
                producer.publish(s)
                sent += 1
        producer.flush(120.0)
    return sent


def _stored(store: Store, first_ts: float) -> int:
    return synthetic.gpu_samples_since(store, first_ts)


def _run_stage(dsn: str, store: Store, fleet: Fleet, samples: int, group: str,
               profile: cProfile.Profile | None) -> Rate:
    """The production node stage; one round warms it up untimed, then ``samples`` rounds at 1 Hz are timed."""
    with Runner(dsn, store, group=group, registry=CollectorRegistry(), stage="node", publish=True) as runner:
        runner.consumer.wait_assigned(60.0)
        warm = _publish(dsn, [fleet.tick(T0)])
        taken = 0
        while taken < warm:
            taken += runner.process_once(1.0)
        runner.drain()  # the warm-up round through the detectors and into the store (the client's lazy imports)
        first = T0 + 1.0
        messages = _publish(dsn, [fleet.tick(first + k) for k in range(samples)])
        cpu0, wall0 = time.process_time(), time.perf_counter()
        if profile is not None:
            profile.enable()
        taken = 0
        while taken < messages:
            taken += runner.process_once(1.0)
        runner.drain()
        if profile is not None:
            profile.disable()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        if runner.consumer.dead_lettered_total:
            raise RuntimeError(f"{runner.consumer.dead_lettered_total} bench messages were dead-lettered")
    gpus = messages * GPUS_PER_NODE
    stored = _stored(store, first)
    if stored < gpus:
        raise RuntimeError(f"the node stage stored {stored} of {gpus} GPU samples")
    return Rate(samples=gpus, messages=messages, cpu_s=cpu, wall_s=wall)


_ROW_TEXT = ("node", "rack", "model", "uuid")


def _baseline_check(row: dict, last: dict[tuple[str, int], dict]) -> int:
    """The per-GPU-row checks in plain Python: every field's physical range, then the health rules'
    thresholds against the GPU's previous row. Returns how many tripped."""
    tripped = 0
    for name, (low, high) in GPU_FIELD_RANGES.items():
        v = row.get(name)
        if v is None:
            continue
        if not isinstance(v, (int, float)) or not low <= v <= high:
            raise ValueError(f"{name} out of range: {v!r}")
    key = (row["node"], row["gpu"])
    prev = last.get(key)
    last[key] = row
    if row["retired_pending"] or row["remap_pending"] or row["remap_failure"]:
        tripped += 1
    if int(row["clock_reasons"]) & 0x80:
        tripped += 1
    if row["temp_c"] >= row["slowdown_temp_c"] - 3.0:
        tripped += 1
    if prev is not None:
        if row["ecc_dbe_volatile"] > prev["ecc_dbe_volatile"]:
            tripped += 1
        nv = sum(row[k] - prev[k] for k in ("nvlink_crc_flit", "nvlink_crc_data", "nvlink_replay", "nvlink_recovery"))
        if nv * 60.0 / max(row["ts"] - prev["ts"], 1e-9) > 10.0:
            tripped += 1
        if row["pcie_replay"] - prev["pcie_replay"] > 100:
            tripped += 1
    return tripped


def _insert_rows(store: Store, rows: list[dict]) -> None:
    cols: dict[str, list] = {name: [r[name] for r in rows] for name in ("node", "rack", "gpu", "ts", "model",
                                                                         "uuid", "nic_util")}
    for name in GPU_FIELDS:
        cols[name] = [math.nan if r.get(name) is None else float(r[name]) for r in rows]
    store.insert_gpu_samples(cols)  # quantised to the sensors' resolution, as the stage writes them


def _run_baseline(dsn: str, store: Store, fleet: Fleet, samples: int, group: str, batch: int) -> Rate:
    """One message per GPU, decoded, checked and inserted row by row (the pipeline to beat)."""
    from kafka import KafkaConsumer, KafkaProducer

    topic = "bench.gpu_rows"
    ensure_topics(dsn, partitions=4, topics=[topic])
    consumer = KafkaConsumer(topic, bootstrap_servers=list(parse_dsn(dsn)[1]), group_id=group,
                             enable_auto_commit=False, auto_offset_reset="earliest", fetch_max_wait_ms=100,
                             session_timeout_ms=6000, heartbeat_interval_ms=2000)
    first = T0 + 100.0
    try:
        producer = KafkaProducer(bootstrap_servers=list(parse_dsn(dsn)[1]), linger_ms=20)
        sent = 0
        for k in range(samples):
            for s in fleet.tick(first + k):
                for g in range(s.gpu.size):
                    row = {"node": s.node, "rack": s.rack, "gpu": int(s.gpu[g]), "ts": s.ts, "model": s.model,
                           "uuid": s.uuid[g], "nic_util": s.nic_util}
                    row.update({name: float(col[g]) for name, col in s.columns.items()})
                    producer.send(topic, json.dumps(row).encode(), key=s.node.encode())
                    sent += 1
        producer.flush(120.0)
        producer.close()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        taken = tripped = 0
        last: dict[tuple[str, int], dict] = {}
        rows: list[dict] = []
        deadline = time.monotonic() + 600.0
        while taken < sent:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the baseline took {taken} of {sent} rows in 600 s")
            for records in consumer.poll(timeout_ms=1000, max_records=2000).values():
                for rec in records:
                    row = json.loads(rec.value)
                    if not isinstance(row, dict) or any(not isinstance(row.get(k), str) for k in _ROW_TEXT):
                        continue
                    taken += 1
                    tripped += _baseline_check(row, last)
                    rows.append(row)
                    if len(rows) >= batch:
                        _insert_rows(store, rows)
                        rows = []
            if rows:
                _insert_rows(store, rows)
                rows = []
            consumer.commit()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    finally:
        consumer.close(autocommit=False)
    stored = _stored(store, first)
    if stored < sent:
        raise RuntimeError(f"the baseline stored {stored} of {sent} GPU samples")
    return Rate(samples=sent, messages=sent, cpu_s=cpu, wall_s=wall)


_MVS = ("gpu_samples_1m_mv", "gpu_latest_mv")
"""The materialized views on ``gpu_samples`` (007/009/013; the hourly and per-rack ones cascade from the minute one)."""


def _cpu(fn: Callable[[], object], repeat: int = 3) -> float:
    """The least CPU seconds of ``repeat`` calls of ``fn``."""
    best = math.inf
    for _ in range(repeat):
        cpu0 = time.process_time()
        fn()
        best = min(best, time.process_time() - cpu0)
    return best


def _floor(gpus: int) -> dict[str, object]:
    """What the stage costs per GPU sample in parts this code does not own: chDB's insert of a poll's
    ``gpu_samples`` block with and without the table's materialized views, kafka-python's fetch and parse of
    the poll's telemetry records, its send of one node state a message, orjson's parse of a telemetry value."""
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition

    from fleethealth.schema import decode_many, encode
    from fleethealth.schema.nodestate import encode_states
    from fleethealth.store.columns import sample_columns, telemetry_columns

    fleet = Fleet(gpus // GPUS_PER_NODE, seed=7)
    polls = [fleet.tick(T0 + k) for k in range(8)]
    raws = [encode(s) for s in polls[1]]
    rows = gpus
    out: dict[str, object] = {"gpus": gpus, "messages": len(raws)}
    with tempfile.TemporaryDirectory(prefix="fh-bench-floor-") as tmp, EmbeddedBroker() as broker, \
            open_store(f"chdb://{tmp}/store") as store:
        store.migrate()
        blocks = iter([sample_columns(telemetry_columns(p)) for p in polls])
        store.insert("gpu_samples", next(blocks), dedup_token="warm")
        token = iter(range(100))
        with_mv = _cpu(lambda: store.insert("gpu_samples", next(blocks), dedup_token=f"f{next(token)}"))
        for mv in _MVS:
            store.command(f"DROP VIEW IF EXISTS {mv}")
        without = _cpu(lambda: store.insert("gpu_samples", next(blocks), dedup_token=f"f{next(token)}"))
        out["chdb_insert_us_per_row"] = round(1e6 * with_mv / rows, 2)
        out["chdb_insert_us_per_row_without_materialized_views"] = round(1e6 * without / rows, 2)
        hosts = list(parse_dsn(broker.dsn)[1])
        topic = "bench.floor"
        ensure_topics(broker.dsn, partitions=4, topics=[topic])
        states = _states(raws)
        values = encode_states(states)
        producer = KafkaProducer(bootstrap_servers=hosts, linger_ms=20)
        for value, state in zip(values, states, strict=True):  # warm-up: metadata, connections
            producer.send(topic, value, key=state.node.encode())
        producer.flush(120.0)

        def send() -> None:
            for value, state in zip(values, states, strict=True):
                producer.send(topic, value, key=state.node.encode())
            producer.flush(120.0)

        out["kafka_send_us_per_node_state"] = round(1e6 * _cpu(send) / len(values), 2)
        for raw, sample in zip(raws, polls[1], strict=True):
            producer.send(topic, raw, key=sample.node.encode())
        producer.flush(120.0)
        producer.close()
        consumer = KafkaConsumer(bootstrap_servers=hosts, group_id=None, enable_auto_commit=False,
                                 auto_offset_reset="earliest", fetch_max_wait_ms=100, max_partition_fetch_bytes=8 << 20)
        parts = sorted(consumer.partitions_for_topic(topic) or ())
        if not parts:
            raise RuntimeError(f"no partitions of {topic} in the broker's metadata")
        consumer.assign([TopicPartition(topic, p) for p in parts])
        total = len(values) * 4 + len(raws)  # the warm-up, 3 timed sends, then the telemetry
        cpu0, taken = time.process_time(), 0
        deadline = time.monotonic() + 300.0
        while taken < total and time.monotonic() < deadline:
            taken += sum(len(r) for r in consumer.poll(timeout_ms=500, max_records=5000).values())
        fetch = time.process_time() - cpu0
        consumer.close()
        if taken < total:
            raise RuntimeError(f"the floor's consumer fetched {taken} of {total} records in 300 s")
        out["kafka_fetch_us_per_record"] = round(1e6 * fetch / max(taken, 1), 2)
    loads = _cpu(lambda: [orjson.loads(r) for r in raws])
    out["orjson_loads_us_per_message"] = round(1e6 * loads / len(raws), 2)
    out["decode_many_us_per_message"] = round(1e6 * _cpu(lambda: decode_many(Telemetry, raws)) / len(raws), 2)
    per_sample = (out["chdb_insert_us_per_row"]
                  + (out["kafka_fetch_us_per_record"] + out["orjson_loads_us_per_message"]
                     + out["kafka_send_us_per_node_state"]) / GPUS_PER_NODE)
    out["floor_us_per_gpu_sample"] = round(per_sample, 2)
    out["floor_gpu_samples_per_cpu_s"] = round(1e6 / per_sample)
    out["how"] = (
        "least CPU seconds of 3 calls each: the insert of one poll's gpu_samples block (one row a GPU) into a fresh "
        f"store, then with the materialized views {', '.join(_MVS)} dropped; kafka-python's KafkaProducer.send of one "
        "pre-encoded node state a message (one a node: this fleet publishes a state for every sample) and flush; "
        "KafkaConsumer.poll of the records; orjson.loads of each telemetry value. floor: the insert per row plus the "
        "rest per message over 8 GPUs")
    return out


def _states(raws: list[bytes]) -> list[NodeState]:
    """One node state per telemetry value (what the stage publishes for each sample of this fleet)."""
    from fleethealth.detectors.nodestate import NodeStates
    from fleethealth.schema import decode_many

    table = NodeStates()
    samples = [s for s in decode_many(Telemetry, raws) if isinstance(s, Telemetry)]
    return table.observe(samples)


def _size(gpus: int, samples: int, baseline_samples: int, repeat: int, batch: int,
          profile: cProfile.Profile | None) -> dict[str, object]:
    stages, baselines = [], []
    for rep in range(repeat):
        fleet = Fleet(gpus // GPUS_PER_NODE, seed=2026 + rep)
        with tempfile.TemporaryDirectory(prefix="fh-bench-node-") as tmp, EmbeddedBroker() as broker, \
                open_store(f"chdb://{tmp}/store") as store:
            store.migrate()
            ensure_topics(broker.dsn, partitions=4)
            stages.append(_run_stage(broker.dsn, store, fleet, samples, f"bench-node-{rep}",
                                     profile if rep == 0 else None))
            baselines.append(_run_baseline(broker.dsn, store, fleet, baseline_samples, f"bench-rows-{rep}", batch))
    stage = min(stages, key=lambda r: r.cpu_s / r.samples)
    base = min(baselines, key=lambda r: r.cpu_s / r.samples)
    ratio = stage.per_core / base.per_core
    return {"gpus": gpus, "nodes": gpus // GPUS_PER_NODE, "samples_per_node": samples,
            "gpu_samples_per_cpu_s": round(stage.per_core), "baseline_gpu_samples_per_cpu_s": round(base.per_core),
            "ratio": round(ratio, 1), "us_per_gpu_sample": round(1e6 / stage.per_core, 2),
            "node_stage": stage.to_obj(), "baseline": base.to_obj(),
            "per_run_gpu_samples_per_cpu_s": [[round(s.per_core), round(b.per_core)]
                                              for s, b in zip(stages, baselines, strict=True)],
            "meets": {"gpu_samples_per_cpu_s": stage.per_core >= TARGET_PER_CORE, "ratio": ratio >= TARGET_RATIO}}


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[1024, 16384], help="fleet sizes (multiples of 8)")
    parser.add_argument("--samples", type=int, default=4, help="timed samples per node through the node stage")
    parser.add_argument("--baseline-samples", type=int, default=2, help="samples per GPU through the baseline")
    parser.add_argument("--baseline-batch", type=int, default=2000, help="rows per insert in the baseline")
    parser.add_argument("--repeat", type=int, default=2, help="runs of both pipelines per size; the best counts")
    parser.add_argument("--quick", action="store_true", help="smoke test: 128 GPUs, 2 samples, one run")
    parser.add_argument("--profile", type=Path, help="write a cProfile of the largest size's node stage here")
    args = parser.parse_args(argv)
    if args.quick:
        args.gpus, args.samples, args.repeat = [128], 2, 1
    if any(g < GPUS_PER_NODE or g % GPUS_PER_NODE for g in args.gpus):
        parser.error(f"--gpus must be positive multiples of {GPUS_PER_NODE}")
    if min(args.samples, args.baseline_samples, args.baseline_batch, args.repeat) < 1:
        parser.error("--samples, --baseline-samples, --baseline-batch and --repeat must be >= 1")
    tune_gc()  # what `fleethealth detect` does; both pipelines run under it
    load_before = os.getloadavg()
    profile = cProfile.Profile() if args.profile is not None else None
    sizes = [_size(g, args.samples, args.baseline_samples, args.repeat, args.baseline_batch,
                   profile if g == max(args.gpus) else None) for g in args.gpus]
    if profile is not None:
        profile.dump_stats(str(args.profile))
    result = {
        "sizes": sizes,
        "floor": _floor(max(args.gpus)),
        "gpus_per_message": GPUS_PER_NODE,
        "targets": {"gpu_samples_per_cpu_s": TARGET_PER_CORE, "ratio": TARGET_RATIO},
        "conditions": {"cpus": os.cpu_count(), "load_avg_before": [round(x, 2) for x in load_before],
                       "load_avg_after": [round(x, 2) for x in os.getloadavg()],
                       "cpu_time": "time.process_time() of this process (broker not counted)"},
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
