"""The rollback advice file a node's probe writes for the training processes on that node
(torch-free; written by :mod:`fleethealth.probe.rollback`, read by :mod:`fleethealth.injob.inbox`).

One JSON object per job in ``RUN_DIR/rollback/JOB.json`` (``RUN_DIR``: the directory of the probe's
socket), replaced atomically (write to a temporary file, ``os.replace``), so a reader sees the old
object or the new one, never half of either. It holds the newest ``rollback`` recommendation of the
policy for the job: ``id``, ``ts``, ``job``, ``target_step`` and ``target_uri`` (``null`` when no
clean checkpoint is known: a human must decide), ``failed_step``, ``classification``, ``guard``.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fleethealth.errors import SchemaError

__all__ = ["Advice", "ADVICE_DIR", "advice_path", "write_advice", "read_advice"]

ADVICE_DIR = "rollback"
_SAFE = re.compile(r"[^A-Za-z0-9._-]")


@dataclass(frozen=True)
class Advice:
    """One rollback recommendation for one job, as the probe relays it."""

    id: str
    ts: float
    job: str
    target_step: int | None
    target_uri: str | None
    failed_step: int | None
    classification: str | None
    guard: str

    def to_obj(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_obj(cls, obj: Any) -> Advice:
        if not isinstance(obj, dict):
            raise SchemaError("rollback advice", f"must be a JSON object, got {type(obj).__name__}")
        try:
            out = cls(id=str(obj["id"]), ts=float(obj["ts"]), job=str(obj["job"]),
                      target_step=_opt_int(obj.get("target_step")), target_uri=_opt_str(obj.get("target_uri")),
                      failed_step=_opt_int(obj.get("failed_step")), classification=_opt_str(obj.get("classification")),
                      guard=str(obj.get("guard", "")))
        except (KeyError, TypeError, ValueError) as exc:
            raise SchemaError("rollback advice", str(exc)) from exc
        return out


def _opt_int(v: Any) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"a step must be a non-negative integer, got {v!r}")
    return v


def _opt_str(v: Any) -> str | None:
    return None if v is None else str(v)


def advice_path(run_dir: str | Path, job: str) -> Path:
    """``RUN_DIR/rollback/JOB.json`` (characters outside ``[A-Za-z0-9._-]`` in the job name become ``_``)."""
    return Path(run_dir) / ADVICE_DIR / f"{_SAFE.sub('_', job)}.json"


def write_advice(run_dir: str | Path, advice: Advice) -> Path:
    """Replace the job's advice file atomically; returns its path."""
    path = advice_path(run_dir, advice.job)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(advice.to_obj()), encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_advice(path: str | Path) -> Advice:
    """Parse one advice file (:class:`SchemaError` when it is not one)."""
    try:
        obj = json.loads(Path(path).read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SchemaError(str(path), f"not JSON: {exc}") from exc
    return Advice.from_obj(obj)
