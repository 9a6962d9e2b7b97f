-- rank_steps at fleet scale: codecs and retention.
--
-- Ten jobs over 100k GPUs at 1-10 steps/s write 0.1-1 M rank-steps a second, as many rows as
-- gpu_samples or more, and 001 stored them without codecs or TTL. The table is rebuilt (a codec
-- on the sorting key's columns cannot be changed in place) and the old rows copied in:
--
-- * Codecs, in (job, step, rank) order: DoubleDelta for step (runs of one value, then +1) and for
--   ts (the step's end on each node, shared by the node's ranks), Delta for rank (+1 from row to row),
--   ZSTD for gpu and rank_group. job and node stay LowCardinality.
-- * compute_s stays Float64, with ZSTD(6) (compute times to the µs are noise in their low digits:
--   Gorilla, FPC and Delta do no better). Float32 would halve it but keeps 24 bits of mantissa:
--   0.12 µs of rounding at 1-2 s, 0.5-1 µs at 8-32 s, more above, and the stored value would no
--   longer be the value sent (the store gives back what the detectors scored).
--   bench/store_scale.py measures both.
-- * Retention: rows are dropped RAW_RETENTION days after they were received (a new column, the
--   arrival time; rows copied here count as received now), as gpu_samples is: 14 days, or the
--   store DSN's ?raw_retention_days=N (fleethealth/store/migrations.py). Partitions are days of
--   event time (they were months) so whole parts are dropped (ttl_only_drop_parts).
--
-- Run migrations with the writers stopped: rows written to the old table between the copy and the
-- rename would not be carried over.

RENAME TABLE rank_steps TO rank_steps_009;

CREATE TABLE rank_steps
(
    job LowCardinality(String),
    step UInt64 CODEC(DoubleDelta, ZSTD(1)),
    rank UInt32 CODEC(Delta, ZSTD(1)),
    node LowCardinality(String),
    gpu UInt16 CODEC(ZSTD(1)),
    ts DateTime64(3, 'UTC') CODEC(DoubleDelta, ZSTD(1)),
    compute_s Float64 CODEC(ZSTD(6)) COMMENT 'pre-collective compute time of the step, seconds',
    rank_group Int32 CODEC(ZSTD(1)) COMMENT 'comparable-rank group (e.g. pipeline stage); -1 = none',
    received DateTime('UTC') DEFAULT now() CODEC(Delta, ZSTD(1)) COMMENT 'when the row was stored (retention)',
    INDEX node_idx node TYPE set(0) GRANULARITY 4
)
ENGINE = ReplacingMergeTree
PARTITION BY toDate(ts)
ORDER BY (job, step, rank)
TTL received + INTERVAL 14 DAY
SETTINGS non_replicated_deduplication_window = 1000, ttl_only_drop_parts = 1;

INSERT INTO rank_steps (job, step, rank, node, gpu, ts, compute_s, rank_group)
SELECT job, step, rank, node, gpu, ts, compute_s, rank_group
FROM rank_steps_009
SETTINGS max_partitions_per_insert_block = 0;

DROP TABLE rank_steps_009;
