"""The helpers the commands share: a signal sets the stop event and the old handler comes back;
``--only`` lists; the store helpers' DSNs."""

from __future__ import annotations

import os
import signal

from fleethealth.commands._common import (
    embedded_store_dsn,
    optional_producer,
    optional_store,
    parse_only,
    stop_on_signals,
)


def test_a_signal_sets_stop_and_the_previous_handler_returns() -> None:
    # what the process had before, whatever it inherited (a run started in the background by a
    # non-interactive shell has SIGINT ignored, not Python's default handler)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with stop_on_signals() as stop:
        assert not stop.is_set()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.wait(5.0)
        assert all(signal.getsignal(sig) is not handler for sig, handler in before.items())
    assert all(signal.getsignal(sig) is handler for sig, handler in before.items())


def test_only_lists_and_absent_parts(tmp_path) -> None:
    assert parse_only(None) is None and parse_only("") is None
    assert parse_only(" gemm_exact_fp32, ,memory ") == ["gemm_exact_fp32", "memory"]
    assert embedded_store_dsn(tmp_path, create=True) == f"chdb://{(tmp_path / 'store').resolve()}"
    assert (tmp_path / "store").is_dir()
    with optional_store(None) as store, optional_producer("", "x") as producer:
        assert store is None and producer is None
