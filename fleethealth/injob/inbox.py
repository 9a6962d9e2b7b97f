"""The policy's ``rollback`` recommendation, received in the training process without blocking (torch-free).

The node's probe writes the newest rollback for each job running on the node to
``RUN_DIR/rollback/JOB.json`` (:mod:`fleethealth.probe.rollback`, format in
:mod:`fleethealth.payloads.advice`); ``RUN_DIR`` is the directory of the probe's socket
(``$FLEETHEALTH_SOCKET``, else ``/run/fleethealth/probe.sock``). :meth:`RollbackInbox.poll` costs one
``stat`` when nothing changed and one small read when it did; it never waits and never raises on a
missing or half-written file (the probe replaces it atomically; a bad one is logged once and
skipped). The guard polls it on check steps and agrees on it across ranks
(:class:`~fleethealth.injob.guard.SdcGuard`, ``StepVerdict.rollback_to``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from fleethealth.errors import SchemaError
from fleethealth.payloads.advice import Advice, advice_path, read_advice

__all__ = ["RollbackInbox", "default_run_dir"]

_log = logging.getLogger("fleethealth.injob")


def default_run_dir() -> Path:
    """The probe's run directory: where its socket is (read from the environment at each call)."""
    return Path(os.environ.get("FLEETHEALTH_SOCKET", "/run/fleethealth/probe.sock")).parent


class RollbackInbox:
    """The newest rollback advice for ``job`` (``run_dir``: the probe's run directory)."""

    def __init__(self, job: str, run_dir: str | Path | None = None) -> None:
        self.job = job
        self.path = advice_path(default_run_dir() if run_dir is None else run_dir, job)
        self.latest: Advice | None = None
        self._seen: tuple[int, int, int] | None = None
        self.errors_total = 0

    def poll(self) -> Advice | None:
        """A new advice since the last call, else ``None`` (no file, unchanged, or unreadable)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key == self._seen:
            return None
        self._seen = key
        try:
            advice = read_advice(self.path)
        except (OSError, SchemaError) as exc:
            self.errors_total += 1
            _log.warning("fleethealth: rollback advice %s unreadable: %s", self.path, exc)
            return None
        if advice.job != self.job or (self.latest is not None and advice.ts <= self.latest.ts):
            return None
        self.latest = advice
        return advice
