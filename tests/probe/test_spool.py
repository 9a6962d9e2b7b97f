"""The bounded on-disk spool: FIFO, survives reopening, drops the oldest beyond its bound and counts."""

from __future__ import annotations

import pytest

from fleethealth.errors import ConfigError
from fleethealth.probe.spool import Spool


def _values(spool: Spool, n: int = 100_000) -> list[bytes]:
    return [r.value for r in spool.peek(n)]


def test_fifo_with_keys_and_topics(tmp_path) -> None:
    with Spool(tmp_path, max_bytes=1 << 20) as spool:
        spool.append("fh.telemetry", b"t0", b"n1")
        spool.append("fh.steps", b"s0", None)
        spool.append("fh.events", b"e0", b"")
        recs = spool.peek(10)
        assert [(r.topic, r.value, r.key) for r in recs] == [("fh.telemetry", b"t0", b"n1"),
                                                              ("fh.steps", b"s0", None), ("fh.events", b"e0", b"")]
        spool.ack(2)
        assert _values(spool) == [b"e0"] and len(spool) == 1
        with pytest.raises(ConfigError):
            spool.ack(2)


def test_reopen_resumes_after_the_acknowledged_records(tmp_path) -> None:
    spool = Spool(tmp_path, max_bytes=64 << 10, segment_bytes=256)
    for i in range(100):
        spool.append("fh.telemetry", f"v{i:03d}".encode(), b"k")
    spool.ack(37)
    spool.close()
    again = Spool(tmp_path, max_bytes=64 << 10, segment_bytes=256)
    assert _values(again) == [f"v{i:03d}".encode() for i in range(37, 100)]
    again.append("fh.telemetry", b"new", b"k")
    assert _values(again)[-1] == b"new" and len(again) == 64
    again.close()


def test_a_record_torn_by_a_crash_is_cut_away(tmp_path) -> None:
    spool = Spool(tmp_path)
    spool.append("fh.telemetry", b"whole", None)
    spool.append("fh.telemetry", b"torn-record-value", None)
    spool.close()
    (segment,) = sorted(tmp_path.glob("seg-*.log"))
    segment.write_bytes(segment.read_bytes()[:-5])
    again = Spool(tmp_path)
    assert _values(again) == [b"whole"]
    again.append("fh.telemetry", b"after", None)
    assert _values(again) == [b"whole", b"after"]


def test_beyond_the_bound_the_oldest_are_dropped_and_counted(tmp_path) -> None:
    spool = Spool(tmp_path, max_bytes=8192)
    value = b"x" * 200
    for i in range(200):
        spool.append("fh.telemetry", value + str(i).encode(), b"node")
    stats = spool.stats
    assert stats.bytes <= 8192 and stats.records + stats.dropped_total == 200
    assert stats.dropped_total > 150 and stats.dropped_bytes_total > 0
    kept = _values(spool)
    assert kept == [value + str(i).encode() for i in range(200 - len(kept), 200)]  # the newest survive, in order
    assert len(list(tmp_path.glob("seg-*.log"))) <= 10


def test_ack_until_ignores_records_dropped_meanwhile(tmp_path) -> None:
    spool = Spool(tmp_path, max_bytes=4096)
    for i in range(5):
        spool.append("t", bytes([i]) * 100, None)
    start, batch = spool.head_seq, spool.peek(5)
    for i in range(5, 60):  # an outage-long burst drops the batch being delivered
        spool.append("t", bytes([i]) * 100, None)
    first_kept = _values(spool)[0]
    assert spool.ack_until(start + len(batch)) == 0
    assert _values(spool)[0] == first_kept


def test_records_dropped_in_flight_and_then_delivered_leave_the_drop_counts(tmp_path) -> None:
    """The bound drops records handed to the producer; the broker then acknowledges them: they arrived,
    so the drop report and counters hold only what never reached the bus (published = arrived + dropped)."""
    spool = Spool(tmp_path, max_bytes=4096, segment_bytes=512)
    for i in range(5):
        spool.append("fh.steps", bytes([i]) * 100, b"n1", ts=float(i))
    start, batch = spool.head_seq, spool.peek(3)  # in flight
    for i in range(5, 60):
        spool.append("fh.telemetry", bytes([i]) * 100, b"n1", ts=float(i))
    dropped = spool.stats.dropped_total
    assert dropped > 3
    assert spool.ack_delivered(start, batch) == 0  # all 3 were dropped meanwhile, and arrived
    stats = spool.stats
    assert stats.dropped_total == dropped - 3 and stats.acked_total == 3
    assert stats.appended_total == stats.acked_total + stats.dropped_total + stats.records
    report = spool.drops_to_report()
    assert report is not None and report.records == dropped - 3
    assert report.bytes == stats.dropped_bytes_total
    assert report.topics == {"fh.steps": 2, "fh.telemetry": dropped - 5}


def test_bad_bound_is_a_config_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match="at least 1024"):
        Spool(tmp_path, max_bytes=10)


def test_drops_are_kept_for_a_report_with_counts_topics_and_time_range_until_reported(tmp_path) -> None:
    spool = Spool(tmp_path, max_bytes=2048, segment_bytes=256)
    for i in range(200):
        spool.append("fh.telemetry" if i % 4 else "fh.steps", b"x" * 40, b"n1", ts=1000.0 + i)
    stats = spool.stats
    assert stats.dropped_total > 0
    spool.close()

    spool = Spool(tmp_path, max_bytes=2048, segment_bytes=256)  # the report survives a restart
    report = spool.drops_to_report()
    assert report is not None and report.records == stats.dropped_total and report.bytes == stats.dropped_bytes_total
    assert report.first_ts == 1000.0 and report.last_ts == 1000.0 + stats.dropped_total - 1
    assert report.topics == {"fh.steps": sum(1 for i in range(stats.dropped_total) if i % 4 == 0),
                             "fh.telemetry": sum(1 for i in range(stats.dropped_total) if i % 4)}
    assert spool.peek(1)[0].value == b"x" * 40  # the rest is still queued, oldest first
    for i in range(60):  # more drops while the report is on its way go to the next report
        spool.append("fh.events", b"y" * 40, b"n1", ts=5000.0 + i)
    assert spool.drops_to_report() == report
    spool.drops_reported()
    later = spool.drops_to_report()
    assert later is not None and later.records == spool.stats.dropped_total and later.topics.keys() <= {
        "fh.steps", "fh.telemetry", "fh.events"}
    assert later.last_ts >= report.last_ts
    spool.drops_reported()
    assert spool.drops_to_report() is None
    spool.close()
    assert Spool(tmp_path, max_bytes=2048, segment_bytes=256).drops_to_report() is None


def test_a_record_larger_than_the_bound_is_reported_as_dropped(tmp_path) -> None:
    with Spool(tmp_path, max_bytes=1024) as spool:
        spool.append("fh.events", b"z" * 2000, b"n1", ts=42.0)
        report = spool.drops_to_report()
        assert len(spool) == 0 and report is not None
        assert (report.records, report.first_ts, report.last_ts, report.topics) == (1, 42.0, 42.0, {"fh.events": 1})
