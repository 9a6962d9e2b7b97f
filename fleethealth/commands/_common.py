"""What several commands share, written once: stopping on a signal, a progress display, opening
the store, a producer that may be absent, and the ``--only`` list.

Nothing here decides anything; each helper is a few lines of wiring the commands would otherwise
repeat. Heavy imports (rich, the store) happen inside the helpers that need them.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleethealth.errors import ConfigError

if TYPE_CHECKING:
    from fleethealth.bus import Producer

__all__ = ["Progress", "stop_on_signals", "progress", "open_store_at", "prepare_store", "embedded_store_dsn",
           "optional_store",
           "optional_producer", "parse_only", "require_bus"]

Progress = Callable[[str, int, int], None]
"""A progress callback: ``(label, done, total)``."""


@contextlib.contextmanager
def stop_on_signals(stop: threading.Event | None = None, *,
                    signals: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[threading.Event]:
    """An event that the given signals set (instead of killing the process), so a loop can stop
    in order: close the store, commit offsets, shut the broker. The previous handlers come back
    on exit. ``stop`` reuses an event made earlier (one a thread already watches)."""
    stop = stop if stop is not None else threading.Event()
    handlers = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in signals}
    try:
        yield stop
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def progress(label: str, *, lines: bool = False) -> Iterator[Progress]:
    """A progress callback for a long run, drawn on stderr: a transient rich bar, or with
    ``lines`` one plain line per phase and ten per cent (for logs: the demo's)."""
    if lines:
        last: dict[str, int] = {}

        def show(phase: str, done: int, total: int) -> None:
            pct = 100 * done // max(total, 1)
            if last.get(phase, -1) // 10 != pct // 10 or done == total:
                last[phase] = pct
                print(f"  {phase:8s} {pct:3d}% ({done}/{total})", file=sys.stderr, flush=True)

        yield show
        return
    from rich.console import Console
    from rich.progress import Progress as Bar

    with Bar(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(label, total=None)

        def update(text: str, done: int, total: int) -> None:
            bar.update(task, description=text, completed=done, total=total)

        yield update


def embedded_store_dsn(data: str | Path, *, create: bool = False) -> str:
    """The chDB DSN of a data directory's store (``DIR/store``), created first with ``create``."""
    path = Path(data) / "store"
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return f"chdb://{path.resolve()}"


def store_dsn(store: str | None, data: str | Path) -> str:
    """``store`` when given, else the DSN of an existing demo store at ``data/store``; a
    :class:`ConfigError` naming the path when there is none (nothing is created)."""
    if store is not None:
        return store
    path = Path(data) / "store"
    if not path.is_dir():
        from fleethealth.errors import ConfigError

        raise ConfigError(f"no store at {path} (run `fleethealth demo --data {data}` first, or give --store)")
    return embedded_store_dsn(data)


def open_store_at(dsn: str, *, migrate: bool = False, check: bool = False, lock_ttl_s: float | None = None) -> Any:
    """The store behind ``dsn``. With ``migrate``, its pending migrations are applied first, under
    the store's migration lock (``lock_ttl_s``: config ``migrate.lock_ttl_s``); with ``check``, a
    store whose schema is behind (pending, half-applied or changed migrations) is refused with
    :class:`~fleethealth.errors.MigrationsPending` naming them (a read-only user can check, not
    migrate); with neither, it is opened as it is (a reader). The caller closes it (it is a context
    manager)."""
    from fleethealth.store import open_store
    from fleethealth.store.migrator import DEFAULT_LOCK_TTL_S, require_current

    store = open_store(dsn)
    try:
        if migrate:
            applied = store.migrate(lock_ttl_s=lock_ttl_s or DEFAULT_LOCK_TTL_S)
            if applied:
                print(f"fleethealth: applied migration(s) {', '.join(applied)} to {store.dsn}", file=sys.stderr,
                      flush=True)
        elif check:
            require_current(store)
    except BaseException:
        store.close()
        raise
    return store


def prepare_store(dsn: str, settings: Any, command: str) -> None:
    """The start-up gate of ``serve``, ``detect`` and ``act``: with ``migrate.on_start`` (``--migrate``)
    apply the store's pending migrations, else refuse to start while any is pending
    (:class:`~fleethealth.errors.MigrationsPending`: one line naming them, exit 2)."""
    migrate = bool(settings["migrate.on_start"])
    with open_store_at(dsn, migrate=migrate, check=not migrate, lock_ttl_s=settings["migrate.lock_ttl_s"]):
        pass
    print(f"fleethealth {command}: the store's schema is current ({'migrated' if migrate else 'checked'})",
          file=sys.stderr, flush=True)


@contextlib.contextmanager
def optional_store(dsn: str | None) -> Iterator[Any]:
    """:func:`open_store_at` when a DSN is given (its schema checked, never migrated: run
    ``fleethealth migrate up`` first), else None; closed on exit."""
    if not dsn:
        yield None
        return
    store = open_store_at(dsn, check=True)
    try:
        yield store
    finally:
        store.close()


@contextlib.contextmanager
def optional_producer(dsn: str | None, client_id: str) -> Iterator[Producer | None]:
    """A :class:`~fleethealth.bus.Producer` when a DSN is given, else None; closed on exit."""
    if not dsn:
        yield None
        return
    from fleethealth.bus import Producer

    producer = Producer(dsn, client_id=client_id)
    try:
        yield producer
    finally:
        producer.close()


def parse_only(text: str | None) -> list[str] | None:
    """``--only a,b`` as ``["a", "b"]`` (blanks dropped); None when not given."""
    return [t.strip() for t in text.split(",") if t.strip()] if text else None


def require_bus(dsn: str | None, message: str) -> str:
    """``dsn``, or a :class:`ConfigError` with ``message`` when there is none."""
    if not dsn:
        raise ConfigError(message)
    return dsn
