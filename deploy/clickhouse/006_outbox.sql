-- The outbox, and recommendations keyed on what they are about.
--
-- outbox: every finding and recommendation the runner decides to publish is written here, with the
-- payload it publishes, before the policy state that remembers the decision; published = 0 until the
-- broker has acknowledged it, then the row is written again with published = 1 (version 1 wins under
-- FINAL). A runner (re)publishes every row still at 0 when it starts and after any failed publish, so
-- a crash or a broker error between store and bus loses nothing; ids are derived from the finding
-- and the action, so a republish is a duplicate consumers drop by id (`fleethealth act` does).
--
-- recommendations: 001 ordered the table by (node, ts, id), ts being the decision time, so the same
-- recommendation decided again after a restart was a second row even under FINAL. It is now ordered
-- by (node, id); `acked` (1 once acknowledged) is the version, so a replayed decision cannot undo an
-- acknowledgement.

CREATE TABLE IF NOT EXISTS outbox
(
    id String,
    topic LowCardinality(String),
    key String,
    ts_s Float64 COMMENT 'event time of the decision, epoch seconds',
    payload String COMMENT 'the JSON value published',
    published UInt8,
    version UInt64 COMMENT '0 pending, 1 published'
)
ENGINE = ReplacingMergeTree(version)
ORDER BY (topic, id)
SETTINGS non_replicated_deduplication_window = 1000;

CREATE TABLE IF NOT EXISTS recommendations_by_id
(
    id String,
    action LowCardinality(String),
    node LowCardinality(String),
    job String COMMENT 'empty = none',
    reason String,
    guard LowCardinality(String),
    ts DateTime64(3, 'UTC'),
    ts_s Float64,
    finding_id String COMMENT 'empty = none',
    dry_run Bool,
    evidence String COMMENT 'JSON object',
    acked_at Nullable(DateTime64(3, 'UTC')),
    acked_by String,
    acked UInt8 MATERIALIZED isNotNull(acked_at),
    INDEX job_idx job TYPE set(0) GRANULARITY 4
)
ENGINE = ReplacingMergeTree(acked)
ORDER BY (node, id)
SETTINGS non_replicated_deduplication_window = 1000;

INSERT INTO recommendations_by_id (id, action, node, job, reason, guard, ts, ts_s, finding_id, dry_run, evidence,
                                   acked_at, acked_by)
SELECT id, action, node, job, reason, guard, ts, ts_s, finding_id, dry_run, evidence, acked_at, acked_by
FROM recommendations FINAL;

RENAME TABLE recommendations TO recommendations_by_ts, recommendations_by_id TO recommendations;

DROP TABLE recommendations_by_ts;
