"""Typed errors of fleethealth, translated at the boundary from third-party exceptions.

::

    FleetHealthError                 every error this package raises on purpose
    ├── SchemaError                  a message or file does not match its contract (names the field)
    ├── ConfigError                  a bad scenario, flag or DSN (names the cause)
    ├── BusError                     Kafka
    │   └── BusUnavailable           the broker cannot be reached or will not start
    ├── StoreError                   ClickHouse / chDB
    │   ├── StoreUnavailable         the store cannot be reached (a connection error, a timeout): retry
    │   │   └── StoreFull            the store's volume is full (ENOSPC, NOT_ENOUGH_SPACE): retry once freed
    │   ├── StoreLocked              a chDB path already owned by another process
    │   ├── MigrationLocked          another migrator holds the store's migration lock (names it)
    │   └── MigrationsPending        the store lacks migrations a command needs (names them)
    └── DeviceError                  a GPU, NVML or DCGM that is missing or not answering

The CLI prints ``str(error)`` as one line and exits non-zero; no traceback for these.
"""

from __future__ import annotations

__all__ = [
    "FleetHealthError",
    "SchemaError",
    "ConfigError",
    "BusError",
    "BusUnavailable",
    "StoreError",
    "StoreUnavailable",
    "StoreFull",
    "StoreLocked",
    "MigrationLocked",
    "MigrationsPending",
    "DeviceError",
]


class FleetHealthError(Exception):
    """Base of every error fleethealth raises on purpose."""


class SchemaError(FleetHealthError, ValueError):
    """A message does not match its schema. ``field`` names the offending field."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")


class ConfigError(FleetHealthError, ValueError):
    """A scenario, flag or DSN is wrong."""


class BusError(FleetHealthError):
    """The message bus failed."""


class BusUnavailable(BusError):
    """The broker cannot be reached, or the embedded broker would not start."""


class StoreError(FleetHealthError):
    """The store failed to run a statement."""


class StoreUnavailable(StoreError):
    """The store cannot be reached (connection refused or reset, a timeout): the statement itself
    may be fine, so a caller retries it."""


class StoreLocked(StoreError):
    """A chDB data path is already opened by another process."""


class DeviceError(FleetHealthError):
    """A GPU, NVML or DCGM is missing or does not answer."""


class MigrationLocked(StoreError):
    """Another migrator holds the store's migration lock; the message names it and its expiry."""


class MigrationsPending(StoreError):
    """The store's schema is behind this release (pending, half-applied or changed migrations)."""


class StoreFull(StoreUnavailable):
    """The store's volume is out of space: nothing is wrong with the rows, so a writer waits and
    writes them again once space returns (never dead-letters them)."""
