"""The message bus: a producer and a consumer over Kafka, chosen from a DSN."""

from fleethealth.bus.consumer import *  # noqa: F403
from fleethealth.bus.consumer import (  # noqa: F401
    DEADLETTER_RAW_BYTES,
    DEADLETTER_REASON_CHARS,
    SNAPSHOT_MAX_BYTES,
    TOPIC_CONFIGS,
    __all__,
)
