"""Counts are Prometheus counters (``_total``, monotone), levels are gauges: a dead letter is a
count, so ``rate(fleethealth_detect_dead_letters_total[5m])`` works in an alert."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from fleethealth.detectors.metrics import RunnerMetrics


def test_counts_are_counters_and_advance_only_forward() -> None:
    registry = CollectorRegistry()
    metrics = RunnerMetrics(registry)
    kinds = {m.name: m.type for m in registry.collect()}
    assert kinds["fleethealth_detect_dead_letters"] == "counter"
    assert kinds["fleethealth_detect_released_early_records"] == "counter"
    assert kinds["fleethealth_detect_lag_records"] == "gauge"
    for total in (3, 3, 5, 4, 9):  # a running total that a restarted part could report lower
        metrics.advance("dead_letters", total)
    assert registry.get_sample_value("fleethealth_detect_dead_letters_total") == 9.0
    # every metric whose name says it counts something is a counter
    for m in registry.collect():
        if m.type == "gauge":
            assert not m.name.endswith("_total"), m.name
