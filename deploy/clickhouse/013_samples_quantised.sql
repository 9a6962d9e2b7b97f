-- gpu_samples at the sensors' resolution, and rollups that do not grow with the GPUs.
--
-- 1. The raw samples, <= 8 bytes a sample. 007 stored each gauge as the float the probe sent (power
--    to the mW, energy to the mJ, ratios to 1e-4): digits below what the sensors measure, which are
--    noise and cost most of the bytes. The gauges those digits cost most are stored as scaled
--    integers at the sensor's documented resolution or accuracy (docs/scaling.md, "What the sensors
--    can tell": power 0.1 W, energy 1 J, ratios 1e-3, utilisation whole %, temperatures 0.1 °C), each
--    under a column named for its unit (power_dw: deciwatts, 0.1 W) with a sentinel for
--    "not reported", and the column the readers know (power_w, ...) is an ALIAS that gives the value
--    back in its unit as Float64 (NaN = not reported): every reader, view and analyst query reads
--    power_w as before. Writers give fleethealth/store/columns.py sample_columns() the fields in their
--    units; it rounds them and fills the stored columns. T64 (drops the unused high bits) then ZSTD
--    for the noisy ones, Delta for the energy counter. The other fields keep 007's types and codecs
--    (counters exact, Float64); columns.py rounds the Float32 gauges among them (clocks, limits,
--    memory) to their resolution too. The table is rebuilt and the rows copied in, quantised.
-- 2. Rollups cascaded from the per-GPU minute (gpu_samples_1m, 007), each filled at insert by a
--    materialized view over the minute rows being written:
--    * gpu_samples_1h: per GPU per hour, the same aggregates as the minute (states merged, so its
--      quantiles are the raw samples' bfloat16 quantiles, not quantiles of quantiles);
--    * gpu_samples_rack_1m: per rack per minute: temperature min / max / avg / quantiles, HBM
--      temperature max, power max / avg, utilisation avg, the OR of the clock-event reasons.
--    Both are backfilled from the minute rows already stored and kept 400 / 90 days after last written.
--    The named range queries (fleethealth/store/queries/report.py) read the coarsest one that answers
--    the range at the resolution asked.
-- 3. A replayed insert with the same deduplication token is dropped by gpu_samples and, since every
--    rollup now has a deduplication window too, by each view's target (ClickHouse passes the
--    deduplication down the views: deduplicate_blocks_in_dependent_materialized_views, on by default);
--    007's minute rollup had none and counted such a replay twice in samples, avg and quantiles.
--
-- The views over gpu_samples are dropped first and made again after the copy (over the new table;
-- the copied rows are in the rollups already); the minute view casts the gauges that are Float64
-- aliases now to the Float32 its states hold, as 007 stored them. Retention is 14 days as 007 made it, or the store
-- DSN's ?raw_retention_days=N set again after the migration (fleethealth/store/migrations.py).
-- Run migrations with the writers stopped: rows written to the old table between the copy and the
-- rename would not be carried over.

DROP TABLE IF EXISTS gpu_samples_1m_mv;

DROP TABLE IF EXISTS gpu_latest_mv;

RENAME TABLE gpu_samples TO gpu_samples_012;

CREATE TABLE gpu_samples
(
    node LowCardinality(String),
    rack LowCardinality(String),
    gpu UInt16,
    ts DateTime64(3, 'UTC') CODEC(Delta, ZSTD(1)),
    model LowCardinality(String),
    uuid String CODEC(ZSTD(3)),
    received DateTime('UTC') DEFAULT now() CODEC(Delta, ZSTD(1)) COMMENT 'when the row was stored (retention)',
    nic_util_pm UInt16 DEFAULT 65535 CODEC(ZSTD(3)) COMMENT 'node NIC utilisation, 1e-3 (65535 = not reported)',
    temp_dc Int16 DEFAULT -32768 CODEC(T64, ZSTD(3)) COMMENT 'GPU core temperature, 0.1 °C (-32768 = not reported)',
    mem_temp_dc Int16 DEFAULT -32768 CODEC(T64, ZSTD(3)) COMMENT 'HBM temperature, 0.1 °C (-32768 = not reported)',
    power_dw UInt32 DEFAULT 4294967295 CODEC(T64, ZSTD(3)) COMMENT 'power draw, 0.1 W (4294967295 = not reported)',
    power_limit_w Float32 DEFAULT nan CODEC(Gorilla, ZSTD(1)) COMMENT 'enforced power limit, W',
    sm_clock_mhz Float32 DEFAULT nan CODEC(Gorilla, ZSTD(1)) COMMENT 'SM clock, MHz',
    sm_clock_max_mhz Float32 DEFAULT nan CODEC(Gorilla, ZSTD(1)) COMMENT 'maximum SM clock, MHz',
    mem_clock_mhz Float32 DEFAULT nan CODEC(Gorilla, ZSTD(1)) COMMENT 'memory clock, MHz',
    clock_reasons Float64 DEFAULT nan CODEC(Gorilla, ZSTD(1)) COMMENT 'clock-event reason bitmask (ClockReason)',
    util_pct_i UInt8 DEFAULT 255 CODEC(ZSTD(3)) COMMENT 'GPU utilisation, whole % (255 = not reported)',
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
    energy_j UInt64 DEFAULT 18446744073709551615 CODEC(Delta, ZSTD(3)) COMMENT 'energy consumed since the driver loaded, J (18446744073709551615 = not reported)',
    tensor_active_pm UInt16 DEFAULT 65535 CODEC(T64, ZSTD(3)) COMMENT 'share of cycles the tensor pipes were active, 1e-3 (65535 = not reported)',
    slowdown_temp_c Float32 DEFAULT nan CODEC(Gorilla, ZSTD(1)) COMMENT 'the GPU''s own slowdown temperature, °C: above it the GPU throttles itself (NaN: not reported)',
    nic_util Float64 ALIAS if(nic_util_pm = 65535, nan, nic_util_pm / 1000) COMMENT 'node NIC utilisation in [0, 1]; NaN = not reported',
    temp_c Float64 ALIAS if(temp_dc = -32768, nan, temp_dc / 10) COMMENT 'GPU core temperature, °C',
    mem_temp_c Float64 ALIAS if(mem_temp_dc = -32768, nan, mem_temp_dc / 10) COMMENT 'HBM temperature, °C',
    power_w Float64 ALIAS if(power_dw = 4294967295, nan, power_dw / 10) COMMENT 'power draw, W',
    util_pct Float64 ALIAS if(util_pct_i = 255, nan, toFloat64(util_pct_i)) COMMENT 'GPU utilisation, %',
    energy_mj Float64 ALIAS if(energy_j = 18446744073709551615, nan, toFloat64(energy_j) * 1000) COMMENT 'energy consumed since the driver loaded, mJ',
    tensor_active Float64 ALIAS if(tensor_active_pm = 65535, nan, tensor_active_pm / 1000) COMMENT 'share of cycles the tensor pipes were active, 0-1'
)
ENGINE = ReplacingMergeTree
PARTITION BY toDate(ts)
ORDER BY (node, gpu, ts)
TTL received + INTERVAL 14 DAY
SETTINGS non_replicated_deduplication_window = 1000, ttl_only_drop_parts = 1;

INSERT INTO gpu_samples (node, rack, gpu, ts, model, uuid, received, nic_util_pm, temp_dc, mem_temp_dc, power_dw, power_limit_w, sm_clock_mhz, sm_clock_max_mhz, mem_clock_mhz, clock_reasons, util_pct_i, ecc_sbe_volatile, ecc_dbe_volatile, ecc_sbe_aggregate, ecc_dbe_aggregate, retired_sbe, retired_dbe, retired_pending, remap_correctable, remap_uncorrectable, remap_pending, remap_failure, nvlink_links_up, nvlink_links_max, nvlink_crc_flit, nvlink_crc_data, nvlink_replay, nvlink_recovery, pcie_replay, pcie_gen, pcie_gen_max, pcie_width, pcie_width_max, fb_used_mib, fb_free_mib, energy_j, tensor_active_pm, slowdown_temp_c)
SELECT node, rack, gpu, ts, model, uuid, received, if(isFinite(nic_util), toUInt16(round(nic_util * 1000)), 65535), if(isFinite(temp_c), toInt16(round(temp_c * 10)), -32768), if(isFinite(mem_temp_c), toInt16(round(mem_temp_c * 10)), -32768), if(isFinite(power_w), toUInt32(round(power_w * 10)), 4294967295), power_limit_w, sm_clock_mhz, sm_clock_max_mhz, mem_clock_mhz, clock_reasons, if(isFinite(util_pct), toUInt8(round(util_pct * 1)), 255), ecc_sbe_volatile, ecc_dbe_volatile, ecc_sbe_aggregate, ecc_dbe_aggregate, retired_sbe, retired_dbe, retired_pending, remap_correctable, remap_uncorrectable, remap_pending, remap_failure, nvlink_links_up, nvlink_links_max, nvlink_crc_flit, nvlink_crc_data, nvlink_replay, nvlink_recovery, pcie_replay, pcie_gen, pcie_gen_max, pcie_width, pcie_width_max, fb_used_mib, fb_free_mib, if(isFinite(energy_mj), toUInt64(round(energy_mj / 1000)), 18446744073709551615), if(isFinite(tensor_active), toUInt16(round(tensor_active * 1000)), 65535), slowdown_temp_c
FROM gpu_samples_012
SETTINGS max_partitions_per_insert_block = 0;

DROP TABLE gpu_samples_012;

ALTER TABLE gpu_samples_1m MODIFY SETTING non_replicated_deduplication_window = 1000;

CREATE TABLE IF NOT EXISTS gpu_samples_1h
(
    node LowCardinality(String),
    gpu UInt16,
    hour DateTime('UTC') CODEC(Delta, ZSTD(1)),
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
    clock_reasons_or SimpleAggregateFunction(groupBitOr, UInt64) COMMENT 'OR of the hour''s clock-event reasons',
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
PARTITION BY toYYYYMM(hour)
ORDER BY (node, gpu, hour)
TTL received + INTERVAL 400 DAY
SETTINGS non_replicated_deduplication_window = 1000;

CREATE TABLE IF NOT EXISTS gpu_samples_rack_1m
(
    rack LowCardinality(String),
    minute DateTime('UTC') CODEC(Delta, ZSTD(1)),
    samples SimpleAggregateFunction(sum, UInt64),
    received SimpleAggregateFunction(max, DateTime('UTC')),
    temp_c_min SimpleAggregateFunction(min, Nullable(Float32)),
    temp_c_max SimpleAggregateFunction(max, Nullable(Float32)),
    temp_c_avg AggregateFunction(avg, Nullable(Float32)),
    temp_c_q AggregateFunction(quantilesBFloat16(0.5, 0.9, 0.99), Nullable(Float32)),
    mem_temp_c_max SimpleAggregateFunction(max, Nullable(Float32)),
    power_w_max SimpleAggregateFunction(max, Nullable(Float32)),
    power_w_avg AggregateFunction(avg, Nullable(Float32)),
    util_pct_avg AggregateFunction(avg, Nullable(Float32)),
    clock_reasons_or SimpleAggregateFunction(groupBitOr, UInt64) COMMENT 'OR of the rack''s clock-event reasons in the minute'
)
ENGINE = AggregatingMergeTree
PARTITION BY toYYYYMM(minute)
ORDER BY (rack, minute)
TTL received + INTERVAL 90 DAY
SETTINGS non_replicated_deduplication_window = 1000;

INSERT INTO gpu_samples_1h (node, gpu, hour, rack, samples, received, temp_c_min, temp_c_max, temp_c_avg, temp_c_q, power_w_min, power_w_max, power_w_avg, power_w_q, sm_clock_mhz_min, sm_clock_mhz_max, sm_clock_mhz_avg, sm_clock_mhz_q, util_pct_min, util_pct_max, util_pct_avg, util_pct_q, mem_temp_c_max, clock_reasons_or, ecc_sbe_volatile_max, ecc_dbe_volatile_max, ecc_sbe_aggregate_max, ecc_dbe_aggregate_max, retired_sbe_max, retired_dbe_max, remap_correctable_max, remap_uncorrectable_max, nvlink_crc_flit_max, nvlink_crc_data_max, nvlink_replay_max, nvlink_recovery_max, pcie_replay_max, energy_mj_max)
SELECT
    node,
    gpu,
    toStartOfHour(minute) AS hour,
    anyLast(rack) AS rack,
    sum(samples) AS samples,
    max(received) AS received,
    min(temp_c_min) AS temp_c_min,
    max(temp_c_max) AS temp_c_max,
    avgMergeState(temp_c_avg) AS temp_c_avg,
    quantilesBFloat16MergeState(0.5, 0.9, 0.99)(temp_c_q) AS temp_c_q,
    min(power_w_min) AS power_w_min,
    max(power_w_max) AS power_w_max,
    avgMergeState(power_w_avg) AS power_w_avg,
    quantilesBFloat16MergeState(0.5, 0.9, 0.99)(power_w_q) AS power_w_q,
    min(sm_clock_mhz_min) AS sm_clock_mhz_min,
    max(sm_clock_mhz_max) AS sm_clock_mhz_max,
    avgMergeState(sm_clock_mhz_avg) AS sm_clock_mhz_avg,
    quantilesBFloat16MergeState(0.5, 0.9, 0.99)(sm_clock_mhz_q) AS sm_clock_mhz_q,
    min(util_pct_min) AS util_pct_min,
    max(util_pct_max) AS util_pct_max,
    avgMergeState(util_pct_avg) AS util_pct_avg,
    quantilesBFloat16MergeState(0.5, 0.9, 0.99)(util_pct_q) AS util_pct_q,
    max(mem_temp_c_max) AS mem_temp_c_max,
    groupBitOr(clock_reasons_or) AS clock_reasons_or,
    max(ecc_sbe_volatile_max) AS ecc_sbe_volatile_max,
    max(ecc_dbe_volatile_max) AS ecc_dbe_volatile_max,
    max(ecc_sbe_aggregate_max) AS ecc_sbe_aggregate_max,
    max(ecc_dbe_aggregate_max) AS ecc_dbe_aggregate_max,
    max(retired_sbe_max) AS retired_sbe_max,
    max(retired_dbe_max) AS retired_dbe_max,
    max(remap_correctable_max) AS remap_correctable_max,
    max(remap_uncorrectable_max) AS remap_uncorrectable_max,
    max(nvlink_crc_flit_max) AS nvlink_crc_flit_max,
    max(nvlink_crc_data_max) AS nvlink_crc_data_max,
    max(nvlink_replay_max) AS nvlink_replay_max,
    max(nvlink_recovery_max) AS nvlink_recovery_max,
    max(pcie_replay_max) AS pcie_replay_max,
    max(energy_mj_max) AS energy_mj_max
FROM gpu_samples_1m
GROUP BY node, gpu, hour;

INSERT INTO gpu_samples_rack_1m (rack, minute, samples, received, temp_c_min, temp_c_max, temp_c_avg, temp_c_q, mem_temp_c_max, power_w_max, power_w_avg, util_pct_avg, clock_reasons_or)
SELECT
    rack,
    minute,
    sum(samples) AS samples,
    max(received) AS received,
    min(temp_c_min) AS temp_c_min,
    max(temp_c_max) AS temp_c_max,
    avgMergeState(temp_c_avg) AS temp_c_avg,
    quantilesBFloat16MergeState(0.5, 0.9, 0.99)(temp_c_q) AS temp_c_q,
    max(mem_temp_c_max) AS mem_temp_c_max,
    max(power_w_max) AS power_w_max,
    avgMergeState(power_w_avg) AS power_w_avg,
    avgMergeState(util_pct_avg) AS util_pct_avg,
    groupBitOr(clock_reasons_or) AS clock_reasons_or
FROM gpu_samples_1m
GROUP BY rack, minute;

CREATE MATERIALIZED VIEW IF NOT EXISTS gpu_samples_1h_mv TO gpu_samples_1h AS
SELECT
    node,
    gpu,
    toStartOfHour(minute) AS hour,
    anyLast(rack) AS rack,
    sum(samples) AS samples,
    max(received) AS received,
    min(temp_c_min) AS temp_c_min,
    max(temp_c_max) AS temp_c_max,
    avgMergeState(temp_c_avg) AS temp_c_avg,
    quantilesBFloat16MergeState(0.5, 0.9, 0.99)(temp_c_q) AS temp_c_q,
    min(power_w_min) AS power_w_min,
    max(power_w_max) AS power_w_max,
    avgMergeState(power_w_avg) AS power_w_avg,
    quantilesBFloat16MergeState(0.5, 0.9, 0.99)(power_w_q) AS power_w_q,
    min(sm_clock_mhz_min) AS sm_clock_mhz_min,
    max(sm_clock_mhz_max) AS sm_clock_mhz_max,
    avgMergeState(sm_clock_mhz_avg) AS sm_clock_mhz_avg,
    quantilesBFloat16MergeState(0.5, 0.9, 0.99)(sm_clock_mhz_q) AS sm_clock_mhz_q,
    min(util_pct_min) AS util_pct_min,
    max(util_pct_max) AS util_pct_max,
    avgMergeState(util_pct_avg) AS util_pct_avg,
    quantilesBFloat16MergeState(0.5, 0.9, 0.99)(util_pct_q) AS util_pct_q,
    max(mem_temp_c_max) AS mem_temp_c_max,
    groupBitOr(clock_reasons_or) AS clock_reasons_or,
    max(ecc_sbe_volatile_max) AS ecc_sbe_volatile_max,
    max(ecc_dbe_volatile_max) AS ecc_dbe_volatile_max,
    max(ecc_sbe_aggregate_max) AS ecc_sbe_aggregate_max,
    max(ecc_dbe_aggregate_max) AS ecc_dbe_aggregate_max,
    max(retired_sbe_max) AS retired_sbe_max,
    max(retired_dbe_max) AS retired_dbe_max,
    max(remap_correctable_max) AS remap_correctable_max,
    max(remap_uncorrectable_max) AS remap_uncorrectable_max,
    max(nvlink_crc_flit_max) AS nvlink_crc_flit_max,
    max(nvlink_crc_data_max) AS nvlink_crc_data_max,
    max(nvlink_replay_max) AS nvlink_replay_max,
    max(nvlink_recovery_max) AS nvlink_recovery_max,
    max(pcie_replay_max) AS pcie_replay_max,
    max(energy_mj_max) AS energy_mj_max
FROM gpu_samples_1m
GROUP BY node, gpu, hour;

CREATE MATERIALIZED VIEW IF NOT EXISTS gpu_samples_rack_1m_mv TO gpu_samples_rack_1m AS
SELECT
    rack,
    minute,
    sum(samples) AS samples,
    max(received) AS received,
    min(temp_c_min) AS temp_c_min,
    max(temp_c_max) AS temp_c_max,
    avgMergeState(temp_c_avg) AS temp_c_avg,
    quantilesBFloat16MergeState(0.5, 0.9, 0.99)(temp_c_q) AS temp_c_q,
    max(mem_temp_c_max) AS mem_temp_c_max,
    max(power_w_max) AS power_w_max,
    avgMergeState(power_w_avg) AS power_w_avg,
    avgMergeState(util_pct_avg) AS util_pct_avg,
    groupBitOr(clock_reasons_or) AS clock_reasons_or
FROM gpu_samples_1m
GROUP BY rack, minute;

CREATE MATERIALIZED VIEW IF NOT EXISTS gpu_samples_1m_mv TO gpu_samples_1m AS
SELECT
    node,
    gpu,
    toStartOfMinute(ts) AS minute,
    anyLast(rack) AS rack,
    count() AS samples,
    max(received) AS received,
    min(if(isNaN(temp_c), NULL, toFloat32(temp_c))) AS temp_c_min,
    max(if(isNaN(temp_c), NULL, toFloat32(temp_c))) AS temp_c_max,
    avgState(if(isNaN(temp_c), NULL, toFloat32(temp_c))) AS temp_c_avg,
    quantilesBFloat16State(0.5, 0.9, 0.99)(if(isNaN(temp_c), NULL, toFloat32(temp_c))) AS temp_c_q,
    min(if(isNaN(power_w), NULL, toFloat32(power_w))) AS power_w_min,
    max(if(isNaN(power_w), NULL, toFloat32(power_w))) AS power_w_max,
    avgState(if(isNaN(power_w), NULL, toFloat32(power_w))) AS power_w_avg,
    quantilesBFloat16State(0.5, 0.9, 0.99)(if(isNaN(power_w), NULL, toFloat32(power_w))) AS power_w_q,
    min(if(isNaN(sm_clock_mhz), NULL, sm_clock_mhz)) AS sm_clock_mhz_min,
    max(if(isNaN(sm_clock_mhz), NULL, sm_clock_mhz)) AS sm_clock_mhz_max,
    avgState(if(isNaN(sm_clock_mhz), NULL, sm_clock_mhz)) AS sm_clock_mhz_avg,
    quantilesBFloat16State(0.5, 0.9, 0.99)(if(isNaN(sm_clock_mhz), NULL, sm_clock_mhz)) AS sm_clock_mhz_q,
    min(if(isNaN(util_pct), NULL, toFloat32(util_pct))) AS util_pct_min,
    max(if(isNaN(util_pct), NULL, toFloat32(util_pct))) AS util_pct_max,
    avgState(if(isNaN(util_pct), NULL, toFloat32(util_pct))) AS util_pct_avg,
    quantilesBFloat16State(0.5, 0.9, 0.99)(if(isNaN(util_pct), NULL, toFloat32(util_pct))) AS util_pct_q,
    max(if(isNaN(mem_temp_c), NULL, toFloat32(mem_temp_c))) AS mem_temp_c_max,
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

CREATE MATERIALIZED VIEW IF NOT EXISTS gpu_latest_mv TO gpu_latest AS
SELECT node, gpu, latest AS ts, rack, received, temp_c, power_w, sm_clock_mhz, util_pct, clock_reasons,
       ecc_dbe_volatile, nvlink_links_up
FROM
(
    SELECT
        node,
        gpu,
        max(ts) AS latest,
        argMax(rack, ts) AS rack,
        max(received) AS received,
        argMax(temp_c, ts) AS temp_c,
        argMax(power_w, ts) AS power_w,
        argMax(sm_clock_mhz, ts) AS sm_clock_mhz,
        argMax(util_pct, ts) AS util_pct,
        argMax(clock_reasons, ts) AS clock_reasons,
        argMax(ecc_dbe_volatile, ts) AS ecc_dbe_volatile,
        argMax(nvlink_links_up, ts) AS nvlink_links_up
    FROM gpu_samples
    GROUP BY node, gpu
);
