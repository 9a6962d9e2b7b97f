"""Fault injection for proving detection: corrupt one element, one memory bit, or the timing.

Used only by the self-test harness (``fleethealth selftest --inject-fault KIND`` and the tests);
no production path takes a :class:`Fault`. Each test asks the fault to act at its own point:
a GEMM test flips one bit of its output after the product (:meth:`Fault.flip_element`), a memory
test lets the fault corrupt the buffer between writing a pattern and reading it back
(:meth:`Fault.corrupt_memory`: a one-off flip, or a bit stuck at 0/1 on every pass), a
collective corrupts one rank's contribution, and ``slow`` stretches every measured duration by
:attr:`Fault.slow_factor` so throughput falls below the baseline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from fleethealth.errors import ConfigError
from fleethealth.kernels.backend import raw_bits

__all__ = ["FaultKind", "Fault", "Injected", "flip_bit"]


class FaultKind(StrEnum):
    BITFLIP = "bitflip"
    STUCK_BIT = "stuck-bit"
    SLOW = "slow"


@dataclass(frozen=True)
class Injected:
    """Where a fault was put: flat element (or word) ``index`` and ``bit`` of array ``where``."""

    where: str
    index: int
    bit: int


def flip_bit(xp: Any, arr: Any, index: int, bit: int) -> None:
    """Flip bit ``bit`` of flat element ``index`` of ``arr`` in place (NumPy or CuPy)."""
    words = raw_bits(arr).reshape(-1)
    width = words.dtype.itemsize * 8
    if not 0 <= bit < width:
        raise ConfigError(f"bit {bit} outside a {width}-bit element")
    if not 0 <= index < words.size:
        raise ConfigError(f"element {index} outside an array of {words.size}")
    words[index] ^= words.dtype.type(1 << bit)


@dataclass
class Fault:
    """One injected fault of ``kind``; positions come from a generator seeded by ``seed``.

    ``injected`` records every corruption made, so a test can check the report names it.
    """

    kind: FaultKind
    seed: int = 0
    slow_factor: float = 1.25
    stuck_value: int = 1
    injected: list[Injected] = field(default_factory=list)
    _rng: np.random.Generator = field(init=False, repr=False)
    _stuck: tuple[int, int] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.kind = FaultKind(self.kind)
        if self.slow_factor <= 1.0:
            raise ConfigError(f"slow_factor must be > 1, got {self.slow_factor}")
        self._rng = np.random.default_rng(self.seed)

    @classmethod
    def parse(cls, kind: str | None, seed: int = 0) -> Fault | None:
        if kind is None:
            return None
        try:
            return cls(FaultKind(kind), seed=seed)
        except ValueError:
            known = ", ".join(k.value for k in FaultKind)
            raise ConfigError(f"unknown fault {kind!r} (known: {known})") from None

    # ------------------------------------------------------------ timing
    def stretch(self, seconds: float) -> float:
        """A measured duration as the test should see it (longer under ``slow``)."""
        return seconds * self.slow_factor if self.kind is FaultKind.SLOW else seconds

    # ------------------------------------------------------------ one element
    def flip_element(self, xp: Any, arr: Any, where: str, *, bit: int | None = None,
                     index: int | None = None) -> Injected | None:
        """Under ``bitflip``, flip one bit of one element of ``arr`` (random unless given)."""
        if self.kind is not FaultKind.BITFLIP:
            return None
        width = arr.dtype.itemsize * 8
        index = int(self._rng.integers(arr.size)) if index is None else int(index)
        bit = int(self._rng.integers(width)) if bit is None else int(bit)
        flip_bit(xp, arr, index, bit)
        hit = Injected(where, index, bit)
        self.injected.append(hit)
        return hit

    # ------------------------------------------------------------ memory cells
    def corrupt_memory(self, xp: Any, words: Any, pass_index: int) -> None:
        """Corrupt a memory buffer between a pattern's write and its read-back.

        ``bitflip``: one random bit of one random word flips, on the first pass only (a transient
        upset). ``stuck-bit``: one bit of one word reads as :attr:`stuck_value` on every pass (a
        stuck cell), so only patterns that write the opposite value there can see it.
        """
        if self.kind is FaultKind.BITFLIP and pass_index == 0:
            index = int(self._rng.integers(words.size))
            bit = int(self._rng.integers(words.dtype.itemsize * 8))
            flip_bit(xp, words, index, bit)
            self.injected.append(Injected("memory", index, bit))
        elif self.kind is FaultKind.STUCK_BIT:
            if self._stuck is None:
                self._stuck = (int(self._rng.integers(words.size)), int(self._rng.integers(64)))
                self.injected.append(Injected("memory", *self._stuck))
            index, bit = self._stuck
            flat = words.reshape(-1)
            mask = flat.dtype.type(1 << bit)
            if self.stuck_value:
                flat[index] |= mask
            else:
                flat[index] &= ~mask
