-- Findings keyed on what they are about, with the start of their episode.
--
-- A finding's id names its kind, detector, job, node, GPU, rank and the event time its episode
-- began (episode_ts_s; fleethealth/ids.py), not when a detector concluded, so a restart that
-- detects the same episode again, at another step or time, derives the same id. 001 ordered the
-- table by (node, ts, id), ts being when the detector concluded, so such a re-detection was a second
-- row even under FINAL. It is now ordered by (node, id): the later row of an id replaces the earlier.

CREATE TABLE IF NOT EXISTS findings_by_id
(
    id String,
    kind LowCardinality(String),
    detector LowCardinality(String),
    job String COMMENT 'empty = none',
    node LowCardinality(String),
    gpu Nullable(UInt16),
    rank Nullable(UInt32),
    step Nullable(UInt64) COMMENT 'first step at which the detector concluded',
    ts DateTime64(3, 'UTC'),
    ts_s Float64,
    diagnosis LowCardinality(Nullable(String)),
    z Nullable(Float64),
    slowdown Nullable(Float64),
    probability Nullable(Float64),
    evidence String COMMENT 'JSON object',
    episode_ts_s Nullable(Float64) COMMENT 'event time the episode began, epoch seconds (null: before episodes were named)',
    INDEX job_idx job TYPE set(0) GRANULARITY 4,
    INDEX kind_idx kind TYPE set(0) GRANULARITY 4
)
ENGINE = ReplacingMergeTree
ORDER BY (node, id)
SETTINGS non_replicated_deduplication_window = 1000;

INSERT INTO findings_by_id (id, kind, detector, job, node, gpu, rank, step, ts, ts_s, diagnosis, z, slowdown,
                            probability, evidence)
SELECT id, kind, detector, job, node, gpu, rank, step, ts, ts_s, diagnosis, z, slowdown, probability, evidence
FROM findings FINAL;

RENAME TABLE findings TO findings_by_ts, findings_by_id TO findings;

DROP TABLE findings_by_ts;
