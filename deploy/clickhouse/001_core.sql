-- Core tables: GPU samples, per-rank step times, events, findings, recommendations, dead letters.
--
-- Every table is a ReplacingMergeTree on its natural key, so a replayed input never leaves
-- duplicates after a merge (read with FINAL for an exact answer before one), and keeps a
-- non_replicated_deduplication_window, so an insert repeated with the same
-- insert_deduplication_token is stored once. ORDER BY follows the analyst queries: a node over
-- time; a job by step and rank. ts is event time (DateTime64(3), UTC). Tables whose rows carry an
-- id derived from the event time also keep that time exactly as ts_s (epoch seconds, Float64).
-- JSON objects (evidence, data) are stored as String; read them with JSONExtract*.

CREATE TABLE IF NOT EXISTS gpu_samples
(
    node LowCardinality(String),
    rack LowCardinality(String),
    gpu UInt16,
    ts DateTime64(3, 'UTC'),
    model LowCardinality(String),
    uuid String,
    nic_util Float64 COMMENT 'node NIC utilisation in [0, 1]; NaN = not reported',
    temp_c Float64 COMMENT 'GPU core temperature, °C',
    mem_temp_c Float64 COMMENT 'HBM temperature, °C',
    power_w Float64 COMMENT 'power draw, W',
    power_limit_w Float64 COMMENT 'enforced power limit, W',
    sm_clock_mhz Float64 COMMENT 'SM clock, MHz',
    sm_clock_max_mhz Float64 COMMENT 'maximum SM clock, MHz',
    mem_clock_mhz Float64 COMMENT 'memory clock, MHz',
    clock_reasons Float64 COMMENT 'clock-event reason bitmask (ClockReason)',
    util_pct Float64 COMMENT 'GPU utilisation, %',
    ecc_sbe_volatile Float64 COMMENT 'corrected ECC errors since driver load',
    ecc_dbe_volatile Float64 COMMENT 'uncorrected ECC errors since driver load',
    ecc_sbe_aggregate Float64 COMMENT 'corrected ECC errors, lifetime',
    ecc_dbe_aggregate Float64 COMMENT 'uncorrected ECC errors, lifetime',
    retired_sbe Float64 COMMENT 'pages retired for corrected errors',
    retired_dbe Float64 COMMENT 'pages retired for uncorrected errors',
    retired_pending Float64 COMMENT '1 when a page retirement waits for a reset',
    remap_correctable Float64 COMMENT 'rows remapped for corrected errors',
    remap_uncorrectable Float64 COMMENT 'rows remapped for uncorrected errors',
    remap_pending Float64 COMMENT '1 when a row remap waits for a reset',
    remap_failure Float64 COMMENT '1 when a row remap failed',
    nvlink_links_up Float64 COMMENT 'NVLink links active',
    nvlink_links_max Float64 COMMENT 'NVLink links the GPU has',
    nvlink_crc_flit Float64 COMMENT 'NVLink CRC flit errors, total over links',
    nvlink_crc_data Float64 COMMENT 'NVLink CRC data errors, total over links',
    nvlink_replay Float64 COMMENT 'NVLink replay errors, total over links',
    nvlink_recovery Float64 COMMENT 'NVLink recovery errors, total over links',
    pcie_replay Float64 COMMENT 'PCIe replay counter',
    pcie_gen Float64 COMMENT 'current PCIe link generation',
    pcie_gen_max Float64 COMMENT 'maximum PCIe link generation',
    pcie_width Float64 COMMENT 'current PCIe link width',
    pcie_width_max Float64 COMMENT 'maximum PCIe link width'
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(ts)
ORDER BY (node, gpu, ts)
SETTINGS non_replicated_deduplication_window = 1000;

CREATE TABLE IF NOT EXISTS rank_steps
(
    job LowCardinality(String),
    step UInt64,
    rank UInt32,
    node LowCardinality(String),
    gpu UInt16,
    ts DateTime64(3, 'UTC'),
    compute_s Float64 COMMENT 'pre-collective compute time of the step, seconds',
    rank_group Int32 COMMENT 'comparable-rank group (e.g. pipeline stage); -1 = none',
    INDEX node_idx node TYPE set(0) GRANULARITY 4
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(ts)
ORDER BY (job, step, rank)
SETTINGS non_replicated_deduplication_window = 1000;

CREATE TABLE IF NOT EXISTS events
(
    id String,
    node LowCardinality(String),
    ts DateTime64(3, 'UTC'),
    ts_s Float64,
    kind LowCardinality(String),
    job String COMMENT 'empty = none',
    gpu Nullable(UInt16),
    rank Nullable(UInt32),
    step Nullable(UInt64),
    code Nullable(Int64),
    message String,
    data String COMMENT 'JSON object; keys depend on kind',
    INDEX job_idx job TYPE set(0) GRANULARITY 4,
    INDEX kind_idx kind TYPE set(0) GRANULARITY 4
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(ts)
ORDER BY (node, ts, id)
SETTINGS non_replicated_deduplication_window = 1000;

CREATE TABLE IF NOT EXISTS findings
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
    INDEX job_idx job TYPE set(0) GRANULARITY 4,
    INDEX kind_idx kind TYPE set(0) GRANULARITY 4
)
ENGINE = ReplacingMergeTree
ORDER BY (node, ts, id)
SETTINGS non_replicated_deduplication_window = 1000;

CREATE TABLE IF NOT EXISTS recommendations
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
    INDEX job_idx job TYPE set(0) GRANULARITY 4
)
ENGINE = ReplacingMergeTree
ORDER BY (node, ts, id)
SETTINGS non_replicated_deduplication_window = 1000;

CREATE TABLE IF NOT EXISTS deadletter
(
    ts DateTime64(3, 'UTC') COMMENT 'broker timestamp of the rejected record',
    topic LowCardinality(String),
    partition UInt32,
    offset UInt64,
    key String,
    reason String,
    raw String COMMENT 'the value as text, or base64 when raw_base64',
    raw_base64 Bool
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(ts)
ORDER BY (topic, partition, offset)
SETTINGS non_replicated_deduplication_window = 1000;
