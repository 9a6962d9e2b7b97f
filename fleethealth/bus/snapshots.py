"""Detector snapshots on the compacted topic ``fh.snapshots``."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from typing import Any

from fleethealth.bus.dsn import _backend
from fleethealth.bus.kafka_client import _KafkaBackend, translated
from fleethealth.errors import BusError
from fleethealth.schema import Topic

SNAPSHOT_MAX_BYTES = 64 * 1024 * 1024
"""Largest snapshot record on ``fh.snapshots`` (a 16,384-rank job's pipeline is about 3 MB)."""


class SnapshotTopic:
    """Detector snapshots on the compacted topic ``fh.snapshots``, key ``GROUP/PARTITION``, the ``seq``
    in a record header: the same two calls as the store's ``save_snapshot`` / ``load_snapshot``, for
    replicas that do not share a store (each with an embedded one) or to keep snapshots beside the
    offsets they name. :meth:`load` reads the topic to its end and takes the greatest ``seq`` of the
    key among what compaction left (compaction keeps the last written, which a replica that lost the
    partition may have written late: an older snapshot, still consistent with its own offsets)."""

    def __init__(self, dsn: str, *, client_id: str = "fleethealth-snapshots") -> None:
        self.dsn = dsn
        self._client_id = client_id
        self._producer: Any = None

    def save_snapshot(self, group: str, partition: int, seq: int, ts: float,
                      offsets: Mapping[tuple[str, int], int], blob: bytes) -> None:
        if len(blob) > SNAPSHOT_MAX_BYTES:
            raise BusError(f"a snapshot of {len(blob)} bytes is larger than fh.snapshots takes ({SNAPSHOT_MAX_BYTES})")
        try:
            with translated("publishing a snapshot", self.dsn):
                if self._producer is None:
                    self._producer = _backend(self.dsn).producer(self._client_id, None, 10_000,  # type: ignore[arg-type]
                                                                 max_request_size=SNAPSHOT_MAX_BYTES + 65_536)
                self._producer.send(Topic.SNAPSHOTS.value, key=f"{group}/{partition}".encode(), value=bytes(blob),
                                    headers=[("seq", str(int(seq)).encode())]).get(timeout=30)
        except BusError:
            # the next save connects anew, from every broker of the DSN (see Producer._fail_over)
            failed, self._producer = self._producer, None
            if failed is not None:
                with contextlib.suppress(Exception):
                    failed.close(timeout=0)
            raise

    def load_snapshot(self, group: str, partition: int) -> tuple[int, dict[tuple[str, int], int], bytes] | None:
        key = f"{group}/{partition}".encode()
        kafka = _KafkaBackend._kafka()
        best: tuple[int, bytes] | None = None
        backend = _backend(self.dsn)
        with translated("reading fh.snapshots", self.dsn):
            kc = kafka.KafkaConsumer(bootstrap_servers=backend.hosts, group_id=None, client_id=self._client_id,
                                     enable_auto_commit=False, auto_offset_reset="earliest",
                                     max_partition_fetch_bytes=SNAPSHOT_MAX_BYTES + 65_536,
                                     fetch_max_bytes=SNAPSHOT_MAX_BYTES + 65_536, **backend.options)
            try:
                parts = [kafka.TopicPartition(Topic.SNAPSHOTS.value, p)
                         for p in sorted(kc.partitions_for_topic(Topic.SNAPSHOTS.value) or ())]
                kc.assign(parts)
                ends = kc.end_offsets(parts)
                deadline = time.monotonic() + 30.0
                while any(kc.position(tp) < end for tp, end in ends.items()) and time.monotonic() < deadline:
                    for records in kc.poll(timeout_ms=500).values():
                        for rec in records:
                            if rec.key != key or rec.value is None:
                                continue
                            seq = int(dict(rec.headers or ()).get("seq", b"0") or 0)
                            if best is None or seq >= best[0]:
                                best = (seq, rec.value)
            finally:
                kc.close(autocommit=False)
        return None if best is None else (best[0], {}, best[1])

    def close(self) -> None:
        if self._producer is not None:
            self._producer.close(timeout=5)
            self._producer = None
