"""Memory pattern tests over device memory (CuPy RawKernels in ``memory.cu``) or host memory (NumPy).

A buffer of 64-bit words is written with a pattern whose value for word i is known, read back and
compared; every mismatch is reported by byte offset, virtual address and the bits that differ.
The patterns (after memtest86 and the CUDA GPU memory testers):

* ``walking_ones`` / ``walking_zeros``: 64 passes; in pass s word i holds 1 << ((i + s) mod 64)
  (or its complement), so every bit of every word is written 1 (or 0) once while its neighbours
  hold the opposite.
* ``checkerboard``: 0x5555… on even and 0xAAAA… on odd words, then inverted.
* ``address_in_address``: each word holds its own byte offset, then the complement (catches
  address-line faults that make two addresses alias).
* ``moving_inversions``: fill with p; ascending, check each word and write ~p; descending, check
  ~p and write p; check p. Rounds for p = 0 and p = 0x5555…. (On the CPU path the sweep moves
  block by block, each block vectorised; on a GPU the grid-stride order is the kernel's.)

The same pattern arithmetic (``_expected``) serves both paths, and the CUDA source mirrors it.
Bandwidth is the bytes written and read over the pattern's time, in GB/s (1e9 bytes/s).
"""

from __future__ import annotations

import functools
import importlib.resources
import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from fleethealth.errors import ConfigError
from fleethealth.kernels.backend import Backend
from fleethealth.kernels.faults import Fault
from fleethealth.kernels.results import MAX_REPORTED, Mismatch, SelfTestResult, Verdict, bits_of

__all__ = ["Pattern", "MemoryScan", "MemoryTester", "run_memory", "expected_words"]

_CONST, _WALK1, _WALK0, _CHECKER, _ADDRESS = range(5)
_ALL1 = 0xFFFF_FFFF_FFFF_FFFF
_FIVES = 0x5555_5555_5555_5555
_WORD = 8
_PERIOD = 64


class Pattern(StrEnum):
    WALKING_ONES = "walking_ones"
    WALKING_ZEROS = "walking_zeros"
    CHECKERBOARD = "checkerboard"
    ADDRESS = "address_in_address"
    MOVING_INVERSIONS = "moving_inversions"


@dataclass(frozen=True)
class _Check:
    """Read every word expecting (kind, p); optionally then write (wkind, wp); in ``descending`` order."""

    kind: int
    p: int
    rewrite: tuple[int, int] | None = None
    descending: bool = False


@dataclass(frozen=True)
class _Phase:
    label: str
    fill: tuple[int, int] | None
    checks: tuple[_Check, ...]


def _schedule(pattern: Pattern) -> list[_Phase]:
    if pattern is Pattern.WALKING_ONES:
        return [_Phase(f"walking one {s}", (_WALK1, s), (_Check(_WALK1, s),)) for s in range(_PERIOD)]
    if pattern is Pattern.WALKING_ZEROS:
        return [_Phase(f"walking zero {s}", (_WALK0, s), (_Check(_WALK0, s),)) for s in range(_PERIOD)]
    if pattern is Pattern.CHECKERBOARD:
        return [_Phase(f"checkerboard {p:#x}", (_CHECKER, p), (_Check(_CHECKER, p),))
                for p in (_FIVES, ~_FIVES & _ALL1)]
    if pattern is Pattern.ADDRESS:
        return [_Phase(f"address xor {p:#x}", (_ADDRESS, p), (_Check(_ADDRESS, p),)) for p in (0, _ALL1)]
    phases = []
    for p in (0, _FIVES):
        q = ~p & _ALL1
        phases.append(_Phase(f"moving inversions {p:#x}", (_CONST, p), (
            _Check(_CONST, p, rewrite=(_CONST, q)),
            _Check(_CONST, q, rewrite=(_CONST, p), descending=True),
            _Check(_CONST, p),
        )))
    return phases


def expected_words(kind: int, p: int, start: int, count: int) -> np.ndarray:
    """Expected values of words ``start .. start+count`` for pattern ``kind`` with parameter ``p``
    (the same arithmetic as ``fh_expected`` in ``memory.cu``)."""
    return _values(kind, p, np.arange(start, start + count, dtype=np.uint64))


def _values(kind: int, p: int, i: np.ndarray) -> np.ndarray:
    p64 = np.uint64(p & _ALL1)
    if kind == _CONST:
        return np.full(i.shape, p64, dtype=np.uint64)
    if kind in (_WALK1, _WALK0):
        one = np.left_shift(np.uint64(1), (i + p64) & np.uint64(63))
        return one if kind == _WALK1 else ~one
    if kind == _CHECKER:
        return np.where((i & np.uint64(1)) == 1, ~p64, p64).astype(np.uint64)
    if kind == _ADDRESS:
        return (i * np.uint64(_WORD)) ^ p64
    raise ConfigError(f"unknown pattern kind {kind}")


@dataclass(frozen=True, eq=False)
class MemoryScan:
    """Every mismatch of one pattern (up to the tester's ``max_errors``).

    ``offsets`` are byte offsets into the buffer (uint64, shape (e,)), ``expected`` / ``observed``
    the words (uint64), ``phases`` the pattern step that saw each one; ``total`` counts all
    mismatches, including those beyond the cap. ``bytes_moved`` / ``seconds`` give the bandwidth.
    """

    pattern: Pattern
    base_address: int
    offsets: np.ndarray
    expected: np.ndarray
    observed: np.ndarray
    phases: tuple[str, ...]
    total: int
    bytes_moved: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes_moved / self.seconds / 1e9 if self.seconds > 0 else math.inf

    def mismatches(self, limit: int = MAX_REPORTED) -> tuple[Mismatch, ...]:
        out = []
        for off, exp, obs, phase in zip(self.offsets[:limit].tolist(), self.expected[:limit].tolist(),
                                        self.observed[:limit].tolist(), self.phases[:limit], strict=True):
            out.append(Mismatch(where="memory", offset=int(off), address=self.base_address + int(off),
                                bits=bits_of(int(exp) ^ int(obs)), expected=f"{exp:#018x}",
                                observed=f"{obs:#018x}", detail=phase))
        return tuple(out)


@dataclass
class _Errors:
    cap: int
    index: list[np.ndarray] = field(default_factory=list)
    expected: list[np.ndarray] = field(default_factory=list)
    observed: list[np.ndarray] = field(default_factory=list)
    phases: list[str] = field(default_factory=list)
    total: int = 0

    def add(self, chk: _Check, index: np.ndarray, observed: np.ndarray, count: int, phase: str) -> None:
        room = max(0, self.cap - sum(len(x) for x in self.index))
        index = index[:room].astype(np.uint64)
        self.index.append(index)
        self.expected.append(_values(chk.kind, chk.p, index))
        self.observed.append(observed[:room].astype(np.uint64))
        self.phases.extend([phase] * min(room, len(index)))
        self.total += count


class _HostOps:
    """The patterns over a NumPy buffer, block by block (``block`` words, a multiple of 64), each block
    viewed as rows of 64 words so the periodic patterns compare against one broadcast row."""

    def __init__(self, block: int, max_errors: int) -> None:
        self.block = block
        self.max_errors = max_errors

    def _blocks(self, size: int, descending: bool = False) -> list[int]:
        starts = list(range(0, size, self.block))
        return starts[::-1] if descending else starts

    @staticmethod
    def _want(kind: int, p: int, start: int, count: int) -> np.ndarray:
        if kind == _ADDRESS:
            return expected_words(kind, p, start, count).reshape(-1, _PERIOD)
        return expected_words(kind, p, 0, _PERIOD).reshape(1, _PERIOD)

    def fill(self, buf: np.ndarray, kind: int, p: int) -> None:
        for s in self._blocks(buf.size):
            e = min(buf.size, s + self.block)
            buf[s:e].reshape(-1, _PERIOD)[...] = self._want(kind, p, s, e - s)

    def check(self, buf: np.ndarray, chk: _Check) -> tuple[np.ndarray, np.ndarray, int]:
        """Mismatches as (word indices, observed words, total count); at most ``max_errors`` are kept,
        the rest only counted, so a dead region cannot exhaust host memory."""
        found_i, found_o, total, room = [], [], 0, self.max_errors
        for s in self._blocks(buf.size, chk.descending):
            e = min(buf.size, s + self.block)
            rows = buf[s:e].reshape(-1, _PERIOD)
            bad = rows != self._want(chk.kind, chk.p, s, e - s)
            if bad.any():
                where = np.flatnonzero(bad)
                total += int(where.size)
                if room > 0:
                    where = where[:room]
                    room -= int(where.size)
                    found_i.append(where.astype(np.uint64) + np.uint64(s))
                    found_o.append(rows.reshape(-1)[where].copy())
            if chk.rewrite is not None:
                rows[...] = self._want(*chk.rewrite, s, e - s)
        if not found_i:
            return np.empty(0, np.uint64), np.empty(0, np.uint64), total
        return np.concatenate(found_i), np.concatenate(found_o), total


@functools.lru_cache(maxsize=4)
def _cuda_module(cp: Any) -> Any:
    source = importlib.resources.files("fleethealth.kernels").joinpath("memory.cu").read_text(encoding="utf-8")
    return cp.RawModule(code=source, options=("-std=c++11",))


class _CudaOps:
    """The same patterns by the RawKernels of ``memory.cu`` on the current device."""

    def __init__(self, backend: Backend, max_errors: int) -> None:
        cp = backend.xp
        self.cp = cp
        module = _cuda_module(cp)
        self._fill = module.get_function("fh_fill")
        self._check = module.get_function("fh_check")
        sms = cp.cuda.runtime.getDeviceProperties(backend.index)["multiProcessorCount"]
        self.grid = (int(sms) * 8,)
        self.block = (256,)
        self.max_errors = max_errors
        self.count = cp.zeros(1, dtype=cp.uint64)
        self.index = cp.zeros(max_errors, dtype=cp.uint64)
        self.observed = cp.zeros(max_errors, dtype=cp.uint64)

    def fill(self, buf: Any, kind: int, p: int) -> None:
        self._fill(self.grid, self.block, (buf, np.uint64(buf.size), np.int32(kind), np.uint64(p & _ALL1)))

    def check(self, buf: Any, chk: _Check) -> tuple[np.ndarray, np.ndarray, int]:
        self.count.fill(0)
        wkind, wp = chk.rewrite if chk.rewrite is not None else (0, 0)
        self._check(self.grid, self.block, (
            buf, np.uint64(buf.size), np.int32(chk.kind), np.uint64(chk.p & _ALL1),
            np.int32(chk.rewrite is not None), np.int32(wkind), np.uint64(wp & _ALL1), np.int32(chk.descending),
            self.count, self.index, self.observed, np.uint64(self.max_errors)))
        total = int(self.count.get()[0])
        kept = min(total, self.max_errors)
        return self.index[:kept].get(), self.observed[:kept].get(), total


class MemoryTester:
    """Runs patterns over a buffer of ``nbytes`` (rounded down to a multiple of 512 bytes) on one device.

    ``fault`` (harness only) corrupts the buffer between each write and the read that follows.
    """

    def __init__(self, backend: Backend, nbytes: int, *, fault: Fault | None = None,
                 block_words: int = 1 << 18, max_errors: int = 1 << 16) -> None:
        words = (int(nbytes) // _WORD) // _PERIOD * _PERIOD
        if words < _PERIOD:
            raise ConfigError(f"memory test needs at least {_PERIOD * _WORD} bytes, got {nbytes}")
        if block_words % _PERIOD:
            raise ConfigError(f"block_words must be a multiple of {_PERIOD}")
        self.backend = backend
        self.fault = fault
        self.max_errors = max_errors
        with backend.activate():  # buffer, error slots and kernels all on this device
            self.words = backend.xp.empty(words, dtype=backend.xp.uint64)
            self.ops: _HostOps | _CudaOps = (_CudaOps(backend, max_errors) if backend.is_gpu
                                             else _HostOps(block_words, max_errors))
        self._passes = 0

    @property
    def nbytes(self) -> int:
        return int(self.words.size) * _WORD

    @property
    def base_address(self) -> int:
        return int(self.words.data.ptr) if self.backend.is_gpu else int(self.words.ctypes.data)

    def scan(self, pattern: Pattern) -> MemoryScan:
        """Run one pattern over the whole buffer; return every mismatch (up to ``max_errors``)."""
        pattern = Pattern(pattern)
        errors = _Errors(self.max_errors)
        moved = 0
        seconds = 0.0
        nbytes = self.nbytes
        with self.backend.activate():
            for phase in _schedule(pattern):
                if phase.fill is not None:
                    _, took = self.backend.timed(lambda ph=phase: self.ops.fill(self.words, *ph.fill))
                    seconds += took
                    moved += nbytes
                for chk in phase.checks:
                    if self.fault is not None:
                        self.fault.corrupt_memory(self.backend.xp, self.words, self._passes)
                    self._passes += 1
                    (idx, obs, count), took = self.backend.timed(lambda c=chk: self.ops.check(self.words, c))
                    seconds += took
                    moved += nbytes * (2 if chk.rewrite is not None else 1)
                    if count:
                        errors.add(chk, np.asarray(idx), np.asarray(obs), count, phase.label)
        empty = np.empty(0, np.uint64)
        index = np.concatenate(errors.index) if errors.index else empty
        expected = np.concatenate(errors.expected) if errors.expected else empty
        observed = np.concatenate(errors.observed) if errors.observed else empty
        if self.fault is not None:
            seconds = self.fault.stretch(seconds)
        return MemoryScan(pattern=pattern, base_address=self.base_address, offsets=index * np.uint64(_WORD),
                          expected=expected, observed=observed, phases=tuple(errors.phases), total=errors.total,
                          bytes_moved=moved, seconds=seconds)

def run_memory(backend: Backend, nbytes: int, *, patterns: tuple[Pattern, ...] = tuple(Pattern),
               suite: str = "adhoc", fault: Fault | None = None) -> list[SelfTestResult]:
    """One :class:`SelfTestResult` per pattern over ``nbytes`` of ``backend``'s memory (GB/s)."""
    tester = MemoryTester(backend, nbytes, fault=fault)
    results = []
    for pattern in patterns:
        scan = tester.scan(pattern)
        results.append(SelfTestResult(
            suite=suite, test=f"memory_{Pattern(pattern).value}", device=backend.device,
            verdict=Verdict.FAIL if scan.total else Verdict.PASS, duration_s=scan.seconds, throughput=scan.gbps,
            unit="GB/s", max_error=_worst_bits(scan),
            mismatches=scan.mismatches(), mismatch_total=scan.total, model=backend.model,
            detail=f"{tester.nbytes} bytes at {tester.base_address:#x}",
            extra={"nbytes": tester.nbytes, "base_address": tester.base_address}))
    return results


def _worst_bits(scan: MemoryScan) -> float:
    """Most bits wrong in one word (a memory test's ``max_error``)."""
    if scan.expected.size == 0:
        return 0.0
    return float(max(bin(int(x)).count("1") for x in (scan.expected ^ scan.observed).tolist()))
