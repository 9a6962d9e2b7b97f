"""``fleethealth broker``: the embedded Kafka-protocol broker (Tansu) in the foreground."""

from __future__ import annotations

import argparse
import sys

from fleethealth.commands._common import stop_on_signals

__all__ = ["add"]


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("broker", help="run the embedded Kafka-protocol broker (Tansu) in the foreground",
                       description="Run the embedded Tansu broker on 127.0.0.1 and print its DSN. Storage is "
                                   "memory only: stopping it loses every topic, record and offset.")
    p.add_argument("--port", type=int, default=None, help="listen on this port (default: a free one)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from fleethealth.broker import EmbeddedBroker
    from fleethealth.bus import ensure_topics
    from fleethealth.errors import BusUnavailable

    with stop_on_signals() as stop, EmbeddedBroker(port=args.port) as broker:
        ensure_topics(broker.dsn)
        print(broker.dsn, flush=True)
        print("fleethealth broker: memory storage; Ctrl-C stops it", file=sys.stderr, flush=True)
        while not stop.wait(0.5):
            if not broker.running:
                raise BusUnavailable(f"the embedded broker exited: {broker.log_tail() or '(no output)'}")
    return 0
