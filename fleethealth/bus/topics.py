"""The admin side: creating the ``fh.*`` topics with the settings some of them need."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from fleethealth.bus.dsn import _backend
from fleethealth.bus.kafka_client import translated
from fleethealth.bus.snapshots import SNAPSHOT_MAX_BYTES
from fleethealth.errors import ConfigError
from fleethealth.schema import Topic

TOPIC_CONFIGS: dict[str, dict[str, str]] = {
    Topic.NODESTATE.value: {"cleanup.policy": "compact"},
    Topic.SNAPSHOTS.value: {"cleanup.policy": "compact", "max.message.bytes": str(SNAPSHOT_MAX_BYTES)},
}
"""Topic settings beyond the broker's defaults: ``fh.nodestate`` is a table (each node's newest state),
``fh.snapshots`` too (each partition's newest snapshot), with records up to :data:`SNAPSHOT_MAX_BYTES`."""


def ensure_topics(dsn: str, partitions: int = 4, *, replication: int = 1,
                  topics: Sequence[str] | None = None, connect_timeout_s: float = 10.0) -> None:
    """Create every :class:`schema.Topic` (or ``topics``); topics that exist are left as they are."""
    if partitions < 1 or replication < 1:
        raise ConfigError(f"partitions and replication must be >= 1, got {partitions}, {replication}")
    backend = _backend(dsn)
    import kafka.errors as ke
    from kafka.admin import NewTopic

    with translated("connecting the admin client", dsn):
        admin = backend.admin("fleethealth-admin", int(connect_timeout_s * 1000))
    try:
        for topic in topics or [t.value for t in Topic]:
            configs = TOPIC_CONFIGS.get(str(topic), {})
            with translated(f"creating topic {topic}", dsn), contextlib.suppress(ke.TopicAlreadyExistsError):
                admin.create_topics([NewTopic(str(topic), partitions, replication, topic_configs=configs)])
    finally:
        admin.close()
