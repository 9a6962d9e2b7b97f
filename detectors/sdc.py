"""SDC check results → ``sdc`` findings naming the node, GPU, rank, check and classification.

The in-job library runs two checks (seed 000 R3): a bitwise **self-check** (a rank recomputes
its own microbatch: any bit difference is a hardware fault; catches transient corruption) and a
rare cross-rank **replay** at an empirical tolerance (catches a deterministically wrong GPU).
Each result arrives as an ``sdc_check`` event (keys in :mod:`fleethealth.payloads.sdc_check`):
``check``, ``passed``, ``classification`` (``transient`` | ``persistent`` | ``data_or_code`` |
null), ``digests``, ``duration_s``, ``peer_ranks``, ``culprit_rank``, ``tolerance``.

:class:`SdcDetector` turns a failing check into one finding per (node, GPU, check) episode: a
deterministic fault fails every replay, and one finding is what the policy needs. A later
passing check of the same GPU and kind closes the episode. ``rank`` is the culprit the replay's
bisection named, else the reporting rank. The evidence (:class:`~fleethealth.payloads.SdcEvidence`)
carries the check record plus what a rollback needs: ``last_verified_step`` (the newest check step
of the job that passed, before the failing one: the mark for transient faults), ``last_replay_step``
(the newest *replay* step that passed: the mark for deterministic faults, which a self-check cannot
see) and the job's recent ``checkpoints`` (from ``checkpoint`` events, each with both marks).

Corroboration (docs/architecture.md, "Corroboration"): a single failing check is one event from one
sender, so its finding carries ``evidence["corroboration"]`` with ``by`` empty, and the policy takes the
rollback but leaves the quarantine to a human — unless the job's own step stream places the reporting
rank on that node (``rank_on_node``: the assembler's rank owners, passed to :meth:`SdcDetector.update` as ``Batch.owns``
as ``owns``), which a report about a node that is not running the job cannot have. The second
failing check of the same GPU and kind in the episode emits one more finding (its own episode
time), ``by = ["second_check"]``, which the policy may act on alone.

Events with malformed check records are counted in ``invalid_total_`` and skipped.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence

from fleethealth.detectors.batch import Batch, expect
from fleethealth.detectors.state import Stateful, names
from fleethealth.errors import SchemaError
from fleethealth.evidence import Corroboration
from fleethealth.params import check_int
from fleethealth.payloads.checkpoint import CheckpointRecord
from fleethealth.payloads.rollback import Marks, retained
from fleethealth.payloads.sdc_check import CheckKind, SdcCheck
from fleethealth.payloads.sdc_evidence import SdcEvidence
from fleethealth.schema import Event, EventKind, Finding, FindingKind

__all__ = ["SdcDetector"]


class SdcDetector(Stateful):
    """Failing ``sdc_check`` events → ``sdc`` findings, one per (node, GPU, check) episode.

    Parameters: ``keep`` how many recent passing check steps of each kind to remember per job.
    Checkpoints are kept as far back as a rollback may need them (the clean ancestor of each mark,
    and everything newer: :func:`~fleethealth.payloads.rollback.retained`), at most ``16 * keep``.
    """

    name = "sdc"

    def __init__(self, *, keep: int = 16) -> None:
        self.keep = keep

    def _start(self) -> None:
        check_int("keep", self.keep, at_least=1, owner=self)
        self.open_: dict[tuple[str, int | None, str], int] = {}
        self.passes_: dict[tuple[str, str], deque[int]] = {}  # (job, check kind) -> steps of passing checks
        self.checkpoints_: dict[str, list[CheckpointRecord]] = {}
        self.invalid_total_ = 0
        self.failures_total_ = 0

    def forget(self, jobs: Iterable[str] = (), nodes: Iterable[str] = ()) -> None:
        """Drop ``jobs``' passing checks and checkpoints, and the open episodes of ``nodes``' GPUs."""
        gone_jobs, gone_nodes = names("jobs", jobs), names("nodes", nodes)
        if not hasattr(self, "open_"):
            return
        if gone_jobs:
            self.passes_ = {k: v for k, v in self.passes_.items() if k[0] not in gone_jobs}
            for job in gone_jobs:
                self.checkpoints_.pop(job, None)
        if gone_nodes:
            self.open_ = {k: v for k, v in self.open_.items() if k[0] not in gone_nodes}

    def _remember_pass(self, job: str | None, step: int | None, check: str) -> None:
        if job is None or step is None:
            return
        steps = self.passes_.setdefault((job, check), deque(maxlen=self.keep))
        if step not in steps:
            steps.append(step)

    def _marks(self, job: str | None, step: int | None) -> Marks:
        """Both verification marks of ``job`` from the passing checks seen before ``step``."""
        def newest(kind: str) -> int | None:
            passes = [s for s in self.passes_.get((job or "", kind), ()) if step is None or s < step]
            return max(passes, default=None)

        replay, selfcheck = newest(CheckKind.REPLAY.value), newest(CheckKind.SELFCHECK.value)
        transient = replay if selfcheck is None else selfcheck if replay is None else max(replay, selfcheck)
        return Marks(transient=transient, deterministic=replay)

    def _result(self, e: Event, owns: Callable[[str | None, str, int | None], bool] | None = None) -> list[Finding]:
        try:
            rec = SdcCheck.from_event(e)
        except SchemaError:
            self.invalid_total_ += 1
            return []
        key = (e.node, e.gpu, rec.check.value)
        if rec.passed:
            self.open_.pop(key, None)
            if rec.culprit_rank is None:  # a clean step for the job, not a vote against a peer
                self._remember_pass(e.job, e.step, rec.check.value)
            return []
        self.failures_total_ += 1
        if key in self.open_:
            self.open_[key] += 1
            if self.open_[key] != 2:
                return []
            by, missing = ["second_check"], ""
        else:
            self.open_[key] = 1
            placed = owns is not None and owns(e.job, e.node, e.rank)
            by, missing = (["rank_on_node"], "") if placed else ([], (
                f"a single failing check, and job {e.job}'s step stream does not place rank {e.rank} on {e.node}; "
                "a second failing check of the GPU would support it"))
        marks = self._marks(e.job, e.step)
        evidence = SdcEvidence(record=rec, reporting_rank=e.rank, last_verified_step=marks.transient,
                               last_replay_step=marks.deterministic,
                               checkpoints=tuple(self.checkpoints_.get(e.job or "", ())))
        found = {**evidence.to_evidence(), "corroboration": Corroboration(by=tuple(by), missing=missing).to_evidence()}
        return [Finding(kind=FindingKind.SDC, node=e.node, ts=e.ts, job=e.job, gpu=e.gpu,
                        rank=rec.culprit_rank if rec.culprit_rank is not None else e.rank, step=e.step,
                        detector=f"{self.name}.{rec.check.value}", evidence=found, episode_ts=e.ts)]

    def _checkpoint(self, e: Event) -> None:
        try:
            record = CheckpointRecord.from_event(e)
        except SchemaError:
            record = None
        if e.job is None or record is None:
            self.invalid_total_ += 1
            return
        book = [*self.checkpoints_.get(e.job, ()), record]
        self.checkpoints_[e.job] = retained(book, self._marks(e.job, None))[-16 * self.keep:]

    def update(self, batch: Batch, now: float) -> list[Finding]:
        """:meth:`check` of ``batch.events`` with ``batch.owns`` (``now`` is not read)."""
        batch = expect(batch, self)
        return self.check(batch.events, owns=batch.owns)

    def check(self, events: Sequence[Event], *, owns: Callable[[str | None, str, int | None], bool] | None = None
               ) -> list[Finding]:
        """Read ``sdc_check`` and ``checkpoint`` events (others are ignored); return new findings.
        ``owns(job, node, rank)`` says whether the job's step stream places the rank on the node."""
        if not hasattr(self, "open_"):
            self._start()
        out: list[Finding] = []
        for e in sorted(events, key=lambda e: e.ts):
            if e.kind is EventKind.SDC_CHECK:
                out += self._result(e, owns)
            elif e.kind is EventKind.CHECKPOINT:
                self._checkpoint(e)
        return out
