-- The latest sample of each GPU, kept apart from the raw samples.
--
-- The API's fleet view (node_summaries) and a node's GPU list (node_gpu_latest) want each GPU's
-- latest sample. Read from gpu_samples they scan every retained raw row: 1.2 * 10^11 rows for
-- 100k GPUs kept 14 days. gpu_latest holds one row per (node, gpu) once merged:
--
-- * gpu_latest_mv reduces every insert block to its latest sample per GPU (argMax by ts) and
--   writes it here; ReplacingMergeTree(ts) keeps the row with the greatest ts on merge, so a
--   sample that arrives out of order (older than one already stored) never replaces a newer one.
--   Before a merge a GPU may have several rows: the named queries read them with argMax(..., ts)
--   again, which gives the same answer merged or not.
-- * Only the columns those queries show are kept (rack, ts and seven health fields).
-- * Rows expire RAW_RETENTION days after they were received, like the raw samples they stand for
--   (a store DSN's ?raw_retention_days=N sets both; fleethealth/store/migrations.py). A TTL merge
--   drops the expired rows (the table is small: whole parts are not waited for).
-- * Existing stores are backfilled from gpu_samples once the view runs (a row written in between
--   is in both, which argMax and the replacing merge fold to one).

CREATE TABLE IF NOT EXISTS gpu_latest
(
    node LowCardinality(String),
    gpu UInt16,
    ts DateTime64(3, 'UTC') COMMENT 'event time of the latest sample (the version: the greatest is kept)',
    rack LowCardinality(String),
    received DateTime('UTC') COMMENT 'when the sample was stored (retention)',
    temp_c Float32 COMMENT 'GPU core temperature, °C',
    power_w Float32 COMMENT 'power draw, W',
    sm_clock_mhz Float32 COMMENT 'SM clock, MHz',
    util_pct Float32 COMMENT 'GPU utilisation, %',
    clock_reasons Float64 COMMENT 'clock-event reason bitmask (ClockReason)',
    ecc_dbe_volatile Float64 COMMENT 'uncorrected ECC errors since driver load',
    nvlink_links_up Float32 COMMENT 'NVLink links active'
)
ENGINE = ReplacingMergeTree(ts)
ORDER BY (node, gpu)
TTL received + INTERVAL 14 DAY;

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

INSERT INTO gpu_latest (node, gpu, ts, rack, received, temp_c, power_w, sm_clock_mhz, util_pct, clock_reasons,
                        ecc_dbe_volatile, nvlink_links_up)
SELECT node, gpu, latest, rack, received, temp_c, power_w, sm_clock_mhz, util_pct, clock_reasons, ecc_dbe_volatile,
       nvlink_links_up
FROM
(
    SELECT node, gpu, max(ts) AS latest, argMax(rack, ts) AS rack, max(received) AS received,
           argMax(temp_c, ts) AS temp_c, argMax(power_w, ts) AS power_w, argMax(sm_clock_mhz, ts) AS sm_clock_mhz,
           argMax(util_pct, ts) AS util_pct, argMax(clock_reasons, ts) AS clock_reasons,
           argMax(ecc_dbe_volatile, ts) AS ecc_dbe_volatile, argMax(nvlink_links_up, ts) AS nvlink_links_up
    FROM gpu_samples
    GROUP BY node, gpu
);
