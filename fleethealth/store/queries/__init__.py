"""Every named application query of fleethealth, and only here: one module a caller.

:class:`NamedQueries` holds them as methods over the small contract (``query`` / ``insert`` /
``command``); the store class mixes it in, so a caller holding a
:class:`~fleethealth.store.protocol.StoreLike` calls ``store.quarantine_row(node)`` and never
writes SQL. Each module serves one role of :mod:`fleethealth.store.protocol`:

* :mod:`~fleethealth.store.queries.detector` — ``DetectorStore``: the core tables' typed writers,
  the outbox (``outbox``: findings and recommendations stored before they are published), detector
  snapshots (``detector_snapshots``: each stream stage's state per input partition);
* :mod:`~fleethealth.store.queries.policy` — ``PolicyStore``: policy state, eviction outcomes and the
  fleet breaker (versioned rows), the quarantine book (``quarantine``, ``quarantine_log``);
* :mod:`~fleethealth.store.queries.api` and :mod:`~fleethealth.store.queries.report` —
  ``ApiStore``: the core tables read back as schema messages, the node and run views; the report's
  aggregates and the long ranges that read the 1-minute rollup;
* :mod:`~fleethealth.store.queries.ops` — ``OpsStore``: self-test baselines, what the benches measure;
* :mod:`~fleethealth.store.queries.sql` — what they share (the contract they are written over, two
  SQL fragments).

The only other SQL is the analyst's own, through :mod:`fleethealth.api.sqlgate` (and
``fleethealth query``), and the migrations in ``deploy/clickhouse/``. Times are event time in
epoch seconds.
"""

from __future__ import annotations

from fleethealth.store.queries.api import ApiQueries
from fleethealth.store.queries.detector import DetectorQueries
from fleethealth.store.queries.ops import OpsQueries
from fleethealth.store.queries.policy import QUARANTINE_COLUMNS, PolicyQueries
from fleethealth.store.queries.report import ROLLUP_AFTER_S, ReportQueries

__all__ = ["NamedQueries", "QUARANTINE_COLUMNS", "ROLLUP_AFTER_S", "ApiQueries", "DetectorQueries", "OpsQueries",
           "PolicyQueries", "ReportQueries"]


class NamedQueries(DetectorQueries, PolicyQueries, ApiQueries, ReportQueries, OpsQueries):
    """The named queries, as methods of a store that has ``query``, ``insert`` and ``command``."""
