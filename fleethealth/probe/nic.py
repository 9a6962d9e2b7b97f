"""The NIC source: InfiniBand / RoCE port counters and Ethernet statistics from sysfs.

What a GPU node's NICs say about the network, read where the kernel puts it (``root`` is the
file-system root, ``/`` on a node, the host's root mounted into a pod, or a fixture tree):

- InfiniBand and RoCE ports, ``sys/class/infiniband/<dev>/ports/<p>/``: ``state`` (``4: ACTIVE``)
  and ``rate`` (``400 Gb/sec (4X NDR)``); ``counters/`` with ``port_xmit_data`` and
  ``port_rcv_data`` (in 4-byte words: the IB PMA counts octets divided by four), ``port_xmit_wait``
  (ticks in which the port had data to send but no flow-control credit, the congestion signal),
  ``port_rcv_errors``, ``symbol_error``, ``link_downed``, ``link_error_recovery``. A counter missing
  from ``counters/`` is looked for in ``hw_counters/`` (where some drivers keep theirs).
- Ethernet interfaces, ``sys/class/net/<if>/``: ``operstate``, ``speed`` (Mb/s; ``-1`` or an
  unreadable file while the link is down), ``carrier_down_count`` and ``statistics/`` with
  ``tx_bytes``, ``rx_bytes``, ``rx_errors``. Interfaces without a ``device`` link (loopback,
  bridges, veth pairs) are virtual and skipped unless ``virtual=True``.

:meth:`NicReader.read` returns the ports as :class:`fleethealth.schema.NicPorts`, whose counters
are monotonic totals: a counter that steps back from above 2³¹ to a small value, both below
2³², wrapped at 32 bits (an ``unsigned long`` statistic on a 32-bit kernel, a non-extended PMA
counter) and the wrap is folded in; any other step back is a reset (a driver reload, a
``perfquery -R``), counted as a restart from zero and reported once. It also keeps the rates of
the last interval (:attr:`NicReader.rates`) and the busiest up port's utilisation
(:attr:`NicReader.util`), which the probe puts in ``Telemetry.nic_util``.

Bad input never fails a sample: a counter that is missing, unreadable or not a number reads NaN
and is reported once per port and counter (:meth:`NicReader.take_problems`); the rest of the
sample is still published. A port that goes down reads ``up = 0`` and a NaN link rate.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fleethealth.schema import NIC_FIELDS, NicPorts

__all__ = ["NicReader", "PortRates", "IB_COUNTERS", "ETH_COUNTERS", "parse_ib_rate"]

IB_COUNTERS: dict[str, tuple[str, float]] = {
    "tx_bytes": ("port_xmit_data", 4.0),
    "rx_bytes": ("port_rcv_data", 4.0),
    "xmit_wait": ("port_xmit_wait", 1.0),
    "rx_errors": ("port_rcv_errors", 1.0),
    "symbol_errors": ("symbol_error", 1.0),
    "link_downed": ("link_downed", 1.0),
    "link_recovery": ("link_error_recovery", 1.0),
}
"""NIC column -> (file under ``counters/``, multiplier to the column's unit)."""
ETH_COUNTERS: dict[str, tuple[str, float]] = {
    "tx_bytes": ("statistics/tx_bytes", 1.0),
    "rx_bytes": ("statistics/rx_bytes", 1.0),
    "rx_errors": ("statistics/rx_errors", 1.0),
    "link_downed": ("carrier_down_count", 1.0),
}
"""NIC column -> (file under ``sys/class/net/<if>/``, multiplier)."""

_WRAP32 = 1 << 32


@dataclass(frozen=True, slots=True)
class PortRates:
    """One port over the last interval: bytes per second each way, utilisation of the link rate
    (the busier direction; NaN without a link rate) and the share of the interval spent waiting
    for credit (``port_xmit_wait`` ticks × ``bytes_per_tick`` over the bytes the link could have
    sent; NaN without the counter)."""

    port: str
    tx_bytes_per_s: float
    rx_bytes_per_s: float
    util: float
    xmit_wait_share: float


def parse_ib_rate(text: str) -> float:
    """``"400 Gb/sec (4X NDR)"`` -> 400.0 (Gb/s); NaN when the text has no rate."""
    head = text.strip().split(" ", 1)[0]
    try:
        value = float(head)
    except ValueError:
        return math.nan
    return value if value > 0 else math.nan


class NicReader:
    """Read every NIC port under ``root`` (see the module docstring).

    ``bytes_per_tick`` converts ``port_xmit_wait`` ticks into bytes the port could have sent
    (8 on NVIDIA Quantum-class hardware, after the ibdiagnet manual's congestion assessment).
    """

    def __init__(self, root: str | os.PathLike[str] = "/", *, virtual: bool = False,
                 bytes_per_tick: float = 8.0) -> None:
        self.root = Path(root)
        self.virtual = virtual
        self.bytes_per_tick = bytes_per_tick
        self.rates: dict[str, PortRates] = {}
        self.util = math.nan
        self._raw: dict[tuple[str, str], int] = {}
        self._total: dict[tuple[str, str], float] = {}
        self._previous: tuple[float, dict[str, np.ndarray], tuple[str, ...]] | None = None
        self._reported: set[tuple[str, str]] = set()
        self._problems: list[str] = []

    # ------------------------------------------------------------ discovery
    def _ib_ports(self) -> list[tuple[str, Path]]:
        base = self.root / "sys" / "class" / "infiniband"
        out = []
        for dev in sorted(_listdir(base)):
            for port in sorted(_listdir(base / dev / "ports"), key=lambda p: (len(p), p)):
                out.append((f"{dev}/{port}", base / dev / "ports" / port))
        return out

    def _eth_ports(self) -> list[tuple[str, Path]]:
        base = self.root / "sys" / "class" / "net"
        out = []
        for name in sorted(_listdir(base)):
            path = base / name
            if name == "lo" or (not self.virtual and not (path / "device").exists()):
                continue
            out.append((name, path))
        return out

    # ------------------------------------------------------------ one read
    def read(self, ts: float) -> NicPorts | None:
        """Every port now (``ts`` is the event time the rates are taken against); ``None`` when the
        node has no NIC this reader can see."""
        names: list[str] = []
        kinds: list[str] = []
        rows: list[dict[str, float]] = []
        for name, path in self._ib_ports():
            names.append(name)
            kinds.append("ib")
            rows.append(self._read_ib(name, path))
        for name, path in self._eth_ports():
            names.append(name)
            kinds.append("eth")
            rows.append(self._read_eth(name, path))
        if not names:
            self.rates, self.util = {}, math.nan
            return None
        cols = {c: np.array([r.get(c, math.nan) for r in rows], dtype=np.float64) for c in NIC_FIELDS}
        self._update_rates(ts, tuple(names), cols)
        return NicPorts.from_columns(names, kinds, **cols)

    def take_problems(self) -> list[str]:
        """The problems found since the last call (each port and counter reported once)."""
        out, self._problems = self._problems, []
        return out

    def _read_ib(self, name: str, path: Path) -> dict[str, float]:
        state = _read_text(path / "state")
        up = state is not None and state.strip().upper().endswith("ACTIVE")
        if state is None:
            self._problem(name, "state", f"NIC {name}: cannot read {path / 'state'}; the port is taken as down")
        rate = _read_text(path / "rate")
        row: dict[str, float] = {"up": 1.0 if up else 0.0,
                                 "link_gbps": parse_ib_rate(rate) if (up and rate is not None) else math.nan}
        for column, (file, scale) in IB_COUNTERS.items():
            target = path / "counters" / file
            if not target.exists() and (path / "hw_counters" / file).exists():
                target = path / "hw_counters" / file
            row[column] = self._counter(name, file, target, scale)
        return row

    def _read_eth(self, name: str, path: Path) -> dict[str, float]:
        state = _read_text(path / "operstate")
        up = state is not None and state.strip().lower() == "up"
        speed = _read_text(path / "speed") if up else None  # reading speed of a down link is EINVAL
        try:
            mbps = float(speed) if speed is not None else math.nan
        except ValueError:
            mbps = math.nan
        row: dict[str, float] = {"up": 1.0 if up else 0.0, "link_gbps": mbps / 1000.0 if mbps > 0 else math.nan}
        for column, (file, scale) in ETH_COUNTERS.items():
            row[column] = self._counter(name, file, path / file, scale)
        return row

    def _counter(self, port: str, counter: str, path: Path, scale: float) -> float:
        text = _read_text(path)
        if text is None:
            why = "missing" if not path.exists() else "unreadable"
            self._problem(port, counter, f"NIC {port}: counter {counter} is {why} ({path}); reported as not known")
            return math.nan
        try:
            raw = int(text.strip())
        except ValueError:
            self._problem(port, counter, f"NIC {port}: counter {counter} holds {text.strip()[:40]!r}, not a number")
            return math.nan
        if raw < 0:
            self._problem(port, counter, f"NIC {port}: counter {counter} is negative ({raw})")
            return math.nan
        key = (port, counter)
        before = self._raw.get(key)
        self._raw[key] = raw
        if before is None:
            total = float(raw)
        elif raw >= before:
            total = self._total[key] + (raw - before)
        elif before >= _WRAP32 // 2 and before < _WRAP32 and raw < before:
            total = self._total[key] + (raw + _WRAP32 - before)  # wrapped at 32 bits
        else:
            self._problem(port, f"{counter}:reset",
                          f"NIC {port}: counter {counter} went back from {before} to {raw}; taken as a reset to zero")
            total = self._total[key] + raw
        self._total[key] = total
        return total * scale

    def _problem(self, port: str, counter: str, message: str) -> None:
        key = (port, counter)
        if key in self._reported:
            return
        self._reported.add(key)
        self._problems.append(message)

    def _update_rates(self, ts: float, names: tuple[str, ...], cols: dict[str, np.ndarray]) -> None:
        previous, self._previous = self._previous, (ts, cols, names)
        self.rates, self.util = {}, math.nan
        if previous is None or previous[0] >= ts:
            return
        dt = ts - previous[0]
        before = dict(zip(previous[2], range(len(previous[2])), strict=True))
        utils = []
        for i, name in enumerate(names):
            j = before.get(name)
            if j is None:
                continue
            tx = (cols["tx_bytes"][i] - previous[1]["tx_bytes"][j]) / dt
            rx = (cols["rx_bytes"][i] - previous[1]["rx_bytes"][j]) / dt
            link = cols["link_gbps"][i] * 1e9 / 8
            util = max(tx, rx) / link if link > 0 else math.nan
            wait = (cols["xmit_wait"][i] - previous[1]["xmit_wait"][j]) * self.bytes_per_tick / (link * dt) \
                if link > 0 else math.nan
            self.rates[name] = PortRates(name, tx, rx, util, min(wait, 1.0) if not math.isnan(wait) else wait)
            if cols["up"][i] == 1.0 and not math.isnan(util):
                utils.append(min(util, 1.0))
        self.util = max(utils) if utils else math.nan


def _listdir(path: Path) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None
