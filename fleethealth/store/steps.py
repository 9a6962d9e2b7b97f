"""The steps of a migration and how each one resumes: pure, no store.

A migration's statements (:func:`fleethealth.store.migrations.statements`, in their cluster form
when the store has one) become :class:`Step` objects, one statement each; a ``RENAME TABLE a TO b,
c TO a`` is split into one step per pair, so a migrator stopped between two pairs resumes at the
second. The migrator records each step that is not idempotent as written (:attr:`Step.idempotent`)
as begun before it runs it and as done after it (:mod:`fleethealth.store.migrator`); an idempotent
one is simply run again. A step found begun but not done is *resumed*, and what that means depends
on its kind:

=========  ==========================================================================================
kind       resumed as
=========  ==========================================================================================
rename     skipped when its source is gone and its target is there (the rename ran), else run
create     run with ``IF NOT EXISTS`` (a CREATE runs whole or not at all)
drop       run with ``IF EXISTS``
copy       ``INSERT INTO t ... SELECT``: ``t`` and the tables of this migration's materialized views
           reading ``t`` are emptied (``TRUNCATE``), then the copy runs again; allowed only when this
           migration created ``t`` (and those tables) — writers are stopped, so nothing else wrote there
other      run again (``ALTER ... IF NOT EXISTS`` and the like are idempotent as written)
=========  ==========================================================================================

A copy into a table the migration did not create cannot be resumed blind: :func:`resume_plan`
raises a :class:`~fleethealth.errors.StoreError` naming the step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from fleethealth.errors import StoreError

__all__ = ["Step", "plan_steps", "resume_plan", "Resume"]

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_ON_CLUSTER = rf"(?:\s+ON\s+CLUSTER\s+(?P<cluster>{_IDENT}))?"
_RENAME = re.compile(rf"^RENAME\s+TABLE\s+(?P<pairs>.+?){_ON_CLUSTER}\s*$", re.I | re.S)
_PAIR = re.compile(rf"^\s*({_IDENT})\s+TO\s+({_IDENT})\s*$", re.I)
_CREATE = re.compile(rf"^CREATE\s+(?P<what>TABLE|MATERIALIZED\s+VIEW|VIEW)\s+(?P<ine>IF\s+NOT\s+EXISTS\s+)?"
                     rf"(?P<name>{_IDENT})", re.I)
_MV = re.compile(rf"^CREATE\s+MATERIALIZED\s+VIEW\s+(?:IF\s+NOT\s+EXISTS\s+)?{_IDENT}{_ON_CLUSTER}\s+"
                 rf"TO\s+(?P<to>{_IDENT}).*?\bFROM\s+(?P<src>{_IDENT})", re.I | re.S)
_DROP = re.compile(rf"^DROP\s+TABLE\s+(?P<ie>IF\s+EXISTS\s+)?(?P<name>{_IDENT})", re.I)
_INSERT = re.compile(rf"^INSERT\s+INTO\s+(?P<name>{_IDENT})\b.*\bSELECT\b", re.I | re.S)
_IF_EXISTS_ALTER = re.compile(r"^ALTER\s+TABLE\s+\S+(?:\s+ON\s+CLUSTER\s+\S+)?\s+(?:ADD|DROP|MODIFY|COMMENT)\s+"
                              r"(?:COLUMN|INDEX)\s+IF\s+(?:NOT\s+)?EXISTS\b", re.I)


@dataclass(frozen=True)
class Step:
    """One statement of a migration, numbered from 0 within it. ``kind`` is rename, create, drop,
    copy or other; ``names`` the tables it acts on (rename: source, target; others: the one)."""

    index: int
    sql: str
    kind: str
    names: tuple[str, ...] = ()

    @property
    def idempotent(self) -> bool:
        """Whether running the statement again changes nothing (``CREATE ... IF NOT EXISTS``, ``DROP
        ... IF EXISTS``, ``ALTER ... ADD COLUMN IF NOT EXISTS``): such a step is run again on a resume
        and never recorded; every other step is recorded as begun and done."""
        if self.kind == "create":
            found = _CREATE.match(self.sql)
            return bool(found and found["ine"])
        if self.kind == "drop":
            found = _DROP.match(self.sql)
            return bool(found and found["ie"])
        return self.kind == "other" and bool(_IF_EXISTS_ALTER.match(self.sql))

    @property
    def summary(self) -> str:
        """The statement's first 80 characters on one line (for status lines and errors)."""
        text = " ".join(self.sql.split())
        return text if len(text) <= 80 else text[:79] + "…"


@dataclass(frozen=True)
class Resume:
    """How a begun step is finished: ``skip_if`` (source absent, target present) for a rename; else
    ``truncate`` these tables, then run ``sql``."""

    sql: str
    truncate: tuple[str, ...] = ()
    skip_if: tuple[str, str] | None = None


@dataclass
class _Created:
    tables: set[str] = field(default_factory=set)
    views: dict[str, list[str]] = field(default_factory=dict)  # source table -> tables its views write


def plan_steps(sql: list[str]) -> list[Step]:
    """The steps of one migration from its statements, in order (a multi-pair rename split)."""
    out: list[Step] = []
    for text in sql:
        rename = _RENAME.match(text)
        if rename:
            tail = f" ON CLUSTER {rename['cluster']}" if rename["cluster"] else ""
            for part in rename["pairs"].split(","):
                pair = _PAIR.match(part)
                if pair is None:
                    raise StoreError(f"cannot read the rename {part.strip()!r}")
                out.append(Step(len(out), f"RENAME TABLE {pair[1]} TO {pair[2]}{tail}", "rename", (pair[1], pair[2])))
            continue
        for kind, pattern in (("create", _CREATE), ("drop", _DROP), ("copy", _INSERT)):
            found = pattern.match(text)
            if found:
                out.append(Step(len(out), text, kind, (found["name"],)))
                break
        else:
            out.append(Step(len(out), text, "other"))
    return out


def resume_plan(steps: list[Step], index: int, *, migration: str, local_suffix: str = "") -> Resume:
    """How to finish ``steps[index]`` found begun but not done (see the module's table). On a
    cluster (``local_suffix`` set) a copy empties the replicated local tables, ``t`` + suffix."""
    step = steps[index]
    created = _created(steps[:index])
    if step.kind == "rename":
        return Resume(step.sql, skip_if=(step.names[0], step.names[1]))
    if step.kind == "create":
        found = _CREATE.match(step.sql)
        if found is not None and not found["ine"]:
            at = found.start("name")
            return Resume(step.sql[:at] + "IF NOT EXISTS " + step.sql[at:])
        return Resume(step.sql)
    if step.kind == "drop":
        found = _DROP.match(step.sql)
        if found is not None and not found["ie"]:
            at = found.start("name")
            return Resume(step.sql[:at] + "IF EXISTS " + step.sql[at:])
        return Resume(step.sql)
    if step.kind == "copy":
        target = step.names[0] + local_suffix
        fed = created.views.get(target, [])
        foreign = [t for t in (target, *fed) if t not in created.tables]
        if foreign:
            raise StoreError(f"migration {migration} stopped during step {index + 1} ({step.summary}), a copy into "
                             f"{foreign[0]}, which an earlier migration created: it cannot be emptied and copied "
                             "again safely; restore the store from the backup taken before the upgrade, or repair "
                             f"{foreign[0]} by hand and record the step done")
        return Resume(step.sql, truncate=(target, *fed))
    return Resume(step.sql)


def _created(steps: list[Step]) -> _Created:
    """The tables and views the steps before a resumed one created (a rename's target counts as
    created when its source was)."""
    out = _Created()
    for step in steps:
        if step.kind == "create":
            mv = _MV.match(step.sql)
            if mv is not None:
                out.views.setdefault(mv["src"], []).append(mv["to"])
            else:
                out.tables.add(step.names[0])
        elif step.kind == "rename" and step.names[0] in out.tables:
            out.tables.discard(step.names[0])
            out.tables.add(step.names[1])
        elif step.kind == "drop":
            out.tables.discard(step.names[0])
    return out
