-- Policy state: the quarantine book, the fleet circuit breaker, eviction outcomes and the engine's
-- guard state. Tables whose rows change use ReplacingMergeTree with a version column and are read
-- with FINAL, so the newest version of each key wins. Times are event time (DateTime64(3), UTC),
-- as in the core tables; JSON objects (evidence, state) are stored as String.

CREATE TABLE IF NOT EXISTS quarantine
(
    node String,
    quarantined UInt8,
    reason String,
    since DateTime64(3, 'UTC'),
    finding_id Nullable(String),
    runs_affected Array(String),
    released_ts Nullable(DateTime64(3, 'UTC')),
    release_evidence String,
    updated_ts DateTime64(3, 'UTC'),
    version UInt64
)
ENGINE = ReplacingMergeTree(version)
ORDER BY node;

CREATE TABLE IF NOT EXISTS quarantine_log
(
    node String,
    ts DateTime64(3, 'UTC'),
    action LowCardinality(String),
    detail String,
    evidence String,
    seq UInt64
)
ENGINE = MergeTree
ORDER BY (node, ts, seq);

CREATE TABLE IF NOT EXISTS breaker
(
    name String,
    open UInt8,
    tripped_ts Nullable(DateTime64(3, 'UTC')),
    reason String,
    reset_ts Nullable(DateTime64(3, 'UTC')),
    reset_by String,
    version UInt64
)
ENGINE = ReplacingMergeTree(version)
ORDER BY name;

CREATE TABLE IF NOT EXISTS eviction_outcomes
(
    ts DateTime64(3, 'UTC'),
    node String,
    job String,
    diagnosis LowCardinality(String),
    finding_id String,
    resolved UInt8
)
ENGINE = MergeTree
ORDER BY (diagnosis, ts, node);

CREATE TABLE IF NOT EXISTS policy_state
(
    key String,
    ts DateTime64(3, 'UTC'),
    state String,
    version UInt64
)
ENGINE = ReplacingMergeTree(version)
ORDER BY key;
