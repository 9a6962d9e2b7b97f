"""Validate each checkpoint after its save, in a background thread that never blocks the step.

::

    validator = CheckpointValidator(reporter)          # before the loop (it imports DCP), on the rank that saves
    ...
    dcp.save(state, checkpoint_id=path)                # or torch.save(state, path)
    validator.saved(step, path, state)                 # returns at once
    ...
    validator.validity()                               # {step: valid} of the checkpoints judged so far
    validator.close()

:meth:`CheckpointValidator.saved` runs on the training thread and does only what needs the live
state: it reads the tensors' shapes and dtypes (metadata: no copy, no device synchronisation) and
puts one item on a bounded queue; when the queue is full the checkpoint is not validated, counted
(``dropped_total``) and reported ``skipped``. The worker thread then, for each checkpoint in turn:

1. writes the digest manifest from the files as they are on disk (:func:`~.files.write_manifest`);
2. validates it (:func:`~.files.validate`): inventory against DCP's ``.metadata``, digests re-read
   against the manifest, a test load on the CPU into tensors of the model's shapes and dtypes, each
   tensor's norm against the band of the last ``rules.history`` checkpoints this validator found valid;
3. reports a ``checkpoint_validated`` event (:mod:`fleethealth.payloads.validation`) through the
   reporter: to the node probe, and from there to the policy, which rolls back only to validated
   checkpoints.

The test load reads the whole checkpoint into this process's host memory, in the background: for a
model whose state does not fit beside training, validate on a spare node with ``fleethealth checkpoint
validate`` instead. A checkpoint written by several ranks (DCP) is validated once, by the rank that
calls :meth:`~CheckpointValidator.saved` after ``dcp.save`` returned on it (the coordinator has then
written ``.metadata``).
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fleethealth.injob.ckptcheck.rules import Band, CheckpointRules, TensorSpec, Verdict
from fleethealth.injob.reporter import Reporter
from fleethealth.payloads.validation import CheckpointValidation, ValidationResult, checkpoint_validated_event

__all__ = ["CheckpointValidator", "Check"]

_log = logging.getLogger("fleethealth.injob")

Check = Callable[[str, Mapping[str, TensorSpec] | None, Band, CheckpointRules, int], Verdict]
"""``check(path, expected, band, rules, step) -> Verdict``: writes the manifest and validates (the
default, :func:`write_and_validate`); a test or a framework may pass its own."""


def write_and_validate(path: str, expected: Mapping[str, TensorSpec] | None, band: Band, rules: CheckpointRules,
                       step: int) -> Verdict:
    """The default check: write the manifest from the files now on disk, then validate against it."""
    from fleethealth.injob.ckptcheck.files import validate, write_manifest

    write_manifest(path, expected, step=step)
    return validate(path, expected=expected, band=band, rules=rules)


@dataclass(frozen=True)
class _Seed:
    paths: tuple[str, ...]


@dataclass(frozen=True)
class _Item:
    step: int
    path: str
    expected: dict[str, TensorSpec] | None
    uri: str


_STOP = object()


class CheckpointValidator:
    """Validates checkpoints in one background thread; reports each outcome as a ``checkpoint_validated`` event.

    ``reporter``: where events go (default: a :class:`~fleethealth.injob.reporter.Reporter` to the node
    probe). ``rules``: the norm band's settings (:class:`~.rules.CheckpointRules`). ``queue_size``:
    checkpoints waiting to be validated at most (more are skipped and counted). ``check``: what
    validates one checkpoint (default :func:`write_and_validate`). ``keep``: results remembered.
    ``history``: the job's previous valid checkpoints (paths, oldest first) that seed the norm band
    — a resumed job passes those it resumed from, so its first checkpoint is judged against the band
    too; each is validated first, in the background, and one that is not valid is left out.
    ``report_tries``: a verdict the probe socket did not take (its queue full) is sent again, up to
    this many times ``retry_s`` apart, by the background thread (the step never waits for it).
    """

    def __init__(self, reporter: Reporter | None = None, *, rules: CheckpointRules | None = None,
                 queue_size: int = 2, check: Check | None = None, keep: int = 64,
                 history: Sequence[str | os.PathLike[str]] = (), report_tries: int = 5, retry_s: float = 0.05,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        if isinstance(queue_size, bool) or not isinstance(queue_size, int) or queue_size < 1:
            raise ValueError(f"queue_size must be an integer >= 1, got {queue_size!r}")
        from fleethealth.injob.ckptcheck.spec import spec_of  # torch; imported here, never on a step

        if check is None:  # DCP's import takes seconds: pay it here, before the loop, not in the first validation
            import fleethealth.injob.ckptcheck.files  # noqa: F401
        self._spec_of = spec_of
        self.reporter = reporter if reporter is not None else Reporter()
        self.rules = rules or CheckpointRules()
        self.check: Check = check or write_and_validate
        self._clock, self._sleep = clock, sleep
        self.report_tries, self.retry_s = max(1, int(report_tries)), float(retry_s)
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size + (1 if history else 0))  # + the seed
        self._room = queue_size
        self._lock = threading.Lock()
        self._norms: collections.deque[Mapping[str, float]] = collections.deque(maxlen=self.rules.history)
        self.results: collections.deque[CheckpointValidation] = collections.deque(maxlen=keep)
        self.dropped_total = 0
        self.failed_total = 0
        self._closed = False
        if history:
            self._queue.put_nowait(_Seed(tuple(os.fspath(h) for h in history)))
        self._thread = threading.Thread(target=self._run, name="fleethealth-ckptcheck", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ training thread
    def saved(self, step: int, path: str | os.PathLike[str], state: Mapping[str, Any] | None = None, *,
              uri: str | None = None) -> bool:
        """The checkpoint of ``step`` is on disk at ``path``: queue it for validation and return at once.
        ``state``: the object that was saved (its tensors' shapes and dtypes are the test load's
        target; ``None``: the manifest's). ``uri``: the checkpoint's name in its ``checkpoint`` record
        (default: the path). False when the queue was full (reported ``skipped``)."""
        if self._closed:
            raise RuntimeError("CheckpointValidator.saved after close()")
        expected = None if state is None else self._spec_of(state)
        try:
            self._queue.put_nowait(_Item(int(step), os.fspath(path), expected, uri or os.fspath(path)))
        except queue.Full:
            self.dropped_total += 1
            self._report(CheckpointValidation(int(step), uri or os.fspath(path), ValidationResult.SKIPPED,
                                              ("not validated: the validation queue was full (a save came while "
                                               f"{self._room} waited)",)))
            return False
        return True

    # ------------------------------------------------------------------ either thread
    def validity(self) -> dict[int, bool]:
        """Checkpoint step → valid, for every result remembered (skipped counts as not valid)."""
        with self._lock:
            return {r.step: r.valid for r in self.results}

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every queued checkpoint is judged (for the end of a run, or a test); False on timeout."""
        done = threading.Event()

        def _join() -> None:
            self._queue.join()
            done.set()

        threading.Thread(target=_join, daemon=True).start()
        return done.wait(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Stop after the queued checkpoints are judged (waits up to ``timeout``)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join(timeout)

    # ------------------------------------------------------------------ worker thread
    def _band(self) -> Band:
        with self._lock:
            return Band.of(list(self._norms))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                if isinstance(item, _Seed):
                    self._seed(item.paths)
                else:
                    self._validate(item)
            finally:
                self._queue.task_done()

    def _seed(self, paths: tuple[str, ...]) -> None:
        from fleethealth.errors import FleetHealthError
        from fleethealth.injob.ckptcheck.files import norms_of

        for path in paths:
            try:
                norms = norms_of(path, self.rules)
            except (FleetHealthError, OSError) as exc:
                _log.warning("fleethealth: history checkpoint %s left out of the norm band: %s", path, exc)
                continue
            with self._lock:
                self._norms.append(norms)

    def _validate(self, item: _Item) -> None:
        began = self._clock()
        try:
            verdict = self.check(item.path, item.expected, self._band(), self.rules, item.step)
        except Exception as exc:  # a validation that crashed is a checkpoint nobody vouched for
            self.failed_total += 1
            _log.exception("fleethealth: validating the checkpoint of step %d at %s failed", item.step, item.path)
            verdict = Verdict(valid=False, reasons=(f"validation could not run: {type(exc).__name__}: {exc}",))
        took = self._clock() - began
        result = ValidationResult.VALID if verdict.valid else ValidationResult.INVALID
        record = CheckpointValidation(item.step, item.uri, result, tuple(verdict.reasons), round(took, 6),
                                      dict(verdict.norms) if verdict.valid else {})
        if verdict.valid:
            with self._lock:
                self._norms.append(dict(verdict.norms))
        else:
            _log.error("fleethealth: checkpoint of step %d at %s is not valid: %s", item.step, item.path,
                       "; ".join(verdict.reasons))
        self._report(record)

    def _report(self, record: CheckpointValidation) -> None:
        with self._lock:
            self.results.append(record)
        event = checkpoint_validated_event(ts=self.reporter.now(), step=record.step, uri=record.uri,
                                           result=record.result, reasons=record.reasons,
                                           duration_s=record.duration_s, norms=record.norms)
        on_step_path = threading.current_thread() is not self._thread
        for attempt in range(1 if on_step_path else self.report_tries):
            if self.reporter.emit(event):
                return
            if attempt + 1 < self.report_tries and not on_step_path:
                self._sleep(self.retry_s * (attempt + 1))
