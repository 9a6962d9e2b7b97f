"""Backends chosen from a DSN: a registry maps the scheme to a factory ``dsn -> Store``.

::

    chdb:///var/lib/fleethealth    embedded chDB (ClickHouse's engine in-process)
    http://clickhouse:8123/db      a ClickHouse server (https:// likewise)

Two DSN options are the store's own, taken off the DSN before the client sees it:
``cluster=NAME`` (a server only: migrations run in their cluster form, :mod:`fleethealth.store.cluster`)
and ``raw_retention_days=N`` (raw samples, the latest-sample table and rank-steps kept N days after
arrival; default 14).

Each factory imports clickhouse-connect lazily, so ``import fleethealth.store`` stays light; an
unknown scheme raises :class:`ConfigError` listing the known ones.

chDB allows ONE open data path per process at a time: a second store on the same path shares the
engine, a store on a different path fails with :class:`StoreError` until every store on the first
path is closed. Another process holding the path gives :class:`StoreLocked` (it holds the lock on
the path's ``status`` file).
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Callable
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit

from fleethealth.errors import ConfigError, StoreError, StoreLocked
from fleethealth.store.client import Store
from fleethealth.store.translate import first_line, redact

__all__ = ["open_store", "register_backend", "known_schemes", "CHDB_SERVER_SETTINGS", "CHDB_JEMALLOC"]

CHDB_SERVER_SETTINGS = {
    "mark_cache_size": 64 * 1024**2,
    "primary_index_cache_size": 64 * 1024**2,
    "index_mark_cache_size": 16 * 1024**2,
    "uncompressed_cache_size": 0,
}
"""The embedded engine's caches, bounded (ClickHouse's defaults are sized for a server of its own:
5 GiB each for marks, primary indexes and skip-index marks). They are server settings, fixed when
the engine starts: every handle in the process passes the same ones."""

CHDB_JEMALLOC = "dirty_decay_ms:1000,muzzy_decay_ms:0,prof:false"
"""The engine's allocator (its own jemalloc, configured by ``JE_MALLOC_CONF`` when chDB loads):
freed pages go back to the system after 1 s instead of 5 s, and allocation profiling is off. Under
a steady stream the engine's resident memory was two to four times what it had allocated with
ClickHouse's defaults (``bench/soak.py`` prints both). An operator's own ``JE_MALLOC_CONF`` wins."""

_CHDB_LOCK = threading.Lock()
_CHDB_OPEN: dict[str, int] = {}
"""chDB data paths opened by this process, with the number of open stores on each."""


def _chdb_path(dsn: str) -> str:
    parts = urlsplit(dsn)
    path = parts.netloc + parts.path
    if not path:
        raise ConfigError(f"store DSN {dsn!r} names no data path (chdb:///absolute/path)")
    return str(Path(path).expanduser().resolve())


def _locked_by_other_process(path: str) -> bool:
    """True when another process holds the ClickHouse status-file lock of ``path``."""
    status = Path(path) / "status"
    try:
        fd = os.open(status, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _release_chdb(path: str) -> None:
    with _CHDB_LOCK:
        left = _CHDB_OPEN.get(path, 1) - 1
        if left > 0:
            _CHDB_OPEN[path] = left
        else:
            _CHDB_OPEN.pop(path, None)


def _open_chdb(dsn: str) -> Store:
    path = _chdb_path(dsn)
    os.environ.setdefault("JE_MALLOC_CONF", CHDB_JEMALLOC)  # read once, when chDB's library loads
    try:
        import clickhouse_connect
    except ImportError as exc:
        raise ConfigError("the chdb:// store needs clickhouse-connect and chdb: install fleethealth[embedded]") \
            from exc
    with _CHDB_LOCK:
        others = [p for p, count in _CHDB_OPEN.items() if count and p != path]
        if others:
            raise StoreError(f"chDB allows one open data path per process: {others[0]} is open here; "
                             f"close that store before opening {path}")
        if not _CHDB_OPEN.get(path) and _locked_by_other_process(path):
            raise StoreLocked(f"chDB data path {path} is in use by another process (only one process can "
                              f"open it; stop that process or query through it)")
        Path(path).mkdir(parents=True, exist_ok=True)
        try:
            client = clickhouse_connect.get_client(dsn=f"chdb://{path}", chdb_options=CHDB_SERVER_SETTINGS)
        except Exception as exc:
            if _locked_by_other_process(path):
                raise StoreLocked(f"chDB data path {path} is in use by another process") from exc
            raise StoreError(f"cannot open chDB at {path}: {first_line(exc)}") from exc
        _CHDB_OPEN[path] = _CHDB_OPEN.get(path, 0) + 1
    return Store(client, dsn, chdb_path=path, on_close=lambda: _release_chdb(path))


def _open_http(dsn: str) -> Store:
    try:
        import clickhouse_connect
    except ImportError as exc:
        raise ConfigError("the http(s):// store needs clickhouse-connect") from exc
    try:
        client = clickhouse_connect.get_client(dsn=dsn, connect_timeout=5, send_receive_timeout=60)
    except Exception as exc:
        raise StoreError(f"cannot reach ClickHouse at {redact(dsn)}: {first_line(exc)}") from exc
    return Store(client, redact(dsn))


_BACKENDS: dict[str, Callable[[str], Store]] = {"chdb": _open_chdb, "http": _open_http, "https": _open_http}


def register_backend(scheme: str, factory: Callable[[str], Store]) -> None:
    """Map a DSN scheme to a factory ``dsn -> Store``."""
    _BACKENDS[scheme.lower()] = factory


def known_schemes() -> str:
    return ", ".join(f"{s}://" for s in sorted(_BACKENDS))


STORE_OPTIONS = ("cluster", "raw_retention_days")
"""DSN query options read by the store itself (the others go to the client as settings)."""


def split_options(dsn: str) -> tuple[str, dict[str, str]]:
    """``dsn`` without the store's own options, and those options."""
    parts = urlsplit(dsn)
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    ours = {k: v for k, v in pairs if k in STORE_OPTIONS}
    if not ours:
        return dsn, {}
    rest = urlencode([(k, v) for k, v in pairs if k not in STORE_OPTIONS])
    return dsn.split("?", 1)[0] + (f"?{rest}" if rest else ""), ours


def open_store(dsn: str) -> Store:
    """Open the store a DSN names: ``chdb:///path`` or ``http(s)://host:8123[/database]``, with the
    options ``?cluster=NAME`` (server only) and ``?raw_retention_days=N``."""
    scheme = dsn.split("://", 1)[0].lower() if isinstance(dsn, str) and "://" in dsn else ""
    factory = _BACKENDS.get(scheme)
    if factory is None:
        raise ConfigError(f"unknown store DSN {dsn!r} (known schemes: {known_schemes()})")
    dsn, options = split_options(dsn)
    cluster = options.get("cluster") or None
    if cluster is not None and (scheme == "chdb" or not cluster.replace("_", "a").isalnum()):
        raise ConfigError(f"store DSN option cluster={cluster!r}: a cluster is a plain name, and needs a "
                          "ClickHouse server (http:// or https://), not chdb://")
    days = options.get("raw_retention_days")
    if days is not None and (not days.isdigit() or int(days) < 1):
        raise ConfigError(f"store DSN option raw_retention_days={days!r}: a whole number of days >= 1")
    store = factory(dsn)
    store.cluster = cluster
    store.raw_retention_days = None if days is None else int(days)
    return store
