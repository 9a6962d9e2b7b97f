-- Each job's step times without scanning its rank-steps: what goodput is computed from.
--
-- The goodput of a job (GET /v1/runs/{job}/health, the report's waterfall; fleethealth/policy/goodput.py)
-- takes each step's time, the slowest rank's compute time, and the step's end, the latest rank's
-- event time (store/queries/api.py job_step_times). Read from rank_steps that groups every
-- rank-step of the job: 1.4 * 10^9 rows a day for a 16,384-rank job at one step a second. job_steps
-- holds one row per (job, step) once merged:
--
-- * job_steps_mv reduces every insert block of rank_steps to each (job, step)'s max compute time,
--   latest event time and rank count; AggregatingMergeTree keeps max, max and sum on merge, and the
--   named query reads them with max again, so the answer is the raw scan's merged or not. A replayed
--   insert changes neither max (the rank count, kept for inspection, counts it twice unless its
--   deduplication token drops it: the table has a deduplication window, as gpu_samples' rollups).
-- * Sorted by job first: in a cluster it shards with rank_steps.
-- * Rows expire 90 days after they were last written (received), as the other rollups do.
-- * Existing stores are backfilled from rank_steps once the view runs (a row written in between is
--   in both, which max folds to one).

CREATE TABLE IF NOT EXISTS job_steps
(
    job LowCardinality(String),
    step UInt64 CODEC(DoubleDelta, ZSTD(1)),
    step_s SimpleAggregateFunction(max, Float64) COMMENT 'the slowest rank''s compute time, s',
    end_ts SimpleAggregateFunction(max, DateTime64(3, 'UTC')) COMMENT 'the latest rank''s event time',
    ranks SimpleAggregateFunction(sum, UInt64) COMMENT 'rank-steps rolled up (a replay with a new token counts again)',
    received SimpleAggregateFunction(max, DateTime('UTC')) COMMENT 'when a row of the step was last stored (retention)'
)
ENGINE = AggregatingMergeTree
ORDER BY (job, step)
TTL received + INTERVAL 90 DAY
SETTINGS non_replicated_deduplication_window = 1000;

CREATE MATERIALIZED VIEW IF NOT EXISTS job_steps_mv TO job_steps AS
SELECT job, step, max(compute_s) AS step_s, max(ts) AS end_ts, count() AS ranks, toDateTime(now(), 'UTC') AS received
FROM rank_steps
GROUP BY job, step;

INSERT INTO job_steps (job, step, step_s, end_ts, ranks, received)
SELECT job, step, max(compute_s) AS step_s, max(ts) AS end_ts, count() AS ranks, toDateTime(now(), 'UTC') AS received
FROM rank_steps FINAL
GROUP BY job, step;
