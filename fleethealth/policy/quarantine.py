"""The quarantine book: which nodes are out of the pool, why, since when, and which runs they killed.

Seed 000 §4: ``quarantine (node_id, reason, since, run_ids_affected[])``; the last field turns "our
jobs keep failing" into "node n0417 has killed six jobs". A node leaves quarantine only with a
passing *full* self-test record taken after it was quarantined (seed 000 §7c); a refused release is
written to ``quarantine_log`` with the reason, so an operator can see why a node is still out.

Table ``quarantine`` (migration ``003_policy.sql``) is a ReplacingMergeTree keyed by node; each
change writes the whole row again with a higher ``version`` and reads use ``FINAL``.

The book is the one home of quarantine: the policy engine's allowed quarantines and drains are
written here by the runner that decided them (:func:`book_decisions`), the API and the sweeps release
nodes here, and the runner reconciles the engine's memory with the book before each batch it decides
(:func:`released`, asked by the policy stage for the nodes of the findings it is about to decide
that the engine remembers; :func:`fleethealth.policy.persist.sync_quarantine` reconciles all at once),
so a released node hit by a new fault is decided afresh instead of "already quarantined".
:func:`check_release` is the pure rule; the other functions do the store I/O through the store's
named queries (:mod:`fleethealth.store.queries`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from fleethealth.errors import ConfigError
from fleethealth.schema import Action, Guard, Recommendation

if TYPE_CHECKING:
    from fleethealth.store.protocol import PolicyStore

__all__ = [
    "QuarantineRecord",
    "QuarantineLogEntry",
    "FULL_SUITE",
    "SUITE_RECORD",
    "check_release",
    "full_suite_missing",
    "quarantine",
    "release",
    "quarantined",
    "record",
    "add_run",
    "history",
    "book_decisions",
    "released",
    "BOOKED_ACTIONS",
]

FULL_SUITE = "full"
"""The self-test suite whose pass may return a node to the pool (``SELFTEST`` record ``suite``)."""

SUITE_RECORD = "suite"
"""The ``test`` field of the one self-test record that stands for a whole suite run (it lists the
devices tested and every ``[test, device]`` result it covers); a single test's record never
releases a node."""


@dataclass(frozen=True)
class QuarantineRecord:
    """One node's quarantine. ``since`` is event time (s); ``runs_affected`` lists each job the node
    interrupted, in the order they were recorded, without repeats."""

    node: str
    reason: str
    since: float
    runs_affected: tuple[str, ...] = ()
    finding_id: str | None = None

    @property
    def summary(self) -> str:
        n = len(self.runs_affected)
        return f"node {self.node} has killed {n} job{'' if n == 1 else 's'}"

    def to_obj(self) -> dict[str, Any]:
        return {"node": self.node, "reason": self.reason, "since": self.since,
                "runs_affected": list(self.runs_affected), "finding_id": self.finding_id,
                "summary": self.summary}


@dataclass(frozen=True)
class QuarantineLogEntry:
    """One line of a node's quarantine history: ``action`` is ``quarantine``, ``add_run``,
    ``release`` or ``release_refused``; ``detail`` says why in words."""

    node: str
    ts: float
    action: str
    detail: str
    evidence: dict[str, Any]


# ---------------------------------------------------------------- pure rule
def full_suite_missing(devices: Iterable[str], covered: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The ``(test, device)`` results a complete full suite on ``devices`` holds that ``covered`` lacks.

    Raises :class:`ConfigError` for an empty or unknown device list.
    """
    from fleethealth.kernels.suite import expected_tests

    have = {(str(t), str(d)) for t, d in covered}
    return sorted(expected_tests(FULL_SUITE, list(devices)) - have)


def _suite_coverage(rec: Mapping[str, Any]) -> str | None:
    devices = rec.get("devices")
    covered = rec.get("covered")
    if not isinstance(devices, list | tuple) or not devices or not all(isinstance(d, str) for d in devices):
        return "self-test record lists no devices; it cannot show the full suite is complete"
    if not isinstance(covered, list | tuple) or not all(
            isinstance(c, list | tuple) and len(c) == 2 and all(isinstance(x, str) for x in c) for c in covered):
        return "self-test record has no covered [test, device] list; it cannot show the full suite is complete"
    try:
        missing = full_suite_missing(devices, [tuple(c) for c in covered])
    except ConfigError as exc:
        return f"self-test devices are not valid: {exc}"
    if missing:
        names = ", ".join(f"{t}@{d}" for t, d in missing[:4])
        return f"incomplete full suite: {len(missing)} tests missing ({names})"
    return None


def check_release(node: str, since: float, evidence: Mapping[str, Any]) -> str | None:
    """Return ``None`` when ``evidence`` may release ``node``, else the reason it may not.

    ``evidence`` is the suite-level ``SELFTEST`` record (``test`` is :data:`SUITE_RECORD`), either
    bare or as an event object whose ``data`` holds it. It must be the full suite, verdict ``pass``,
    with no mismatches, name this node, carry a ``ts`` at or after ``since``, and list devices and
    covered ``[test, device]`` results that make up the complete full suite for those devices
    (:func:`full_suite_missing`). One test's record, or a body without node or time, is refused.
    """
    if not isinstance(evidence, Mapping):
        return f"evidence must be a self-test record object, got {type(evidence).__name__}"
    rec = dict(evidence)
    data = rec.get("data")
    if isinstance(data, Mapping):
        if rec.get("kind") not in (None, "selftest"):
            return f"evidence is a {rec.get('kind')!r} event, not a self-test record"
        rec = {**{k: rec[k] for k in ("node", "ts") if k in rec}, **data}
    suite = rec.get("suite")
    if suite != FULL_SUITE:
        return f"self-test suite is {suite!r}; only a passing {FULL_SUITE!r} suite may release a node"
    verdict = rec.get("verdict")
    if verdict != "pass":
        return f"self-test verdict is {verdict!r}, not 'pass'"
    mismatches = rec.get("mismatches")
    if mismatches:
        return f"self-test reports {len(mismatches)} mismatches"
    other = rec.get("node")
    if other is None:
        return "self-test record names no node"
    if other != node:
        return f"self-test record is for node {other!r}, not {node!r}"
    ts = rec.get("ts")
    if ts is None:
        return "self-test record has no ts"
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
        return f"self-test ts is not a finite number: {ts!r}"
    if ts < since:
        return f"self-test at ts={ts} predates the quarantine (since {since})"
    if rec.get("test") != SUITE_RECORD:
        return (f"self-test record is one test ({rec.get('test')!r}); only the record of a complete "
                f"{FULL_SUITE!r} suite run may release a node")
    return _suite_coverage(rec)


# ---------------------------------------------------------------- store I/O
def _to_record(row: Mapping[str, Any]) -> QuarantineRecord:
    return QuarantineRecord(node=row["node"], reason=row["reason"], since=float(row["since"]),
                            runs_affected=tuple(row["runs_affected"]), finding_id=row["finding_id"])


def _check_node(node: str) -> None:
    if not isinstance(node, str) or not node:
        raise ConfigError(f"node must be a non-empty string, got {node!r}")


def _merge_runs(old: Iterable[str], new: Iterable[str]) -> list[str]:
    out = list(old)
    for run in new:
        if not isinstance(run, str) or not run:
            raise ConfigError(f"run ids must be non-empty strings, got {run!r}")
        if run not in out:
            out.append(run)
    return out


def quarantine(store: PolicyStore, node: str, reason: str, ts: float, finding_id: str | None = None,
               runs: Iterable[str] = ()) -> QuarantineRecord:
    """Put ``node`` in quarantine at event time ``ts``; idempotent.

    A node already in quarantine keeps its ``since``, reason and finding; the runs are merged. A node
    released earlier starts a new episode (new ``since``) and keeps the runs it killed before.
    """
    _check_node(node)
    if not reason:
        raise ConfigError("a quarantine needs a reason")
    ts = float(ts)
    runs = tuple(runs)
    old = store.quarantine_row(node)
    if old is not None and old["quarantined"]:
        row = {**old, "runs_affected": _merge_runs(old["runs_affected"], runs), "updated_ts": ts,
               "version": old["version"] + 1}
        detail = f"already quarantined since {old['since']}; runs merged"
    else:
        prior = old["runs_affected"] if old is not None else []
        row = {"node": node, "quarantined": 1, "reason": reason, "since": ts, "finding_id": finding_id,
               "runs_affected": _merge_runs(prior, runs), "released_ts": None, "release_evidence": "",
               "updated_ts": ts, "version": (old["version"] + 1) if old is not None else 1}
        detail = reason
    store.write_quarantine_row(row)
    store.append_quarantine_log(node, ts, "quarantine", detail, {"finding_id": finding_id, "runs": list(runs)})
    return _to_record(row)


def add_run(store: PolicyStore, node: str, job: str, ts: float | None = None) -> QuarantineRecord:
    """Record that ``node`` interrupted run ``job``; raises :class:`ConfigError` for a node the book
    has never held. Repeats of the same job are not counted twice."""
    _check_node(node)
    old = store.quarantine_row(node)
    if old is None:
        raise ConfigError(f"unknown node {node!r}: it has no quarantine record")
    runs = _merge_runs(old["runs_affected"], [job])
    when = float(ts) if ts is not None else float(old["updated_ts"])
    if runs != list(old["runs_affected"]):
        row = {**old, "runs_affected": runs, "updated_ts": when, "version": old["version"] + 1}
        store.write_quarantine_row(row)
        store.append_quarantine_log(node, when, "add_run", f"run {job} interrupted by {node}", {"job": job})
        return _to_record(row)
    return _to_record(old)


def release(store: PolicyStore, node: str, ts: float, evidence: dict[str, Any]) -> bool:
    """Return ``node`` to the pool; ``True`` only with a passing full self-test (:func:`check_release`).

    Every refusal (unknown node, not quarantined, weak evidence) is logged with why and returns False.
    """
    _check_node(node)
    ts = float(ts)
    old = store.quarantine_row(node)
    if old is None or not old["quarantined"]:
        why = "node is not quarantined" if old is not None else f"unknown node {node!r}"
        store.append_quarantine_log(node, ts, "release_refused", why, evidence if isinstance(evidence, Mapping) else {})
        return False
    why = check_release(node, float(old["since"]), evidence)
    if why is not None:
        store.append_quarantine_log(node, ts, "release_refused", why, evidence if isinstance(evidence, Mapping) else {})
        return False
    row = {**old, "quarantined": 0, "released_ts": ts, "updated_ts": ts, "version": old["version"] + 1,
           "release_evidence": orjson.dumps(dict(evidence), default=str).decode()}
    store.write_quarantine_row(row)
    store.append_quarantine_log(node, ts, "release", "passing full self-test", evidence)
    return True


def quarantined(store: PolicyStore) -> list[QuarantineRecord]:
    """Every node now in quarantine, oldest first."""
    return [_to_record(row) for row in store.quarantined_rows()]


def record(store: PolicyStore, node: str) -> QuarantineRecord | None:
    """The node's current quarantine record, or ``None`` when it is not in quarantine."""
    _check_node(node)
    row = store.quarantine_row(node)
    return _to_record(row) if row is not None and row["quarantined"] else None


def history(store: PolicyStore, node: str) -> list[QuarantineLogEntry]:
    """The node's quarantine log (quarantines, runs added, releases and refused releases), in order."""
    _check_node(node)
    return [QuarantineLogEntry(node=r["node"], ts=float(r["ts"]), action=r["action"], detail=r["detail"],
                               evidence=orjson.loads(r["evidence"]) if r["evidence"] else {})
            for r in store.quarantine_log_rows(node)]


BOOKED_ACTIONS = (Action.QUARANTINE, Action.DRAIN)
"""The engine's decisions that take a node out of the pool until a full self-test returns it."""


def book_decisions(store: PolicyStore, recommendations: Iterable[Recommendation]) -> list[QuarantineRecord]:
    """Write the allowed quarantines and drains among ``recommendations`` into the book (a dry run's are
    not carried out, so not booked); idempotent, as :func:`quarantine` is. Returns the records written."""
    out = []
    for rec in recommendations:
        if rec.action in BOOKED_ACTIONS and rec.guard is Guard.ALLOWED and not rec.dry_run:
            out.append(quarantine(store, rec.node, f"{rec.action.value}: {rec.reason}", rec.ts,
                                  finding_id=rec.finding_id, runs=(rec.job,) if rec.job else ()))
    return out


def released(store: PolicyStore, nodes: Iterable[str]) -> set[str]:
    """Which of ``nodes`` the book has released (a row that is no longer quarantined); a node it never
    held is not released (its booking may still be on its way)."""
    out = set()
    for node in sorted(set(nodes)):
        row = store.quarantine_row(node)
        if row is not None and not row["quarantined"]:
            out.add(node)
    return out
