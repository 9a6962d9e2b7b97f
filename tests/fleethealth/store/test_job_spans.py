"""``job_spans`` on real chDB: each job's nodes and step span from the hourly rollup ``job_node_hours``
(012), filled by its view on insert and backfilled when an older store upgrades."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fleethealth.schema import StepBatch
from fleethealth.store import open_store
from fleethealth.store.migrations import migration_files

T0 = 1_767_225_700.0  # 100 s into an hour, 2026-01-01: rows are kept by arrival, not by event time
H = 3600.0


def _steps(job: str, nodes: list[str], first: float, last: float, every: float) -> list[StepBatch]:
    return [StepBatch(job=job, step=k, node=node, ts=float(ts), ranks=np.array([n], np.int32),
                      gpus=np.array([0], np.int16), compute_s=np.array([1.0]))
            for k, ts in enumerate(np.arange(first, last + 1e-6, every)) for n, node in enumerate(nodes)]


def test_spans_come_from_the_hourly_rollup_and_replays_change_nothing(store) -> None:
    a = _steps("llm-a", ["gpu-a1", "gpu-a2", "gpu-a3"], T0, T0 + 5 * H, 30.0)
    b = _steps("llm-b", ["gpu-b1"], T0 + 2 * H, T0 + 3 * H, 60.0)
    store.insert_steps(a)
    store.insert_steps(b)
    store.insert_steps(a[:50])  # a replayed write
    store.optimize_final("job_node_hours")  # merged (and past any TTL): the same answer
    spans = {j: (n, lo, hi) for j, n, lo, hi in store.job_spans(since=T0 - H, until=T0 + 6 * H)}
    assert spans == {"llm-a": (3, T0, T0 + 5 * H), "llm-b": (1, T0 + 2 * H, T0 + 3 * H)}
    # a window that ends before llm-b began: only llm-a, its span reaching to the end of the window's last hour
    ((job, n, lo, hi),) = store.job_spans(since=T0, until=T0 + 1.5 * H)
    assert (job, n, lo) == ("llm-a", 3, T0) and T0 + 1.5 * H <= hi < T0 + 2 * H
    assert store.table_rows("job_node_hours") < len(a) / 10


def test_an_older_store_is_backfilled(tmp_path: Path) -> None:
    old = tmp_path / "old_migrations"
    old.mkdir()
    for m in migration_files():
        if m.version < 12:
            (old / m.name).write_text(m.sql)
    with open_store(f"chdb://{tmp_path}/store") as store:
        store.migrate(old)
        store.insert_steps(_steps("llm-a", ["gpu-a1", "gpu-a2"], T0, T0 + 2 * H, 60.0))
        assert store.migrate() == ["012_job_node_hours.sql", "013_samples_quantised.sql", "014_job_steps.sql"]
        assert store.job_spans(since=T0, until=T0 + 2 * H) == [("llm-a", 2, T0, T0 + 2 * H)]
        store.insert_steps(_steps("llm-a", ["gpu-a3"], T0 + 3 * H, T0 + 4 * H, 60.0))   # the view: new rows
        assert store.job_spans(since=T0, until=T0 + 4 * H) == [("llm-a", 3, T0, T0 + 4 * H)]
