"""Detector snapshots on the compacted topic ``fh.snapshots``."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any

from fleethealth.bus.dsn import _backend, parse_dsn
from fleethealth.bus.kafka_client import _KafkaBackend, translated
from fleethealth.errors import BusError
from fleethealth.schema import Topic

log = logging.getLogger(__name__)

SNAPSHOT_MAX_BYTES = 64 * 1024 * 1024
"""Largest snapshot record on ``fh.snapshots`` (a 16,384-rank job's pipeline is about 3 MB)."""


class SnapshotTopic:
    """Detector snapshots on the compacted topic ``fh.snapshots``, key ``GROUP/PARTITION``, the ``seq``
    in a record header: the same two calls as the store's ``save_snapshot`` / ``load_snapshot``, for
    replicas that do not share a store (each with an embedded one) or to keep snapshots beside the
    offsets they name. :meth:`load` reads the topic to its end and takes the greatest ``seq`` of the
    key among what compaction left (compaction keeps the last written, which a replica that lost the
    partition may have written late: an older snapshot, still consistent with its own offsets)."""

    def __init__(self, dsn: str, *, client_id: str = "fleethealth-snapshots", timeout_s: float = 30.0) -> None:
        self.dsn = dsn
        self._client_id = client_id
        self.timeout_s = timeout_s
        """How long one publish of a snapshot waits for the broker's acknowledgement."""
        self._producer: Any = None
        self.failovers_total = 0

    def save_snapshot(self, group: str, partition: int, seq: int, ts: float,
                      offsets: Mapping[tuple[str, int], int], blob: bytes) -> None:
        """Publish one snapshot. A publish that fails (a broker lost for good: kafka-python forgets its
        bootstrap list once it has metadata, so the client knows only the dead broker's address) fails over
        once, logged: a new client bootstrapped from every broker of the DSN publishes it again at once, so
        a replica stopping just after the loss still saves its last snapshot (see ``Producer.flush``)."""
        if len(blob) > SNAPSHOT_MAX_BYTES:
            raise BusError(f"a snapshot of {len(blob)} bytes is larger than fh.snapshots takes ({SNAPSHOT_MAX_BYTES})")
        try:
            self._publish(group, partition, seq, blob)
        except BusError as exc:
            self._drop()
            if len(parse_dsn(self.dsn)[1]) < 2:
                raise  # one broker: nothing to fail over to (the next save connects anew)
            self.failovers_total += 1
            log.warning("publishing the snapshot of %s/%d failed (%s): failed over to a client bootstrapped from "
                        "every broker of %s, publishing it again", group, partition, exc, self.dsn)
            try:
                self._publish(group, partition, seq, blob)
            except BusError:
                self._drop()  # the next save connects anew, from every broker of the DSN
                raise

    def _publish(self, group: str, partition: int, seq: int, blob: bytes) -> None:
        with translated("publishing a snapshot", self.dsn):
            if self._producer is None:
                self._producer = _backend(self.dsn).producer(self._client_id, None, 10_000,  # type: ignore[arg-type]
                                                             max_request_size=SNAPSHOT_MAX_BYTES + 65_536)
            self._producer.send(Topic.SNAPSHOTS.value, key=f"{group}/{partition}".encode(), value=bytes(blob),
                                headers=[("seq", str(int(seq)).encode())]).get(timeout=self.timeout_s)

    def _drop(self) -> None:
        failed, self._producer = self._producer, None
        if failed is not None:
            sender = getattr(failed, "_sender", None)
            if sender is not None:  # its close would wait for the dead broker
                sender.force_close()
                sender.join(1.0)
            with contextlib.suppress(Exception):
                failed.close(timeout=0)

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
