-- Where each job ran, hour by hour: the checkpoint interval's exposure without scanning rank_steps.
--
-- The checkpoint interval (fleethealth/policy/interval.py, GET /v1/runs/{job}/health) needs every
-- job's node count and the span of its steps over a window of days, to scale the fleet's failure
-- rate per node to a job's size. Read from rank_steps that is every rank-step of the window:
-- 10^11 rows a week at 16,384 ranks and 10 steps/s. job_node_hours holds one row per (job, node,
-- hour) once merged:
--
-- * job_node_hours_mv reduces every insert block of rank_steps to the first and last step time of
--   each (job, node, hour); AggregatingMergeTree keeps min(lo) and max(hi) on merge, and the named
--   query (store/queries.py job_spans) reads them with min and max again, so the answer is the same
--   merged or not. A replayed insert changes neither.
-- * Sorted by job first: in a cluster it shards with rank_steps, so each shard rolls up its own rows.
-- * Rows expire 90 days after they were last written (received, the arrival time, not event time:
--   a replayed or simulated timeline from months ago is kept like a live one), as the 1-minute
--   telemetry rollup does.
-- * Existing stores are backfilled from rank_steps once the view runs (a row written in between is
--   in both, which min and max fold to one).

CREATE TABLE IF NOT EXISTS job_node_hours
(
    job LowCardinality(String),
    node LowCardinality(String),
    hour DateTime('UTC') COMMENT 'the hour of event time the row covers',
    lo SimpleAggregateFunction(min, DateTime64(3, 'UTC')) COMMENT 'first step time of the job on the node in the hour',
    hi SimpleAggregateFunction(max, DateTime64(3, 'UTC')) COMMENT 'last step time of the job on the node in the hour',
    received SimpleAggregateFunction(max, DateTime('UTC')) COMMENT 'when a row of the hour was last stored (retention)'
)
ENGINE = AggregatingMergeTree
ORDER BY (job, node, hour)
TTL received + INTERVAL 90 DAY;

CREATE MATERIALIZED VIEW IF NOT EXISTS job_node_hours_mv TO job_node_hours AS
SELECT job, node, toStartOfHour(ts) AS hour, min(ts) AS lo, max(ts) AS hi, toDateTime(now(), 'UTC') AS received
FROM rank_steps
GROUP BY job, node, hour;

INSERT INTO job_node_hours (job, node, hour, lo, hi, received)
SELECT job, node, toStartOfHour(ts) AS hour, min(ts) AS lo, max(ts) AS hi, toDateTime(now(), 'UTC') AS received
FROM rank_steps
GROUP BY job, node, hour;
