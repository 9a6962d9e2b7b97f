"""``--source none``: no telemetry at all, for a CPU box (or a node whose GPUs another agent watches).

The probe then only relays what the training processes send on its socket: step timings
(``fh.steps``) and in-job events (``fh.events``). Nothing is invented: ``--source sim`` plays a
simulated node, and its telemetry would end up in real findings' evidence.
"""

from __future__ import annotations

__all__ = ["NoSource"]


class NoSource:
    """A source that never has a sample (:meth:`sample` returns ``None``: the probe publishes no
    ``fh.telemetry`` message and counts no sample)."""

    name = "none"

    def __init__(self, node: str, rack: str = "") -> None:
        self.node = node
        self.rack = rack

    def open(self) -> None:
        """Nothing to open."""

    def sample(self, ts: float) -> None:
        return None

    def close(self) -> None:
        """Nothing to close."""
