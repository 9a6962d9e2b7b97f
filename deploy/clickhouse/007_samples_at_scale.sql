-- gpu_samples at fleet scale: typed and compressed columns, retention, and 1-minute rollups.
--
-- At 100k GPUs and 1 Hz gpu_samples takes 8.6 billion rows a day, and 001 stored every field as a
-- plain Float64. The table is rebuilt here (a column's type cannot change in place without
-- rewriting it anyway) and the old rows are copied in:
--
-- * Float32 for gauges whose range and the sources' resolution fit in 24 bits of mantissa
--   (temperatures, clocks, power in mW, utilisation, link widths, memory sizes; store/columns.py
--   FLOAT32_FIELDS): a value of up to 6 significant digits reads back as written. Float64 stays for
--   the counters that can pass 2^24 (ECC, NVLink, PCIe replay, energy in mJ) and the clock-reason
--   bitmask.
-- * Codecs: Delta for time and counters, Gorilla for slow gauges, ZSTD(6) for the noisy ones
--   (power, utilisation, tensor activity, NIC utilisation); the GPU UUID is one string per GPU
--   and compresses to almost nothing in (node, gpu, ts) order.
-- * Retention: rows are dropped RAW_RETENTION days after they were received (received, the
--   arrival time, not the event time: a replay or a simulated fleet of last year stays as long as
--   live data). Default 14 days; a store DSN with ?raw_retention_days=N sets another
--   (fleethealth/store/migrations.py, applied on every migrate()). Partitions are days of event
--   time and whole parts are dropped (ttl_only_drop_parts), so expiry never rewrites a part.
-- * gpu_samples_1m: per GPU per minute, filled by the materialized view gpu_samples_1m_mv on every
--   insert: min / max / avg / quantile states (p50, p90, p99; bfloat16, about 0.4 % relative error)
--   of temperature, power, SM clock and utilisation, the HBM temperature's max, the OR of the
--   clock-event reasons and each counter's max. Read with -Merge for avg and quantiles; min, max
--   and the OR fold with min / max / groupBitOr. The named range queries of store/queries.py read
--   it for ranges longer than an hour. A replayed sample with a new deduplication token counts
--   twice in samples, avg and the quantiles (min, max and the counters are unaffected). Rollups
--   are kept 90 days after the minute was last written.
--
-- Run migrations with the writers stopped: rows written to the old table between the copy and the
-- rename would not be carried over.

RENAME TABLE gpu_samples TO gpu_samples_006;

CREATE TABLE gpu_samples
(
    node LowCardinality(String),
    rack LowCardinality(String),
    gpu UInt16,
    ts DateTime64(3, 'UTC') CODEC(Delta, ZSTD(1)),
    model LowCardinality(String),
    uuid String CODEC(ZSTD(3)),
    received DateTime('UTC') DEFAULT now() CODEC(Delta, ZSTD(1)) COMMENT 'when the row was stored (retention)',
    nic_util Float32 DEFAULT nan CODEC(ZSTD(6)) COMMENT 'node NIC utilisation in [0, 1]; NaN = not reported',
    temp_c Float32 DEFAULT nan CODEC(Gorilla, ZSTD(1)) COMMENT 'GPU core temperature, °C',
    mem_temp_c Float32 DEFAULT nan CODEC(Gorilla, ZSTD(1)) COMMENT 'HBM temperature, °C',
    power_w Float32 DEFAULT nan CODEC(ZSTD(6)) COMMENT 'power draw, W',
    power_limit_w Float32 DEFAULT nan CODEC(Gorilla, ZSTD(1)) COMMENT 'enforced power limit, W',
    sm_clock_mhz Float32 DEFAULT nan CODEC(Gorilla, ZSTD(1)) COMMENT 'SM clock, MHz',
    sm_clock_max_mhz Float32 DEFAULT nan CODEC(Gorilla, ZSTD(1)) COMMENT 'maximum SM clock, MHz',
    mem_clock_mhz Float32 DEFAULT nan CODEC(Gorilla, ZSTD(1)) COMMENT 'memory clock, MHz',
    clock_reasons Float64 DEFAULT nan CODEC(Gorilla, ZSTD(1)) COMMENT 'clock-event reason bitmask (ClockReason)',
    util_pct Float32 DEFAULT nan CODEC(ZSTD(6)) COMMENT 'GPU utilisation, %',
    ecc_sbe_volatile Float64 DEFAULT nan CODEC(Delta, ZSTD(1)) COMMENT 'corrected ECC errors since driver load',
    ecc_dbe_volatile Float64 DEFAULT nan CODEC(Delta, ZSTD(1)) COMMENT 'uncorrected ECC errors since driver load',
    ecc_sbe_aggregate Float64 DEFAULT nan CODEC(Delta, ZSTD(1)) COMMENT 'corrected ECC errors, lifetime',
    ecc_dbe_aggregate Float64 DEFAULT nan CODEC(Delta, ZSTD(1)) COMMENT 'uncorrected ECC errors, lifetime',
    retired_sbe Float32 DEFAULT nan CODEC(Delta, ZSTD(1)) COMMENT 'pages retired for corrected errors',
    retired_dbe Float32 DEFAULT nan CODEC(Delta, ZSTD(1)) COMMENT 'pages retired for uncorrected errors',
    retired_pending Float32 DEFAULT nan CODEC(Gorilla, ZSTD(1)) COMMENT '1 when a page retirement waits for a reset',
    remap_correctable Float32 DEFAULT nan CODEC(Delta, ZSTD(1)) COMMENT 'rows remapped for corrected errors',
    remap_uncorrectable Float32 DEFAULT nan CODEC(Delta, ZSTD(1)) COMMENT 'rows remapped for uncorrected errors',
    remap_pending Float32 DEFAULT nan CODEC(Gorilla, ZSTD(1)) COMMENT '1 when a row remap waits for a reset',
    remap_failure Float32 DEFAULT nan CODEC(Gorilla, ZSTD(1)) COMMENT '1 when a row remap failed',
    nvlink_links_up Float32 DEFAULT nan CODEC(Gorilla, ZSTD(1)) COMMENT 'NVLink links active',
    nvlink_links_max Float32 DEFAULT nan CODEC(Gorilla, ZSTD(1)) COMMENT 'NVLink links the GPU has',
    nvlink_crc_flit Float64 DEFAULT nan CODEC(Delta, ZSTD(1)) COMMENT 'NVLink CRC flit errors, total over links',
    nvlink_crc_data Float64 DEFAULT nan CODEC(Delta, ZSTD(1)) COMMENT 'NVLink CRC data errors, total over links',
    nvlink_replay Float64 DEFAULT nan CODEC(Delta, ZSTD(1)) COMMENT 'NVLink replay errors, total over links',
    nvlink_recovery Float64 DEFAULT nan CODEC(Delta, ZSTD(1)) COMMENT 'NVLink recovery errors, total over links',
    pcie_replay Float64 DEFAULT nan CODEC(Delta, ZSTD(1)) COMMENT 'PCIe replay counter',
    pcie_gen Float32 DEFAULT nan CODEC(Gorilla, ZSTD(1)) COMMENT 'current PCIe link generation',
    pcie_gen_max Float32 DEFAULT nan CODEC(Gorilla, ZSTD(1)) COMMENT 'maximum PCIe link generation',
    pcie_width Float32 DEFAULT nan CODEC(Gorilla, ZSTD(1)) COMMENT 'current PCIe link width',
    pcie_width_max Float32 DEFAULT nan CODEC(Gorilla, ZSTD(1)) COMMENT 'maximum PCIe link width',
    fb_used_mib Float32 DEFAULT nan CODEC(Gorilla, ZSTD(1)) COMMENT 'framebuffer memory used, MiB',
    fb_free_mib Float32 DEFAULT nan CODEC(Gorilla, ZSTD(1)) COMMENT 'framebuffer memory free, MiB',
    energy_mj Float64 DEFAULT nan CODEC(Delta, ZSTD(1)) COMMENT 'energy consumed since the driver loaded, mJ',
    tensor_active Float32 DEFAULT nan CODEC(ZSTD(6)) COMMENT 'share of cycles the tensor pipes were active, 0-1',
    slowdown_temp_c Float32 DEFAULT nan CODEC(Gorilla, ZSTD(1)) COMMENT 'the GPU''s own slowdown temperature, °C: above it the GPU throttles itself (NaN: not reported)',
)
ENGINE = ReplacingMergeTree
PARTITION BY toDate(ts)
ORDER BY (node, gpu, ts)
TTL received + INTERVAL 14 DAY
SETTINGS non_replicated_deduplication_window = 1000, ttl_only_drop_parts = 1;

CREATE TABLE IF NOT EXISTS gpu_samples_1m
(
    node LowCardinality(String),
    gpu UInt16,
    minute DateTime('UTC') CODEC(Delta, ZSTD(1)),
    rack SimpleAggregateFunction(anyLast, LowCardinality(String)),
    samples SimpleAggregateFunction(sum, UInt64),
    received SimpleAggregateFunction(max, DateTime('UTC')),
    temp_c_min SimpleAggregateFunction(min, Nullable(Float32)),
    temp_c_max SimpleAggregateFunction(max, Nullable(Float32)),
    temp_c_avg AggregateFunction(avg, Nullable(Float32)),
    temp_c_q AggregateFunction(quantilesBFloat16(0.5, 0.9, 0.99), Nullable(Float32)),
    power_w_min SimpleAggregateFunction(min, Nullable(Float32)),
    power_w_max SimpleAggregateFunction(max, Nullable(Float32)),
    power_w_avg AggregateFunction(avg, Nullable(Float32)),
    power_w_q AggregateFunction(quantilesBFloat16(0.5, 0.9, 0.99), Nullable(Float32)),
    sm_clock_mhz_min SimpleAggregateFunction(min, Nullable(Float32)),
    sm_clock_mhz_max SimpleAggregateFunction(max, Nullable(Float32)),
    sm_clock_mhz_avg AggregateFunction(avg, Nullable(Float32)),
    sm_clock_mhz_q AggregateFunction(quantilesBFloat16(0.5, 0.9, 0.99), Nullable(Float32)),
    util_pct_min SimpleAggregateFunction(min, Nullable(Float32)),
    util_pct_max SimpleAggregateFunction(max, Nullable(Float32)),
    util_pct_avg AggregateFunction(avg, Nullable(Float32)),
    util_pct_q AggregateFunction(quantilesBFloat16(0.5, 0.9, 0.99), Nullable(Float32)),
    mem_temp_c_max SimpleAggregateFunction(max, Nullable(Float32)),
    clock_reasons_or SimpleAggregateFunction(groupBitOr, UInt64) COMMENT 'OR of the minute''s clock-event reasons',
    ecc_sbe_volatile_max SimpleAggregateFunction(max, Nullable(Float64)),
    ecc_dbe_volatile_max SimpleAggregateFunction(max, Nullable(Float64)),
    ecc_sbe_aggregate_max SimpleAggregateFunction(max, Nullable(Float64)),
    ecc_dbe_aggregate_max SimpleAggregateFunction(max, Nullable(Float64)),
    retired_sbe_max SimpleAggregateFunction(max, Nullable(Float32)),
    retired_dbe_max SimpleAggregateFunction(max, Nullable(Float32)),
    remap_correctable_max SimpleAggregateFunction(max, Nullable(Float32)),
    remap_uncorrectable_max SimpleAggregateFunction(max, Nullable(Float32)),
    nvlink_crc_flit_max SimpleAggregateFunction(max, Nullable(Float64)),
    nvlink_crc_data_max SimpleAggregateFunction(max, Nullable(Float64)),
    nvlink_replay_max SimpleAggregateFunction(max, Nullable(Float64)),
    nvlink_recovery_max SimpleAggregateFunction(max, Nullable(Float64)),
    pcie_replay_max SimpleAggregateFunction(max, Nullable(Float64)),
    energy_mj_max SimpleAggregateFunction(max, Nullable(Float64))
)
ENGINE = AggregatingMergeTree
PARTITION BY toYYYYMM(minute)
ORDER BY (node, gpu, minute)
TTL received + INTERVAL 90 DAY;

CREATE MATERIALIZED VIEW IF NOT EXISTS gpu_samples_1m_mv TO gpu_samples_1m AS
SELECT
    node,
    gpu,
    toStartOfMinute(ts) AS minute,
    anyLast(rack) AS rack,
    count() AS samples,
    max(received) AS received,
    min(if(isNaN(temp_c), NULL, temp_c)) AS temp_c_min,
    max(if(isNaN(temp_c), NULL, temp_c)) AS temp_c_max,
    avgState(if(isNaN(temp_c), NULL, temp_c)) AS temp_c_avg,
    quantilesBFloat16State(0.5, 0.9, 0.99)(if(isNaN(temp_c), NULL, temp_c)) AS temp_c_q,
    min(if(isNaN(power_w), NULL, power_w)) AS power_w_min,
    max(if(isNaN(power_w), NULL, power_w)) AS power_w_max,
    avgState(if(isNaN(power_w), NULL, power_w)) AS power_w_avg,
    quantilesBFloat16State(0.5, 0.9, 0.99)(if(isNaN(power_w), NULL, power_w)) AS power_w_q,
    min(if(isNaN(sm_clock_mhz), NULL, sm_clock_mhz)) AS sm_clock_mhz_min,
    max(if(isNaN(sm_clock_mhz), NULL, sm_clock_mhz)) AS sm_clock_mhz_max,
    avgState(if(isNaN(sm_clock_mhz), NULL, sm_clock_mhz)) AS sm_clock_mhz_avg,
    quantilesBFloat16State(0.5, 0.9, 0.99)(if(isNaN(sm_clock_mhz), NULL, sm_clock_mhz)) AS sm_clock_mhz_q,
    min(if(isNaN(util_pct), NULL, util_pct)) AS util_pct_min,
    max(if(isNaN(util_pct), NULL, util_pct)) AS util_pct_max,
    avgState(if(isNaN(util_pct), NULL, util_pct)) AS util_pct_avg,
    quantilesBFloat16State(0.5, 0.9, 0.99)(if(isNaN(util_pct), NULL, util_pct)) AS util_pct_q,
    max(if(isNaN(mem_temp_c), NULL, mem_temp_c)) AS mem_temp_c_max,
    groupBitOr(toUInt64(if(isNaN(clock_reasons), 0, clock_reasons))) AS clock_reasons_or,
    max(if(isNaN(ecc_sbe_volatile), NULL, ecc_sbe_volatile)) AS ecc_sbe_volatile_max,
    max(if(isNaN(ecc_dbe_volatile), NULL, ecc_dbe_volatile)) AS ecc_dbe_volatile_max,
    max(if(isNaN(ecc_sbe_aggregate), NULL, ecc_sbe_aggregate)) AS ecc_sbe_aggregate_max,
    max(if(isNaN(ecc_dbe_aggregate), NULL, ecc_dbe_aggregate)) AS ecc_dbe_aggregate_max,
    max(if(isNaN(retired_sbe), NULL, retired_sbe)) AS retired_sbe_max,
    max(if(isNaN(retired_dbe), NULL, retired_dbe)) AS retired_dbe_max,
    max(if(isNaN(remap_correctable), NULL, remap_correctable)) AS remap_correctable_max,
    max(if(isNaN(remap_uncorrectable), NULL, remap_uncorrectable)) AS remap_uncorrectable_max,
    max(if(isNaN(nvlink_crc_flit), NULL, nvlink_crc_flit)) AS nvlink_crc_flit_max,
    max(if(isNaN(nvlink_crc_data), NULL, nvlink_crc_data)) AS nvlink_crc_data_max,
    max(if(isNaN(nvlink_replay), NULL, nvlink_replay)) AS nvlink_replay_max,
    max(if(isNaN(nvlink_recovery), NULL, nvlink_recovery)) AS nvlink_recovery_max,
    max(if(isNaN(pcie_replay), NULL, pcie_replay)) AS pcie_replay_max,
    max(if(isNaN(energy_mj), NULL, energy_mj)) AS energy_mj_max
FROM gpu_samples
GROUP BY node, gpu, minute;

INSERT INTO gpu_samples (node, rack, gpu, ts, model, uuid, nic_util, temp_c, mem_temp_c, power_w, power_limit_w, sm_clock_mhz, sm_clock_max_mhz, mem_clock_mhz, clock_reasons, util_pct, ecc_sbe_volatile, ecc_dbe_volatile, ecc_sbe_aggregate, ecc_dbe_aggregate, retired_sbe, retired_dbe, retired_pending, remap_correctable, remap_uncorrectable, remap_pending, remap_failure, nvlink_links_up, nvlink_links_max, nvlink_crc_flit, nvlink_crc_data, nvlink_replay, nvlink_recovery, pcie_replay, pcie_gen, pcie_gen_max, pcie_width, pcie_width_max, fb_used_mib, fb_free_mib, energy_mj, tensor_active, slowdown_temp_c)
SELECT node, rack, gpu, ts, model, uuid, nic_util, temp_c, mem_temp_c, power_w, power_limit_w, sm_clock_mhz, sm_clock_max_mhz, mem_clock_mhz, clock_reasons, util_pct, ecc_sbe_volatile, ecc_dbe_volatile, ecc_sbe_aggregate, ecc_dbe_aggregate, retired_sbe, retired_dbe, retired_pending, remap_correctable, remap_uncorrectable, remap_pending, remap_failure, nvlink_links_up, nvlink_links_max, nvlink_crc_flit, nvlink_crc_data, nvlink_replay, nvlink_recovery, pcie_replay, pcie_gen, pcie_gen_max, pcie_width, pcie_width_max, fb_used_mib, fb_free_mib, energy_mj, tensor_active, slowdown_temp_c
FROM gpu_samples_006
SETTINGS max_partitions_per_insert_block = 0;

DROP TABLE gpu_samples_006;
