"""Collective known-answer tests: all-reduce and all-gather of rank-dependent integers, bitwise.

Rank r contributes x_r[i] = ((7·i + 31·r) mod 509) − 254, integers of magnitude <= 254 held in
float32. Every partial sum of W contributions is an integer of magnitude <= 254·W < 2^24, so the
all-reduce sum is exact in any reduction order (ring, tree, NCCL's chunking) and the result must
equal Σ_r x_r **bitwise**; the all-gather result must hold every x_s in slot s bitwise.

**Naming the rank.** A wrong slot s of the all-gather is rank s's contribution. When the
all-reduce result is wrong, the contributions each rank actually used are all-gathered and
compared with the known x_s: a rank whose contribution differs is named; if every contribution is
right, the ranks that received a wrong result are named instead (a fault in the reduction itself).

**Bus bandwidth** follows nccl-tests: all-reduce busbw = (bytes / t) · 2(W−1)/W; all-gather
busbw = (W · bytes / t) · (W−1)/W, in GB/s.

Two transports: CPU processes with torch's gloo backend (:func:`run_gloo`, one subprocess per
rank, rendezvous through a file), and the local GPUs with NCCL through CuPy (:func:`run_nccl`,
one process driving every device). ``torch`` and ``cupy`` are imported inside the functions that use them.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from fleethealth.errors import ConfigError, DeviceError
from fleethealth.kernels.faults import Fault, FaultKind, Injected
from fleethealth.kernels.results import MAX_REPORTED, Mismatch, SelfTestResult, Verdict, bits_of

__all__ = ["contribution", "expected_sum", "bus_bandwidth", "RankReport", "run_gloo", "run_nccl", "merge_reports"]

_MOD = 509
_OFFSET = 254


def contribution(rank: int, elements: int) -> np.ndarray:
    """Rank ``rank``'s known contribution (float32, shape (elements,))."""
    i = np.arange(elements, dtype=np.int64)
    return (((7 * i + 31 * rank) % _MOD) - _OFFSET).astype(np.float32)


def expected_sum(world: int, elements: int) -> np.ndarray:
    """Σ_r contribution(r), computed in int64 and exact in float32 for world < 66,000."""
    if world * _OFFSET >= 1 << 24:
        raise ConfigError(f"world size {world} too large for an exact float32 sum")
    i = np.arange(elements, dtype=np.int64)
    total = np.zeros(elements, dtype=np.int64)
    for r in range(world):
        total += ((7 * i + 31 * r) % _MOD) - _OFFSET
    return total.astype(np.float32)


def bus_bandwidth(op: str, nbytes: int, world: int, seconds: float) -> float:
    """nccl-tests bus bandwidth in GB/s; ``nbytes`` is one rank's contribution."""
    if seconds <= 0:
        return math.inf
    if op == "all_reduce":
        return nbytes / seconds * 2 * (world - 1) / world / 1e9
    if op == "all_gather":
        return world * nbytes / seconds * (world - 1) / world / 1e9
    raise ConfigError(f"unknown collective {op!r}")


def _diff(observed: np.ndarray, expected: np.ndarray, limit: int = MAX_REPORTED) -> list[list[int]]:
    """[[index, expected_bits, observed_bits], ...] for the first ``limit`` bitwise mismatches."""
    ob = observed.view(np.uint32)
    ex = expected.view(np.uint32)
    idx = np.flatnonzero(ob != ex)
    return [[int(i), int(ex[i]), int(ob[i])] for i in idx[:limit]] + ([[-1, int(idx.size), 0]] if idx.size else [])


@dataclass(frozen=True)
class RankReport:
    """What one rank saw: bitwise mismatches of its all-reduce result, of each all-gather slot, and
    (after a wrong all-reduce) of each rank's actual contribution; plus its timings.

    Mismatch lists are ``[index, expected_bits, observed_bits]`` triples, the last one
    ``[-1, total, 0]`` carrying the total count.
    """

    rank: int
    world: int
    elements: int
    all_reduce: list[list[int]]
    all_gather: dict[int, list[list[int]]]
    contributions: dict[int, list[list[int]]]
    all_reduce_s: float
    all_gather_s: float

    def to_obj(self) -> dict[str, Any]:
        return {"rank": self.rank, "world": self.world, "elements": self.elements, "all_reduce": self.all_reduce,
                "all_gather": {str(k): v for k, v in self.all_gather.items()},
                "contributions": {str(k): v for k, v in self.contributions.items()},
                "all_reduce_s": self.all_reduce_s, "all_gather_s": self.all_gather_s}

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> RankReport:
        return cls(rank=obj["rank"], world=obj["world"], elements=obj["elements"], all_reduce=obj["all_reduce"],
                   all_gather={int(k): v for k, v in obj["all_gather"].items()},
                   contributions={int(k): v for k, v in obj["contributions"].items()},
                   all_reduce_s=obj["all_reduce_s"], all_gather_s=obj["all_gather_s"])


def _count(diffs: list[list[int]]) -> int:
    return diffs[-1][1] if diffs and diffs[-1][0] == -1 else 0


def _mismatches(diffs: list[list[int]], rank: int, detail: str) -> list[Mismatch]:
    out = []
    for index, exp, obs in diffs:
        if index < 0:
            continue
        out.append(Mismatch(where="rank", rank=rank, index=index, bits=bits_of(exp ^ obs),
                            expected=float(np.uint32(exp).view(np.float32)),
                            observed=_float_or_str(np.uint32(obs).view(np.float32)), detail=detail))
    return out


def _float_or_str(x: np.floating) -> float | str:
    v = float(x)
    return v if math.isfinite(v) else str(v)


def merge_reports(reports: Sequence[RankReport], *, suite: str, device: str, model: str,
                  fault: Fault | None = None) -> list[SelfTestResult]:
    """Combine every rank's report into one result per collective, naming culprit ranks."""
    world = reports[0].world
    nbytes = reports[0].elements * 4
    results = []
    gather_bad: list[Mismatch] = []
    gather_total = 0
    for rep in reports:
        for slot, diffs in sorted(rep.all_gather.items()):
            gather_total += _count(diffs)
            gather_bad += _mismatches(diffs, slot, f"all_gather slot {slot} wrong at rank {rep.rank}: "
                                                   f"rank {slot}'s contribution")
    reduce_total = sum(_count(rep.all_reduce) for rep in reports)
    reduce_bad: list[Mismatch] = []
    if reduce_total:
        culprits = sorted({slot for rep in reports for slot, d in rep.contributions.items() if _count(d)})
        if culprits:
            for rep in reports[:1]:
                for slot in culprits:
                    why = f"all_reduce wrong: rank {slot}'s contribution differs from its known value"
                    reduce_bad += _mismatches(rep.contributions.get(slot, []), slot, why)
        else:
            for rep in reports:
                reduce_bad += _mismatches(rep.all_reduce, rep.rank,
                                          f"all_reduce result wrong at rank {rep.rank} (contributions correct)")
    for op, total, bad, key in (("all_reduce", reduce_total, reduce_bad, "all_reduce_s"),
                                ("all_gather", gather_total, gather_bad, "all_gather_s")):
        seconds = max(getattr(rep, key) for rep in reports)
        seconds = fault.stretch(seconds) if fault is not None else seconds
        named = sorted({m.rank for m in bad if m.rank is not None})
        results.append(SelfTestResult(
            suite=suite, test=f"collective_{op}", device=device, verdict=Verdict.FAIL if total else Verdict.PASS,
            duration_s=seconds, throughput=bus_bandwidth(op, nbytes, world, seconds), unit="GB/s",
            max_error=_max_error(bad), mismatches=tuple(bad[:MAX_REPORTED]), mismatch_total=total, model=model,
            detail=f"world={world} elements={reports[0].elements}" + (f"; ranks named {named}" if named else ""),
            extra={"world": world, "elements": reports[0].elements, "ranks_named": named}))
    return results


def _max_error(bad: list[Mismatch]) -> float:
    errs = [abs(float(m.observed) - float(m.expected)) if isinstance(m.observed, float) else math.inf
            for m in bad if isinstance(m.expected, float)]
    return max(errs, default=0.0)


# ---------------------------------------------------------------- gloo (CPU processes)
def _gloo_worker(rank: int, world: int, init_file: str, out_dir: str, elements: int, iters: int,
                 corrupt: list[int] | None, timeout_s: float) -> None:
    """One rank of :func:`run_gloo`, run as ``python -m fleethealth.kernels.collective RANK SPEC``."""
    import datetime

    import torch
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        mine = contribution(rank, elements)
        if corrupt is not None and corrupt[0] == rank:
            mine.view(np.uint32)[corrupt[1]] ^= np.uint32(1 << corrupt[2])
        want_sum = expected_sum(world, elements)
        src = torch.from_numpy(mine)
        reduce_times, gather_times = [], []
        out = None
        for _ in range(iters):
            buf = src.clone()
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buf, op=dist.ReduceOp.SUM)
            reduce_times.append(time.perf_counter() - start)
            out = buf
        reduce_diffs = _diff(out.numpy(), want_sum)
        slots = None
        for _ in range(iters):
            slots = [torch.empty(elements, dtype=torch.float32) for _ in range(world)]
            dist.barrier()
            start = time.perf_counter()
            dist.all_gather(slots, src)
            gather_times.append(time.perf_counter() - start)
        gather = {s: _diff(slots[s].numpy(), contribution(s, elements)) for s in range(world)}
        bad = torch.tensor([_count(reduce_diffs)], dtype=torch.int64)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        contributions: dict[int, list[list[int]]] = {}
        if int(bad.item()):
            used = [torch.empty(elements, dtype=torch.float32) for _ in range(world)]
            dist.all_gather(used, src)
            contributions = {s: _diff(used[s].numpy(), contribution(s, elements)) for s in range(world)}
        report = RankReport(rank=rank, world=world, elements=elements, all_reduce=reduce_diffs, all_gather=gather,
                            contributions=contributions, all_reduce_s=float(np.median(reduce_times)),
                            all_gather_s=float(np.median(gather_times)))
        Path(out_dir, f"rank{rank}.json").write_bytes(orjson.dumps(report.to_obj()))
    finally:
        dist.destroy_process_group()


def run_gloo(world: int = 3, *, elements: int = 1 << 18, iters: int = 3, suite: str = "adhoc",
             fault: Fault | None = None, corrupt_rank: int | None = None, timeout_s: float = 60.0,
             model: str = "cpu") -> list[SelfTestResult]:
    """All-reduce and all-gather across ``world`` CPU processes (torch gloo), verified bitwise.

    Under a ``bitflip`` fault (harness only) rank ``corrupt_rank`` (default the last) flips one
    random bit of its contribution; the result names that rank.
    """
    if importlib.util.find_spec("torch") is None:
        raise DeviceError("the CPU collective test needs torch (pip install 'fleethealth[injob]')")
    if world < 2:
        raise ConfigError(f"a collective test needs at least 2 ranks, got {world}")
    corrupt = None
    if fault is not None and fault.kind is FaultKind.BITFLIP:
        rank = world - 1 if corrupt_rank is None else int(corrupt_rank)
        if not 0 <= rank < world:
            raise ConfigError(f"corrupt_rank {rank} outside world of {world}")
        rng = np.random.default_rng(fault.seed)
        corrupt = (rank, int(rng.integers(elements)), int(rng.integers(32)))
        fault.injected.append(Injected(f"rank {rank}", corrupt[1], corrupt[2]))
    with tempfile.TemporaryDirectory(prefix="fh-gloo-") as tmp:
        spec = {"world": world, "init_file": f"{tmp}/rendezvous", "out_dir": tmp, "elements": elements,
                "iters": iters, "corrupt": corrupt, "timeout_s": timeout_s}
        procs = [subprocess.Popen([sys.executable, "-m", "fleethealth.kernels.collective", str(rank),
                                   orjson.dumps(spec).decode()], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                 for rank in range(world)]
        failures = []
        deadline = time.monotonic() + timeout_s + 60.0
        for rank, proc in enumerate(procs):
            try:
                _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for other in procs:
                    other.kill()
                raise DeviceError(f"gloo collective test timed out after {timeout_s + 60.0:.0f} s") from None
            if proc.returncode != 0:
                lines = err.decode(errors="replace").strip().splitlines()
                failures.append(f"rank {rank} exited {proc.returncode}: {lines[-1] if lines else ''}")
        if failures:
            raise DeviceError("gloo collective test failed to run: " + "; ".join(failures))
        reports = [RankReport.from_obj(orjson.loads(Path(tmp, f"rank{r}.json").read_bytes())) for r in range(world)]
    return merge_reports(reports, suite=suite, device="cpu", model=model, fault=fault)


# ---------------------------------------------------------------- NCCL (local GPUs, via CuPy)
def run_nccl(devices: Sequence[int], *, elements: int = 1 << 24, iters: int = 5, suite: str = "adhoc",
             fault: Fault | None = None, model: str = "") -> list[SelfTestResult]:
    """All-reduce and all-gather across the local GPUs ``devices`` with NCCL, verified bitwise."""
    from fleethealth.kernels.backend import _cupy

    cp = _cupy()
    try:
        from cupy.cuda import nccl
    except ImportError as exc:
        raise DeviceError("CuPy was built without NCCL; the GPU collective test needs it") from exc
    world = len(devices)
    if world < 2:
        raise DeviceError(f"the GPU collective test needs at least 2 GPUs, got {world}")
    corrupt = None
    if fault is not None and fault.kind is FaultKind.BITFLIP:
        rng = np.random.default_rng(fault.seed)
        corrupt = (world - 1, int(rng.integers(elements)), int(rng.integers(32)))
        fault.injected.append(Injected(f"rank {corrupt[0]}", corrupt[1], corrupt[2]))
    comms = nccl.NcclCommunicator.initAll(list(devices))
    send, recv, gath, streams = [], [], [], []
    for r, dev in enumerate(devices):
        with cp.cuda.Device(dev):
            host = contribution(r, elements)
            if corrupt is not None and corrupt[0] == r:
                host.view(np.uint32)[corrupt[1]] ^= np.uint32(1 << corrupt[2])
            send.append(cp.asarray(host))
            recv.append(cp.empty(elements, dtype=cp.float32))
            gath.append(cp.empty(world * elements, dtype=cp.float32))
            streams.append(cp.cuda.Stream(non_blocking=True))

    def collective(op: str) -> float:
        for dev in devices:
            cp.cuda.Device(dev).synchronize()
        start = time.perf_counter()
        nccl.groupStart()
        for r, comm in enumerate(comms):
            with cp.cuda.Device(devices[r]):
                if op == "all_reduce":
                    comm.allReduce(send[r].data.ptr, recv[r].data.ptr, elements, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                                   streams[r].ptr)
                else:
                    comm.allGather(send[r].data.ptr, gath[r].data.ptr, elements, nccl.NCCL_FLOAT32, streams[r].ptr)
        nccl.groupEnd()
        for r, dev in enumerate(devices):
            with cp.cuda.Device(dev):
                streams[r].synchronize()
        return time.perf_counter() - start

    reduce_s = float(np.median([collective("all_reduce") for _ in range(iters)]))
    gather_s = float(np.median([collective("all_gather") for _ in range(iters)]))
    want = expected_sum(world, elements)
    reports = []
    for r in range(world):
        reduce_diffs = _diff(cp.asnumpy(recv[r]), want)
        slots = cp.asnumpy(gath[r]).reshape(world, elements)
        gather = {s: _diff(slots[s], contribution(s, elements)) for s in range(world)}
        reports.append(RankReport(rank=r, world=world, elements=elements, all_reduce=reduce_diffs, all_gather=gather,
                                  contributions={}, all_reduce_s=reduce_s, all_gather_s=gather_s))
    if any(_count(rep.all_reduce) for rep in reports):
        # The all-gather already moved every rank's actual contribution: reuse rank 0's copy.
        slots = cp.asnumpy(gath[0]).reshape(world, elements)
        used = {s: _diff(slots[s], contribution(s, elements)) for s in range(world)}
        reports = [RankReport(**{**rep.__dict__, "contributions": used}) for rep in reports]
    for comm in comms:
        comm.destroy()
    return merge_reports(reports, suite=suite, device="cuda:" + ",".join(map(str, devices)), model=model,
                         fault=fault)


if __name__ == "__main__":
    _gloo_worker(int(sys.argv[1]), **orjson.loads(sys.argv[2]))
