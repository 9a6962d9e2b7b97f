"""The sample rows a runner holds back to write in one insert over several polls.

At one telemetry sample a second per GPU, a runner that wrote ``gpu_samples`` at every poll made an
insert a second per table, and each insert runs the table's materialized views (the minute, hourly
and per-rack rollups keep one aggregate state per group an insert touches): measured with
``bench/store_trickle.py``, 412 us of CPU a GPU sample at one insert a second against 32 us a minute's
batch, and chDB's memory swinging with the merges of the small parts. :class:`DeferredSamples` keeps
the sample rows of the polls since its last write (telemetry and step rows: the input rows a stage
stores), their input records and the deduplication tokens of the steps that concluded them, so the
runner writes them as one insert when :meth:`DeferredSamples.due` (``store_every_s`` of its clock since
the first row held, ``max_rows`` held, or the end of the input).

Nothing held is committed: :attr:`DeferredSamples.first` is, per input partition, the first offset a
held row came from, and the runner commits no partition past it; a crash reads the rows again from the
commit and stores them again under the same natural keys (one row each under ``FINAL``). Findings,
events and decisions are not held: they are written at every poll, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from fleethealth.errors import ConfigError
from fleethealth.ids import derived
from fleethealth.ids import token as digest_token
from fleethealth.schema import Message, StepBatch, StepBlock, Telemetry

if TYPE_CHECKING:
    from fleethealth.bus import Record
    from fleethealth.detectors.effects import Effects

__all__ = ["DeferredSamples"]

Partition = tuple[str, int]


class DeferredSamples:
    """Telemetry and step rows held for one insert. ``every_s`` 0 holds nothing past the poll that made
    the rows (every poll writes them, the runner's behaviour without holding)."""

    def __init__(self, every_s: float, max_rows: int) -> None:
        if every_s < 0:
            raise ConfigError(f"detect.runner.store_every_s must be >= 0 (0: write every poll), got {every_s}")
        self.every_s = float(every_s)
        self.max_rows = max_rows
        self.telemetry: list[Telemetry] = []
        self.steps: list[StepBatch | StepBlock] = []
        self.first: dict[Partition, int] = {}
        self.since: float | None = None
        self._tokens: list[str] = []
        self._origin: dict[int, Record] = {}

    def __len__(self) -> int:
        return len(self.telemetry) + len(self.steps)

    def add(self, eff: Effects, now: float) -> None:
        """Hold the sample rows of one step of the core (``eff``), read at ``now`` of the runner's clock."""
        if not eff.telemetry and not eff.steps:
            return
        if self.since is None:
            self.since = now
        self.telemetry += eff.telemetry
        self.steps += eff.steps
        self._tokens.append(eff.token)
        for msg in (*eff.telemetry, *eff.steps):
            rec = eff.origin(msg)
            if rec is not None:
                self._origin[id(msg)] = rec
                tp = (rec.topic, rec.partition)
                self.first[tp] = min(self.first.get(tp, rec.offset), rec.offset)

    def due(self, now: float, *, final: bool = False) -> bool:
        """Whether the held rows are to be written now: any are held, and holding is off, the input ended
        (``final``), ``every_s`` passed since the first was held, or ``max_rows`` are held."""
        if not len(self):
            return False
        return (final or self.every_s == 0 or len(self) >= self.max_rows
                or (self.since is not None and now - self.since >= self.every_s))

    @property
    def token(self) -> str:
        """The held rows' deduplication token: the one step's token when one step made them (what a
        runner writing every poll passes), else one naming every step's, in order."""
        if len(self._tokens) == 1:
            return self._tokens[0]
        return derived("d", digest_token(f"{t};" for t in self._tokens))

    def origin(self, msg: Message) -> Record | None:
        """The input record a held row came from."""
        return self._origin.get(id(msg))

    def clear(self) -> None:
        """Forget the held rows (after they were written)."""
        self.telemetry, self.steps, self.first, self.since = [], [], {}, None
        self._tokens, self._origin = [], {}

    def discard(self, gone: Callable[[Record], bool]) -> int:
        """Drop the held rows whose input record ``gone`` names (a partition moved to another replica, or
        read again from a snapshot's offsets: its rows come again). Returns how many were dropped."""
        before = len(self)
        keep = [m for m in (*self.telemetry, *self.steps)
                if (rec := self._origin.get(id(m))) is None or not gone(rec)]
        if len(keep) == before:
            return 0
        origin = {id(m): self._origin[id(m)] for m in keep if id(m) in self._origin}
        tokens, since = self._tokens, self.since
        self.clear()
        if keep:
            self.telemetry = [m for m in keep if isinstance(m, Telemetry)]
            self.steps = [m for m in keep if isinstance(m, StepBatch | StepBlock)]
            # a set of rows no write named before: the token says what was dropped
            self._origin, self._tokens, self.since = origin, [*tokens, f"less {before - len(keep)}"], since
            for rec in origin.values():
                tp = (rec.topic, rec.partition)
                self.first[tp] = min(self.first.get(tp, rec.offset), rec.offset)
        return before - len(self)
