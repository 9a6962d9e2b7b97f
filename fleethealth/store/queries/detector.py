"""The detector tier's named queries (:class:`~fleethealth.store.protocol.DetectorStore`): the core
tables' typed writers, the outbox, detector snapshots."""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from fleethealth.errors import StoreError
from fleethealth.schema import Event, Finding, Recommendation, StepBatch, Telemetry
from fleethealth.store.columns import (
    event_columns,
    finding_columns,
    recommendation_columns,
    sample_columns,
    step_columns,
    telemetry_columns,
)
from fleethealth.store.queries.sql import QueriesBase

__all__ = ["DetectorQueries"]


class DetectorQueries(QueriesBase):
    """What the detector tier writes and keeps."""

    # ================================================================ core tables: typed writers
    # columnar: one insert per call, NumPy columns concatenated over messages
    def insert_telemetry(self, samples: Sequence[Telemetry], *, dedup_token: str | None = None) -> int:
        if not samples:
            return 0
        return self.insert_gpu_samples(telemetry_columns(samples), dedup_token=dedup_token)

    def insert_gpu_samples(self, columns: dict[str, Any], *, dedup_token: str | None = None) -> int:
        """Insert ``gpu_samples`` given as columns named as the fields (``node``, ``rack``, ``gpu``, ``ts``,
        ``model``, ``uuid``, ``nic_util`` and :data:`~fleethealth.schema.GPU_FIELDS`, in their units):
        quantised to the sensors' resolution on the way (:func:`~fleethealth.store.columns.sample_columns`)."""
        return self.insert("gpu_samples", sample_columns(columns), dedup_token=dedup_token)

    def insert_steps(self, batches: Sequence[StepBatch], *, dedup_token: str | None = None) -> int:
        if not batches:
            return 0
        return self.insert("rank_steps", step_columns(batches), dedup_token=dedup_token)

    def insert_events(self, events: Sequence[Event], *, dedup_token: str | None = None) -> int:
        return self.insert("events", event_columns(events), dedup_token=dedup_token)

    def insert_findings(self, findings: Sequence[Finding], *, dedup_token: str | None = None) -> int:
        return self.insert("findings", finding_columns(findings), dedup_token=dedup_token)

    def insert_recommendations(self, recs: Sequence[Recommendation], *, dedup_token: str | None = None) -> int:
        return self.insert("recommendations", recommendation_columns(recs), dedup_token=dedup_token)

    # ================================================================ the outbox (to publish, then published)
    def write_outbox(self, rows: Sequence[tuple[str, str, str, float, str]], *, published: bool,
                     dedup_token: str | None = None) -> int:
        """Write outbox rows ``(topic, id, key, ts_s, payload)``: pending (``published`` False, version 0)
        or acknowledged by the broker (True, version 1, which wins under ``FINAL``)."""
        if not rows:
            return 0
        topic, ids, keys, ts, payload = (list(c) for c in zip(*rows, strict=True))
        flag = int(bool(published))
        return self.insert("outbox", {"id": ids, "topic": topic, "key": keys, "ts_s": ts, "payload": payload,
                                      "published": [flag] * len(ids), "version": [flag] * len(ids)},
                           dedup_token=dedup_token)

    def pending_outbox(self, *, limit: int = 10_000) -> list[tuple[str, str, str, float, str]]:
        """Outbox rows not yet acknowledged, ``(topic, id, key, ts_s, payload)``, oldest decision first."""
        res = self.query("SELECT topic, id, key, ts_s, payload FROM outbox FINAL WHERE published = 0 "
                         "ORDER BY ts_s, topic, id LIMIT {limit:UInt32}", {"limit": int(limit)})
        return [(str(t), str(i), str(k), float(ts), str(p)) for t, i, k, ts, p in res.rows]


    # ================================================================ detector snapshots (one per group and partition)
    def save_snapshot(self, group: str, partition: int, seq: int, ts: float,
                      offsets: Mapping[tuple[str, int], int], blob: bytes) -> None:
        """Store the snapshot ``blob`` of consumer group ``group``'s input ``partition``, version ``seq``
        (the greatest is kept), reflecting event time ``ts`` and the input ``offsets``
        (``{(topic, partition): next offset}``). The bytes are stored as given.

        ``seq`` must grow with the state's progress whoever writes it (e.g. the next offset of the
        partition's main input): a replica that lost the partition in a rebalance and still writes
        then cannot replace the new owner's newer snapshot with its older one."""
        for name, value in (("partition", partition), ("seq", seq)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise StoreError(f"save_snapshot: {name} must be an int >= 0, got {value!r}")
        if not isinstance(blob, bytes | bytearray):
            raise StoreError(f"save_snapshot: blob must be bytes, got {type(blob).__name__}")
        pairs = sorted([str(topic), int(part), int(offset)] for (topic, part), offset in offsets.items())
        self.insert("detector_snapshots", {
            "consumer_group": [group], "partition": [partition], "seq": [seq], "ts": [float(ts)],
            "offsets": [orjson.dumps(pairs).decode()], "blob": [bytes(blob)],
        })

    def load_snapshot(self, group: str, partition: int) -> tuple[int, dict[tuple[str, int], int], bytes] | None:
        """The newest snapshot of ``group``'s input ``partition``: ``(seq, offsets, blob)``, or ``None``."""
        res = self.query("SELECT seq, offsets, base64Encode(blob) AS blob FROM detector_snapshots FINAL "
                         "WHERE consumer_group = {g:String} AND partition = {p:UInt32} ORDER BY seq DESC LIMIT 1",
                         {"g": group, "p": int(partition)})
        if not res.rows:
            return None
        seq, offsets, blob = res.rows[0]
        return (int(seq), {(str(t), int(p)): int(o) for t, p, o in orjson.loads(offsets)},
                base64.b64decode(blob, validate=True))
