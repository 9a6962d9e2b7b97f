"""Rows stamped with event time over a window: two arrays a key, not a Python object a row.

The node stage keeps, per node, a window of recent rows: the failure predictor a row of counters a
minute for six hours, the health rules the NVLink error counters over their window, the node-state
table the power-cap bits of the states it published. As a deque of per-row tuples of arrays, a
node's window would be hundreds of small objects (a 6-hour predictor history 361 arrays, a 600 s
power-cap window 1,200), each a header in memory and an entry in a snapshot's manifest
(``bench/node_state.py`` measured a snapshot's dump at 23.4 ms a node that way, 1.3 ms this way).
:class:`TimeRows` holds them as two arrays, ``ts`` (n,) and ``rows`` (n, *shape), oldest first.
"""

from __future__ import annotations

import numpy as np

from fleethealth.detectors.state import StateError

__all__ = ["TimeRows"]


class TimeRows:
    """Rows of one shape and dtype stamped with event time, oldest first.

    ``ts`` and ``rows`` are views of buffers that grow by doubling to what the window holds and are
    then reused in place: rows that leave shift the rest down. Times are appended in increasing order
    (the callers drop a stale sample before). The buffers are not state (``_state_skip``): a state
    holds the views, and a restored object rebuilds its buffers from them, checking that the rows fit
    the times (a :class:`~fleethealth.detectors.state.StateError` if not).
    """

    _state_skip = ("ts_buf", "rows_buf")

    def __init__(self, shape: tuple[int, ...] = (), dtype: np.dtype | type = np.float64, capacity: int = 4) -> None:
        self.ts_buf = np.empty(max(capacity, 1))
        self.rows_buf = np.empty((max(capacity, 1), *shape), dtype=dtype)
        self.ts = self.ts_buf[:0]
        self.rows = self.rows_buf[:0]

    def __len__(self) -> int:
        return self.ts.size

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of one row."""
        return self.rows_buf.shape[1:]

    def append(self, ts: float, row: np.ndarray) -> None:
        """Add ``row`` at event time ``ts`` (after every row held)."""
        n = self.ts.size
        if n == self.ts_buf.size:
            self.ts_buf = np.concatenate([self.ts, np.empty(n)])
            self.rows_buf = np.concatenate([self.rows, np.empty_like(self.rows)])
        self.ts_buf[n] = ts
        self.rows_buf[n] = row
        self.ts = self.ts_buf[:n + 1]
        self.rows = self.rows_buf[:n + 1]

    def drop(self, count: int) -> None:
        """Drop the ``count`` oldest rows."""
        n = self.ts.size
        count = min(max(int(count), 0), n)
        if count:
            self.ts_buf[:n - count] = self.ts_buf[count:n]
            self.rows_buf[:n - count] = self.rows_buf[count:n]
            self.ts = self.ts_buf[:n - count]
            self.rows = self.rows_buf[:n - count]

    def drop_before(self, start: float) -> None:
        """Drop the rows older than ``start``."""
        self.drop(int(np.searchsorted(self.ts, start, side="left")))

    def keep_covering(self, start: float, *, least: int = 1) -> None:
        """Drop the rows older than the newest one at or before ``start`` (which covers ``start``: it holds
        until the next), leaving at least ``least`` rows."""
        at_or_before = int(np.searchsorted(self.ts, start, side="right"))
        self.drop(min(at_or_before - 1, self.ts.size - least))

    def _state_restored(self, like: object) -> None:
        ts, rows = getattr(self, "ts", None), getattr(self, "rows", None)
        if not isinstance(ts, np.ndarray) or not isinstance(rows, np.ndarray) or ts.dtype != np.float64 \
                or ts.ndim != 1 or rows.ndim < 1 or rows.shape[0] != ts.size:
            raise StateError(f"TimeRows: times {getattr(ts, 'shape', type(ts).__name__)} and rows "
                             f"{getattr(rows, 'shape', type(rows).__name__)} do not pair up")
        spare = max(ts.size, 4)
        self.ts_buf = np.concatenate([ts, np.empty(spare - ts.size)])
        self.rows_buf = np.concatenate([rows, np.empty((spare - ts.size, *rows.shape[1:]), dtype=rows.dtype)])
        self.ts = self.ts_buf[:ts.size]
        self.rows = self.rows_buf[:ts.size]
