"""The stream runner's metrics: ``fleethealth_detect_*`` (records, findings, lag, outbox, snapshots, ...)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

__all__ = ["RunnerMetrics"]


class RunnerMetrics:
    """The runner's ``fleethealth_detect_*`` metrics (and the policy's breaker gauge), on one registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.records = Counter("fleethealth_detect_records_total", "Input records processed", ["topic"],
                               registry=registry)
        self.findings = Counter("fleethealth_detect_findings_total", "Findings written", ["kind"], registry=registry)
        self.recommendations = Counter("fleethealth_detect_recommendations_total", "Recommendations written",
                                       ["action"], registry=registry)
        self.dead_letters = Counter("fleethealth_detect_dead_letters_total", "Records dead-lettered by this runner",
                                    registry=registry)
        self.holes = Counter("fleethealth_detect_log_holes_total", "Holes in a partition's log (offsets the high "
                             "watermark counts and no record holds) passed over or skipped, each dead-lettered",
                             registry=registry)
        self.hole_offsets = Counter("fleethealth_detect_log_hole_offsets_total", "Offsets in those holes",
                                    registry=registry)
        self.lag = Gauge("fleethealth_detect_lag_records", "Records not yet read, over assigned partitions",
                         registry=registry)
        self.held = Gauge("fleethealth_detect_buffered_records", "Records held for event-time order", registry=registry)
        self.held_samples = Gauge("fleethealth_detect_held_sample_rows", "Telemetry and step rows held for one later "
                                  "insert (detect.runner.store_every_s); their offsets are not committed yet",
                                  registry=registry)
        self.dropped = Gauge("fleethealth_detect_unscored_batches", "Step batches stored but not scored, by reason",
                             ["reason"], registry=registry)
        self.early = Counter("fleethealth_detect_released_early_records_total",
                             "Records released before the watermark because the reorder buffer was full",
                             registry=registry)
        self.outbox = Gauge("fleethealth_detect_outbox_pending", "Stored findings and recommendations not yet "
                            "acknowledged by the broker", registry=registry)
        self.unscored_jobs = Gauge("fleethealth_detect_unscored_jobs", "Jobs whose steps the straggler detector "
                                   "does not score: fewer comparable ranks than detect.straggler.min_group",
                                   registry=registry)
        self.over_limit = Gauge("fleethealth_detect_over_limit_records",
                                "Records dead-lettered for naming a new job or node beyond the cardinality limits",
                                ["what"], registry=registry)
        self.publish_errors = Counter("fleethealth_detect_publish_errors_total",
                                      "Publishes of the outbox that failed (retried on the next batch)",
                                      registry=registry)
        self.states = Counter("fleethealth_detect_node_states_published_total",
                              "Node states published on fh.nodestate (changes and heartbeats)", registry=registry)
        self.passed_over = Counter("fleethealth_detect_node_states_passed_over_total",
                                   "Node states a job-stage replica did not decode: neither its jobs' nodes nor "
                                   "their rack peers (detectors/nodetable.py)", registry=registry)
        self.snapshots = Counter("fleethealth_detect_snapshots_total", "Pipeline snapshots written", registry=registry)
        self.snapshot_bytes = Gauge("fleethealth_detect_snapshot_bytes", "Size of the newest snapshot written",
                                    registry=registry)
        self.snapshot_errors = Counter("fleethealth_detect_snapshot_errors_total",
                                       "Snapshots refused when read (unsigned or wrongly signed, corrupt, over a "
                                       "cap, offsets outside the partition, another version: rebuilt from the "
                                       "input instead) or not written (a state over a cap)", registry=registry)
        self.poisoned = Counter("fleethealth_detect_poisoned_records_total",
                                "Records and conclusions dead-lettered because a detector or a store write "
                                "failed on them deterministically", ["stage"], registry=registry)
        self.breaker_open = Gauge("fleethealth_policy_breaker_open", "1 while the fleet circuit breaker is open "
                                  "(automatic removals wait for a human)", registry=registry)
        self._totals: dict[str, int] = {}

    def advance(self, name: str, total: int) -> None:
        """Raise counter ``name`` to the running ``total`` a part keeps (a counter only goes up)."""
        delta = total - self._totals.get(name, 0)
        if delta > 0:
            getattr(self, name).inc(delta)
            self._totals[name] = total
