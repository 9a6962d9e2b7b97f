-- Detector snapshots: a stream stage's detector state per input partition, with the input offsets it
-- reflects, so a restarted replica or the one that gets the partition after a rebalance restores it
-- and replays the input only from those offsets.
--
-- * One row per (consumer_group, partition) once merged: ReplacingMergeTree(seq) keeps the greatest
--   seq, and the named query reads it with FINAL (store.load_snapshot), so an older snapshot written
--   after a newer one never replaces it.
-- * blob is the snapshot as fleethealth.detectors.snapshot writes it (header, sha256, zlib body):
--   arbitrary bytes, already compressed, so it is stored without a codec. It is written as the raw
--   bytes and read back through base64Encode: a String column holds any bytes, but a client reading
--   it as text would decode it as UTF-8.
-- * offsets repeats the blob's offsets as JSON ([[topic, partition, next offset], ...]) to be read
--   without the blob; ts is the event time the state reflects, taken the wall time it was stored;
--   bytes the blob's length.
-- * Not sharded by partition: a group's snapshots are few (one row per input partition) and share a
--   shard in the cluster form.

CREATE TABLE IF NOT EXISTS detector_snapshots
(
    consumer_group LowCardinality(String) COMMENT 'the Kafka consumer group of the stage',
    partition UInt32 COMMENT 'the input partition whose state this is',
    seq UInt64 COMMENT 'the version: the greatest is kept',
    ts DateTime64(3, 'UTC') COMMENT 'event time the state reflects',
    taken DateTime64(3, 'UTC') DEFAULT now64(3) COMMENT 'wall time it was stored',
    offsets String COMMENT 'JSON [[topic, partition, next offset], ...]',
    bytes UInt64 MATERIALIZED length(blob) COMMENT 'size of blob',
    blob String CODEC(NONE) COMMENT 'the snapshot (fleethealth.detectors.snapshot)'
)
ENGINE = ReplacingMergeTree(seq)
ORDER BY (consumer_group, partition);
