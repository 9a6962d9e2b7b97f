"""Deterministic identifiers: every id and deduplication token the service derives.

An id names *what a record is about*, never when it was decided or which process made it, so a
replay or a restart re-derives the same id and the store, the bus and the scheduler adapters see
one record, not two (docs/architecture.md "Findings and recommendations": ids are deterministic).

=======================  ==========================================================================
:func:`digest`           the id of a message from its identifying fields: 24 hex digits of BLAKE2b
                         over the fields' ``str`` joined by U+001F (events, findings, recommendations)
:func:`episode`          a finding's episode start as an id part: event time quantised to the
                         millisecond (the store's resolution), so a restart that re-detects the
                         episode, concluding at another step or time, derives the same finding id
:func:`token`            a deduplication token over a sequence of strings, in order (a store write
                         naming the input offsets and output ids it covers)
:func:`derived`          the subject id of a record that another one caused: ``"tag:subject"``
                         (the breaker's page for the finding that tripped it, a pager pattern)
:func:`interruption`     one stop of a run: its job, the high-water step and that step's event time
=======================  ==========================================================================

Pure standard library; the formats are part of the stored data, so changing one re-keys history.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

__all__ = ["digest", "token", "derived", "episode", "interruption", "DIGEST_BYTES"]

DIGEST_BYTES = 12
"""Bytes of BLAKE2b output (hex ids are twice as long)."""
_SEP = "\x1f"


def digest(*parts: object) -> str:
    """The id of a record whose identity is ``parts`` (each rendered with ``str``; ``None`` is ``"None"``)."""
    return hashlib.blake2b(_SEP.join(map(str, parts)).encode(), digest_size=DIGEST_BYTES).hexdigest()


def episode(ts: float) -> str:
    """The id part naming an episode that began at event time ``ts`` (seconds, to the millisecond)."""
    return f"episode@{ts:.3f}"


def token(chunks: Iterable[str]) -> str:
    """A deduplication token over ``chunks`` taken in order (each chunk carries its own separator)."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for chunk in chunks:
        h.update(chunk.encode())
    return h.hexdigest()


def derived(tag: str, subject: str) -> str:
    """The subject id of a record caused by ``subject`` in the role ``tag`` (``derived("breaker", fid)``)."""
    return f"{tag}:{subject}"


def interruption(job: str, step: int, ts: float) -> str:
    """The id of one stop of run ``job``: the high-water step it stopped after and the event time that
    step was reached (milliseconds), whatever signal made it known (:mod:`fleethealth.detectors.lifecycle`)."""
    return digest("interruption", job, step, f"{ts:.3f}")
