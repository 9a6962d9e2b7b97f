"""Rows stamped with event time over a window: two arrays a key, not a Python object a row.

The node stage keeps, per node, a window of recent rows: the failure predictor a row of counters a
minute for six hours, the health rules the NVLink error counters over their window, the node-state
table the power-cap bits of the states it published. As a deque of per-row tuples of arrays, a
node's window would be hundreds of small objects (a 6-hour predictor history 361 arrays, a 600 s
power-cap window 1,200), each a header in memory and an entry in a snapshot's manifest
(``bench/node_state.py`` measured a snapshot's dump at 23.4 ms a node that way, 1.1 ms this way).
:class:`TimeRows` holds them as two arrays, ``ts`` (n,) and ``rows`` (n, *shape), oldest first.
"""

from __future__ import annotations

import numpy as np

from fleethealth.detectors.state import StateError

__all__ = ["TimeRows"]


class TimeRows:
    """Rows of one shape and dtype stamped with event time, oldest first.

    ``ts`` and ``rows`` are views of the live part of two buffers: rows that leave only move its start,
    and when an append reaches the buffers' end the live rows move to the front in one copy (or, when
    they fill the buffers, into buffers twice the size). So a buffer grows by doubling to what the
    window holds and is then reused in place, and neither trim nor append copies the window each time.
    Times are appended in increasing order (the callers drop a stale sample before). The buffers are
    not state (``_state_skip``): a state holds the views, and a restored object rebuilds its buffers
    from them, checking that the rows fit the times (a
    :class:`~fleethealth.detectors.state.StateError` if not).
    """

    _state_skip = ("ts_buf", "rows_buf", "start", "end")

    def __init__(self, shape: tuple[int, ...] = (), dtype: np.dtype | type = np.float64, capacity: int = 4) -> None:
        self.ts_buf = np.empty(max(capacity, 1))
        self.rows_buf = np.empty((max(capacity, 1), *shape), dtype=dtype)
        self.start = self.end = 0
        self._view()

    def __len__(self) -> int:
        return self.end - self.start

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of one row."""
        return self.rows_buf.shape[1:]

    def _view(self) -> None:
        self.ts = self.ts_buf[self.start:self.end]
        self.rows = self.rows_buf[self.start:self.end]

    def append(self, ts: float, row: np.ndarray) -> None:
        """Add ``row`` at event time ``ts`` (after every row held)."""
        if self.end == self.ts_buf.size:
            live = self.end - self.start
            if live == self.ts_buf.size:  # full: twice the room
                self.ts_buf = np.concatenate([self.ts_buf, np.empty(live)])
                self.rows_buf = np.concatenate([self.rows_buf, np.empty_like(self.rows_buf)])
            else:  # the rows that left make the room: the live ones to the front
                self.ts_buf[:live] = self.ts_buf[self.start:self.end]
                self.rows_buf[:live] = self.rows_buf[self.start:self.end]
                self.start, self.end = 0, live
        self.ts_buf[self.end] = ts
        self.rows_buf[self.end] = row
        self.end += 1
        self._view()

    def drop(self, count: int) -> None:
        """Drop the ``count`` oldest rows."""
        count = min(max(int(count), 0), self.end - self.start)
        if count:
            self.start += count
            self._view()

    def drop_before(self, start: float) -> None:
        """Drop the rows older than ``start``."""
        self.drop(int(np.searchsorted(self.ts, start, side="left")))

    def keep_covering(self, start: float, *, least: int = 1) -> None:
        """Drop the rows older than the newest one at or before ``start`` (which covers ``start``: it holds
        until the next), leaving at least ``least`` rows."""
        n, first, ts = self.end - self.start, self.start, self.ts_buf
        if n <= least or ts[first + 1] > start:  # the common cases, a sample at a time: nothing leaves,
            return
        if n <= least + 1 or ts[first + 2] > start:  # or one row
            self.drop(1)
            return
        at_or_before = int(np.searchsorted(self.ts, start, side="right"))
        self.drop(min(at_or_before - 1, n - least))

    def _state_restored(self, like: object) -> None:
        ts, rows = getattr(self, "ts", None), getattr(self, "rows", None)
        if not isinstance(ts, np.ndarray) or not isinstance(rows, np.ndarray) or ts.dtype != np.float64 \
                or ts.ndim != 1 or rows.ndim < 1 or rows.shape[0] != ts.size or rows.dtype.kind not in "biuf":
            raise StateError(f"TimeRows: times {getattr(ts, 'shape', type(ts).__name__)} and rows "
                             f"{getattr(rows, 'shape', type(rows).__name__)} do not pair up as numbers")
        spare = max(ts.size, 4)
        self.ts_buf = np.concatenate([ts, np.empty(spare - ts.size)])
        self.rows_buf = np.concatenate([rows, np.empty((spare - ts.size, *rows.shape[1:]), dtype=rows.dtype)])
        self.start, self.end = 0, ts.size
        self._view()
