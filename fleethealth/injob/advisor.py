"""The checkpoint interval the service recommends for this job, read without ever blocking training (torch-free).

::

    from fleethealth.injob import recommended_checkpoint_interval

    last_save = time.monotonic()
    for step in ...:
        ...
        every = recommended_checkpoint_interval() or 1800.0   # None until the first answer
        if time.monotonic() - last_save >= every:
            save(step); last_save = time.monotonic()

:func:`recommended_checkpoint_interval` returns the last value the service gave (seconds, from
``GET /v1/runs/{job}/health``, ``checkpoint.interval_s_recommended``) or None. The first call starts
a daemon thread that asks the API every ``poll_s`` (60 s) with a ``timeout_s`` (2 s) limit; the call
itself only reads an attribute. A slow, failing or absent API leaves the last value in place (None
until one arrived); errors are counted and logged once a kind.

Where: the API at ``$FLEETHEALTH_API`` (``http://fleethealth-api:8080``; unset: nothing is asked and
the value stays None), with the read token in ``$FLEETHEALTH_READ_TOKEN`` when reads need one; the job
from ``$FLEETHEALTH_JOB``. :class:`IntervalAdvisor` takes all of these as arguments instead.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

import orjson

from fleethealth.errors import ConfigError

__all__ = ["IntervalAdvisor", "recommended_checkpoint_interval", "API_ENV"]

API_ENV = "FLEETHEALTH_API"
"""The environment variable naming the fleethealth API's base URL for the in-job library."""
_MAX_BYTES = 1 << 20
"""Most bytes of one answer read (a health answer is a few KiB)."""

_log = logging.getLogger("fleethealth.injob")


def _fetch_url(url: str, token: str | None, timeout_s: float) -> bytes:
    headers = {"Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s) as resp:  # noqa: S310
        return resp.read(_MAX_BYTES + 1)


class IntervalAdvisor:
    """The service's recommended checkpoint interval for ``job``, polled in a background thread.

    ``url`` is the API's base URL (default ``$FLEETHEALTH_API``; None: never asks), ``token`` the read
    token (default ``$FLEETHEALTH_READ_TOKEN``). ``fetch(url, token, timeout_s) -> bytes`` replaces the
    HTTP call (tests, another transport). :attr:`value` is the last interval received; ``errors_total``
    counts failed polls; :attr:`updated` is set after each poll that brought a value.
    """

    def __init__(self, job: str | None = None, *, url: str | None = None, token: str | None = None,
                 poll_s: float = 60.0, timeout_s: float = 2.0,
                 fetch: Callable[[str, str | None, float], bytes] | None = None) -> None:
        self.job = job if job is not None else os.environ.get("FLEETHEALTH_JOB", "") or None
        self.base = (url if url is not None else os.environ.get(API_ENV, "")).rstrip("/") or None
        self.token = token if token is not None else os.environ.get("FLEETHEALTH_READ_TOKEN") or None
        if not (isinstance(poll_s, int | float) and poll_s > 0 and isinstance(timeout_s, int | float)
                and timeout_s > 0):
            raise ConfigError(f"IntervalAdvisor: poll_s and timeout_s must be > 0, got {poll_s!r}, {timeout_s!r}")
        self.poll_s, self.timeout_s = float(poll_s), float(timeout_s)
        self._fetch = fetch if fetch is not None else _fetch_url
        self.value: float | None = None
        self.answer: dict[str, Any] | None = None
        """The whole ``checkpoint`` object of the last answer (its inputs and basis)."""
        self.errors_total = 0
        self.updated = threading.Event()
        self._warned: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def url(self) -> str | None:
        if self.base is None or self.job is None:
            return None
        return f"{self.base}/v1/runs/{urllib.parse.quote(self.job, safe='')}/health"

    def poll_once(self) -> float | None:
        """Ask the API once (waits up to ``timeout_s``: the background thread's body, not for the step
        path); returns the value now held."""
        url = self.url
        if url is None:
            return self.value
        try:
            body = self._fetch(url, self.token, self.timeout_s)
            if len(body) > _MAX_BYTES:
                raise ValueError(f"answer over {_MAX_BYTES} bytes")
            checkpoint = orjson.loads(body).get("checkpoint")
            if checkpoint is None:
                return self.value  # the service has no advice for this job yet
            interval = checkpoint["interval_s_recommended"]
            if isinstance(interval, bool) or not isinstance(interval, int | float) or not math.isfinite(interval) \
                    or interval <= 0:
                raise ValueError(f"interval_s_recommended {interval!r} is not a positive number")
        except (OSError, urllib.error.URLError, ValueError, TypeError, KeyError, AttributeError) as exc:
            self.errors_total += 1
            kind = type(exc).__name__
            if kind not in self._warned:
                self._warned.add(kind)
                _log.warning("fleethealth: checkpoint interval from %s not read (%s: %s); keeping %s", url, kind,
                             exc, self.value)
            return self.value
        self.value, self.answer = float(interval), checkpoint
        self.updated.set()
        return self.value

    def get(self) -> float | None:
        """The last interval received (seconds) or None; starts the polling thread on the first call.
        Never waits."""
        if self._thread is None and self.url is not None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="fleethealth-interval", daemon=True)
                    self._thread.start()
        return self.value

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll_once()
            self._stop.wait(self.poll_s)

    def close(self) -> None:
        """Stop polling (the thread ends after its current request, within ``timeout_s``)."""
        self._stop.set()


_default: IntervalAdvisor | None = None
_default_lock = threading.Lock()


def recommended_checkpoint_interval(job: str | None = None) -> float | None:
    """The service's recommended checkpoint interval for ``job`` (default ``$FLEETHEALTH_JOB``), in seconds,
    or None until one arrived (see the module docstring). Never blocks."""
    global _default
    advisor = _default
    wanted = job if job is not None else os.environ.get("FLEETHEALTH_JOB", "") or None
    if advisor is None or advisor.job != wanted:
        with _default_lock:
            if _default is None or _default.job != wanted:
                if _default is not None:
                    _default.close()
                _default = IntervalAdvisor(wanted)
            advisor = _default
    return advisor.get()
