"""The probe's relay of the policy's ``rollback`` recommendations to the training processes on its node.

A thread consumes ``fh.recommendations`` (consumer group ``fh-rollback-NODE``, so every node's probe
sees every recommendation) and, for each ``rollback`` of a job that has run on this node (the probe
tells it which jobs it has seen: :meth:`RollbackRelay.saw_jobs`), replaces the job's advice file
(:mod:`fleethealth.payloads.advice`) when the recommendation is newer than the one there. The
training loop reads that file without blocking (:class:`fleethealth.injob.inbox.RollbackInbox`).
A rollback for a job not seen yet is held (the newest per job, at most ``max_held``) and written
when the job's first datagram arrives.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fleethealth.errors import FleetHealthError
from fleethealth.payloads.advice import Advice, write_advice
from fleethealth.schema import Action, Recommendation, Topic

__all__ = ["RollbackRelay", "advice_of", "GROUP_PREFIX"]

GROUP_PREFIX = "fh-rollback-"
"""Each node's relay joins consumer group ``GROUP_PREFIX + node``: the probe principal's Kafka ACL grants
groups by this prefix (deploy/k8s/components/kafka-auth/users.yaml, deploy/kafka/acls.sh)."""

_log = logging.getLogger("fleethealth.probe")


def advice_of(rec: Recommendation) -> Advice | None:
    """The advice a ``rollback`` recommendation carries (``None`` for any other action or without a job)."""
    if rec.action is not Action.ROLLBACK or not rec.job:
        return None
    ev = rec.evidence

    def step(key: str) -> int | None:
        v = ev.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None

    cls = ev.get("classification")
    uri = ev.get("target_uri")
    return Advice(id=rec.id, ts=float(rec.ts), job=rec.job, target_step=step("target_step"),
                  target_uri=uri if isinstance(uri, str) else None, failed_step=step("failed_step"),
                  classification=cls if isinstance(cls, str) else None, guard=rec.guard.value)


class RollbackRelay:
    """Writes the newest rollback advice of each job seen on this node under ``run_dir``.

    ``consumer``: a :class:`fleethealth.bus.Consumer` of ``fh.recommendations`` (built from ``dsn``
    when omitted). :meth:`handle` is the pure part (recommendations in, files out); :meth:`start` runs
    it on a thread until :meth:`close`.
    """

    def __init__(self, run_dir: str | Path, node: str, *, dsn: str | None = None, consumer: Any = None,
                 max_held: int = 1024, poll_s: float = 0.5) -> None:
        self.run_dir = Path(run_dir)
        self.node = node
        self.max_held = int(max_held)
        self.poll_s = float(poll_s)
        self._dsn = dsn
        self._consumer = consumer
        self._jobs: set[str] = set()
        self._newest: dict[str, float] = {}
        self._held: OrderedDict[str, Advice] = OrderedDict()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.written_total = 0
        self.errors_total = 0

    # ------------------------------------------------------------ the pure part
    def saw_jobs(self, jobs: Iterable[str | None]) -> None:
        """Jobs with ranks on this node (from the probe's datagrams); writes any held advice for them."""
        with self._lock:
            new = {j for j in jobs if j} - self._jobs
            self._jobs |= new
            ready = [self._held.pop(j) for j in new if j in self._held]
        for advice in ready:
            self._write(advice)

    def handle(self, recs: Iterable[Recommendation]) -> int:
        """Relay the rollbacks among ``recs``; returns how many advice files were written."""
        written = 0
        for rec in recs:
            advice = advice_of(rec)
            if advice is None:
                continue
            with self._lock:
                if advice.ts <= self._newest.get(advice.job, float("-inf")):
                    continue
                if advice.job not in self._jobs:
                    self._held[advice.job] = advice
                    self._held.move_to_end(advice.job)
                    while len(self._held) > self.max_held:
                        self._held.popitem(last=False)
                    continue
            written += self._write(advice)
        return written

    def _write(self, advice: Advice) -> int:
        with self._lock:
            if advice.ts <= self._newest.get(advice.job, float("-inf")):
                return 0
            self._newest[advice.job] = advice.ts
        try:
            path = write_advice(self.run_dir, advice)
        except OSError as exc:
            self.errors_total += 1
            _log.error("rollback relay: cannot write the advice for job %s under %s: %s", advice.job, self.run_dir, exc)
            return 0
        self.written_total += 1
        _log.info("rollback relay: job %s: roll back to step %s (failure at step %s) -> %s", advice.job,
                  advice.target_step, advice.failed_step, path)
        return 1

    # ------------------------------------------------------------ the thread
    def start(self) -> RollbackRelay:
        if self._consumer is None:
            from fleethealth.bus import Consumer

            if self._dsn is None:
                raise FleetHealthError("rollback relay: no bus to read recommendations from")
            self._consumer = Consumer(self._dsn, [Topic.RECOMMENDATIONS.value], f"{GROUP_PREFIX}{self.node}",
                                      from_beginning=False, client_id=f"fleethealth-rollback-{self.node}")
        self._thread = threading.Thread(target=self._run, name="fh-rollback-relay", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                records = self._consumer.poll(self.poll_s)
                self.handle(r.msg for r in records if isinstance(r.msg, Recommendation))
                if records:
                    self._consumer.commit()
            except Exception as exc:  # noqa: BLE001 - the relay must outlive a broker outage
                self.errors_total += 1
                _log.warning("rollback relay: %s: %s", type(exc).__name__, exc)
                self._stop.wait(min(5.0, 10 * self.poll_s))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if self._consumer is not None and hasattr(self._consumer, "close"):
            self._consumer.close()
