"""Fixtures for the detector tier's tests.

``own_broker``: a Tansu broker of the test's own, with the topics made, for tests that must not
share offsets or consumer groups with others (a module sets ``OWN_BROKER_PARTITIONS``, default 2).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fleethealth.broker import EmbeddedBroker
from fleethealth.bus import ensure_topics


@pytest.fixture
def own_broker(request: pytest.FixtureRequest) -> Iterator[EmbeddedBroker]:
    with EmbeddedBroker() as running:
        ensure_topics(running.dsn, partitions=getattr(request.module, "OWN_BROKER_PARTITIONS", 2))
        yield running
