"""``fleethealth serve``: the HTTP API, and in embedded mode the broker, the store and the detectors."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from fleethealth.commands._common import embedded_store_dsn, open_store_at, stop_on_signals
from fleethealth.commands._settings import add_config_flags, add_log_flags, add_migrate_flag, add_setting, load_live

if TYPE_CHECKING:
    import threading

    from fleethealth.config import LiveSettings, Settings
    from fleethealth.signing import KeyRing

__all__ = ["add"]


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the HTTP API (and, embedded, the broker, store and detectors)",
                       description="Serve the HTTP API under uvicorn. Without --kafka it also starts the embedded "
                                   "broker, owns the chDB store at DIR/store and runs the detector runner on a "
                                   "thread, so one process holds the store and every other client goes through "
                                   "the API (fleethealth query included). The detectors take the detect.* and "
                                   "policy.* config keys (`fleethealth config show`). SIGHUP, or POST "
                                   "/v1/config/reload with the write token, reloads the file's live keys "
                                   "(GET /v1/config shows the values in force).")
    add_setting(p, "--data", "data", metavar="DIR", help="data directory (default: %(default)s)")
    add_setting(p, "--kafka", "kafka", metavar="DSN",
                help="an existing Kafka (kafka://host:port) instead of the embedded broker")
    add_setting(p, "--store", "store", metavar="DSN", help="a store DSN instead of chdb://DIR/store")
    add_setting(p, "--host", "serve.host", help="listen address (default: %(default)s)")
    add_setting(p, "--port", "serve.port", type=int, help="listen port (default: %(default)s)")
    add_setting(p, "--token-file", "serve.token_file", metavar="F",
                help="file holding the bearer token for write endpoints (else $FLEETHEALTH_API_TOKEN; "
                     "without either, writes are refused); it also grants reads")
    add_setting(p, "--read-token-file", "serve.read_token_file", metavar="F",
                help="file holding the bearer token for reads: every GET but /healthz and /metrics, and "
                     "analyst SQL (else $FLEETHEALTH_READ_TOKEN; without either, only the write token reads)")
    add_setting(p, "--open-reads", "serve.open_reads", store_true=True,
                help="serve reads without any token (a warning is logged: anyone who reaches the port "
                     "reads the store); for a trial on 127.0.0.1 only")
    add_setting(p, "--no-detect", "serve.no_detect", store_true=True,
                help="serve the API only; run no detector runner, and check the store's schema instead of "
                     "migrating it (so a read-only ClickHouse user will do; a store that lacks migrations is "
                     "refused with their names)")
    add_setting(p, "--query-store", "serve.query_store", metavar="DSN",
                help="the store DSN analyst SQL (POST /v1/query) runs on, never migrated: in server mode the "
                     "read-only user of deploy/clickhouse/access/fleethealth-api.xml, which has no FILE, URL "
                     "or other source grants (default: the --store DSN)")
    add_migrate_flag(p)
    add_log_flags(p)
    add_config_flags(p)
    p.set_defaults(run=run)


def _api_token(path: str | None, *, flag: str = "--token-file", env: str = "FLEETHEALTH_API_TOKEN") -> str | None:
    import os
    from pathlib import Path

    from fleethealth.errors import ConfigError

    if path is not None:
        try:
            token = Path(path).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read {flag} {path}: {exc}") from exc
        if not token:
            raise ConfigError(f"{flag} {path} is empty")
        return token
    return os.environ.get(env) or None


def run(args: argparse.Namespace) -> int:
    import contextlib
    import signal
    import threading

    import uvicorn
    from prometheus_client import CollectorRegistry

    from fleethealth.api import create_app
    from fleethealth.commands.detect import build_runner
    from fleethealth.detectors.live import at_boundary, validate
    from fleethealth.policy.interval import IntervalEstimator

    live = load_live(args, validate)
    settings = live.current
    from fleethealth.probe.logs import configure_logging

    configure_logging(settings["log.level"], settings["log.format"])
    interval = IntervalEstimator(**settings.section("policy.interval", changed_only=True)).check()
    token = _api_token(settings["serve.token_file"])
    read_token = _api_token(settings["serve.read_token_file"], flag="--read-token-file", env="FLEETHEALTH_READ_TOKEN")
    open_reads = bool(settings["serve.open_reads"])
    host, port = settings["serve.host"], settings["serve.port"]
    if token is None:
        print("fleethealth serve: no token (--token-file or FLEETHEALTH_API_TOKEN): write endpoints refuse",
              file=sys.stderr)
    if open_reads:
        print(f"fleethealth serve: WARNING --open-reads: reads need no token; anyone who reaches {host}:{port} "
              "can read the store", file=sys.stderr)
    elif token is None and read_token is None:
        print("fleethealth serve: no read token (--read-token-file or FLEETHEALTH_READ_TOKEN): reads refuse",
              file=sys.stderr)
    stop = threading.Event()
    registry = CollectorRegistry()
    live.register(registry)
    with contextlib.ExitStack() as stack:
        dsn = settings["kafka"]
        if dsn is None:
            from fleethealth.broker import EmbeddedBroker

            dsn = stack.enter_context(EmbeddedBroker()).dsn
        store_dsn = settings["store"] or embedded_store_dsn(settings["data"], create=True)
        no_detect = bool(settings["serve.no_detect"])
        # pending migrations refuse the start unless --migrate; without detectors the API only reads (and
        # stamps acks): it checks the schema and never migrates it, --migrate or not
        migrate = bool(settings["migrate.on_start"]) and not no_detect
        if settings["migrate.on_start"] and no_detect:
            print("fleethealth serve: --no-detect never migrates (--migrate ignored): run `fleethealth migrate up`",
                  file=sys.stderr, flush=True)
        store = stack.enter_context(open_store_at(store_dsn, migrate=migrate, check=not migrate,
                                                  lock_ttl_s=settings["migrate.lock_ttl_s"]))
        hook = None
        server: uvicorn.Server | None = None
        failed: list[BaseException] = []
        if not no_detect:
            from fleethealth.bus import ensure_topics
            from fleethealth.commands.detect import _startup_retry

            # a broker restarting (or not up yet) while serve starts is waited out, with backoff and a log line
            _startup_retry(stop).call("fleethealth serve: creating the topics", lambda: ensure_topics(dsn))
            runner = stack.enter_context(build_runner(dsn, store, settings, live=live, registry=registry))
            between = at_boundary(live, runner)
            hook = runner.policy.engine.reset_breaker

            def detect() -> None:  # a dead detector must not leave an API that looks healthy
                try:
                    runner.run(stop, between=between)
                except Exception as exc:
                    failed.append(exc)
                    print(f"fleethealth serve: the detectors stopped: {exc}", file=sys.stderr, flush=True)
                    if server is not None:
                        server.should_exit = True

            thread = threading.Thread(target=detect, name="fleethealth-detect", daemon=True)
            thread.start()
            stack.callback(thread.join, 10.0)
            stack.callback(stop.set)
        # analyst SQL on a handle of its own: it neither queues the detector's writes nor waits behind them
        query_store = stack.enter_context(open_store_at(settings["serve.query_store"] or store_dsn, migrate=False))
        app = create_app(store, token=token, read_token=read_token, open_reads=open_reads,
                         registry=registry, on_breaker_reset=hook, query_store=query_store,
                         release_keys=_release_keys(settings),
                         interval=interval, live=live, live_at_batches=not no_detect)
        print(f"fleethealth serve: http://{host}:{port} (bus {dsn}, store {store_dsn})", file=sys.stderr, flush=True)
        # uvicorn re-raises the signal that stopped it once it has shut down; ours sets ``stop`` so
        # the runner, store and broker still close in order
        # SIGHUP only sets a flag: the detector thread reads and applies the file between two batches (without
        # detectors, a thread of its own looks for the flag twice a second)
        signal.signal(signal.SIGHUP, lambda *_: live.request())
        if no_detect:
            threading.Thread(target=_reload_when_asked, args=(live, stop), name="fleethealth-reload",
                             daemon=True).start()
        with stop_on_signals(stop):
            server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
            if not failed:
                server.run()
    return 1 if failed else 0


def _reload_when_asked(live: LiveSettings, stop: threading.Event) -> None:
    """Without a detector in the process: apply a requested reload within half a second (a refused one is
    logged and counted by ``live``)."""
    while not stop.wait(0.5):
        live.take()


def _release_keys(settings: Settings) -> KeyRing | None:
    """With ``signing.mode = require``, the keys a release checks the stored self-test's signature with."""
    if settings["signing.mode"] != "require":
        return None
    from fleethealth.signing import load_verifier

    verifier = load_verifier("require", fleet_secret_file=settings["signing.fleet_secret_file"],
                             key_dir=settings["signing.key_dir"])
    return None if verifier is None else verifier.ring
