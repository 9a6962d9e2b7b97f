"""The in-job SDC defence a training loop adds in a few lines (seed 000 §7 and revision R3).

::

    guard = SdcGuard(model, loss_fn)              # loss_fn(module, batch) -> scalar loss
    for step, batch in enumerate(loader):
        guard.begin(step)                         # snapshots RNG on check steps
        loss = loss_fn(model, batch)
        loss.backward()
        if not guard.after_backward(step, batch, loss).skip_update:
            optimizer.step()
        optimizer.zero_grad()

What runs where:

- **every step**: the cheap invariants (:mod:`~fleethealth.injob.invariants`); in a distributed job
  their outcome is all-gathered (one tiny collective) so every rank skips, classifies and aborts
  together;
- **every ``every`` steps** (100): the bitwise self-check. The gradients of the training pass (``.grad``
  for a plain module; under DDP, each bucket captured by a communication hook before its all-reduce)
  are digested on the device and compared with ``==`` against a recomputation of the same microbatch
  on the same device with deterministic algorithms. All ranks check at the same step by default (a
  synchronous job pays one microbatch either way); ``rotate=True`` checks one rank per check step;
- **every ``replay_every`` steps** (10,000), or after an anomaly: the cross-rank replay
  (:mod:`~fleethealth.injob.replay`), with a third-rank vote on a mismatch;
- **after a non-finite loss or a gradient spike**: an out-of-cycle self-check on every rank and a replay,
  which together classify the anomaly (transient / persistent / data or code) before the
  abort-and-report hook runs.

Every check result is emitted through a :class:`~fleethealth.injob.report.Reporter` (to the node probe
unless a sink is given) and feeds :attr:`SdcGuard.watermark`.

Where the host waits for the device. ``skip_update`` must be known before ``optimizer.step()``, so
:meth:`SdcGuard.after_backward` reads to the host, every step, one copy of ``[loss, total gradient
norm]`` (one synchronisation) and, in a distributed job with ``sync_invariants``, the all-gather of
one integer per rank (under NCCL a device collective read back: a second synchronisation; under gloo
a CPU collective). Check steps add the digest copies (two integers per chunk) and the all-gather of
the self-check outcome; replay steps the fingerprints and object collectives. Nothing else waits:
the DDP per-bucket norms kept for re-checking after an anomaly stay on the device.

A watchdog passed to the guard runs start-up, self-checks and replays under its wider
``check_timeout_s`` (:meth:`~fleethealth.injob.watchdog.HangWatchdog.checking`), so a slow healthy check
is not reported or aborted as a hang.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import re
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from fleethealth.errors import ConfigError
from fleethealth.injob.crossrank import ReplayRound, pair_distances, replay_round_plan, run_replay
from fleethealth.injob.digest import (
    BitDigest,
    PendingDigest,
    bit_digest,
    bit_digest_async,
    fingerprint,
    fingerprint_distance,
)
from fleethealth.injob.invariants import Invariants, InvariantVerdict, NonFiniteHook, default_on_nonfinite
from fleethealth.injob.records import CheckKind, Classification, classify, sdc_check_event
from fleethealth.injob.replay import MIN_REPLAY_TOLERANCE, ReplayCalibration
from fleethealth.injob.report import Reporter
from fleethealth.injob.watchdog import HangWatchdog
from fleethealth.injob.watermark import Watermark

__all__ = ["SdcGuard", "CheckResult", "StepVerdict", "StartupReport", "NondeterminismWarning"]

_log = logging.getLogger("fleethealth.injob")
_NONDET_OP = re.compile(r"(\S+) does not have a deterministic implementation")
_CODE_OK, _CODE_SPIKE, _CODE_NAN_LOSS, _CODE_NAN_GRAD = 0, 1, 2, 3
_SC_NONE, _SC_PASS, _SC_FAIL = 0, 1, 2

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


class NondeterminismWarning(UserWarning):
    """The model's backward is not bitwise reproducible; the self-check runs at a tolerance."""


@dataclass(frozen=True)
class CheckResult:
    """One rank's result of one check. ``digests`` are hex strings (self-check: training pass then
    recomputation; replay: this rank's fingerprint then its peers'); ``mismatched`` names the
    parameters whose bits differed in a failed self-check."""

    check: CheckKind
    step: int
    rank: int
    passed: bool
    classification: Classification | None
    digests: tuple[str, ...]
    duration_s: float
    peer_ranks: tuple[int, ...] = ()
    culprit_rank: int | None = None
    tolerance: float | None = None
    mismatched: tuple[str, ...] = ()


@dataclass(frozen=True)
class StepVerdict:
    """What :meth:`SdcGuard.after_backward` decided. ``skip_update`` is the same on every rank."""

    step: int
    skip_update: bool
    invariants: InvariantVerdict
    checks: tuple[CheckResult, ...] = ()
    classification: Classification | None = None

    @property
    def failed(self) -> tuple[CheckResult, ...]:
        return tuple(c for c in self.checks if not c.passed)


@dataclass(frozen=True)
class StartupReport:
    """The start-up probe: whether two healthy recomputations agree bit for bit.

    ``nondeterministic_op`` is the op torch named when deterministic algorithms were refused;
    ``mismatched`` the parameters whose gradients differed; ``selfcheck_tolerance`` is set only when
    the self-check fell back to a tolerance. ``replay_tolerance`` is the replay threshold in force.
    """

    deterministic: bool
    nondeterministic_op: str | None
    mismatched: tuple[str, ...]
    selfcheck_tolerance: float | None
    replay_tolerance: float | None


def _fp_hex(fp: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(fp, dtype="<f8").tobytes(), digest_size=16).hexdigest()


class SdcGuard:
    """Bitwise self-check, cross-rank replay, invariants and watermark for one training process.

    ``model`` is a module or a ``DistributedDataParallel`` wrapper; ``loss_fn(module, batch)`` computes
    the scalar loss of one microbatch (the guard calls it on the unwrapped module to recompute).
    ``every`` / ``replay_every``: check cadences in steps (0 disables). ``calibration``: the stored
    replay tolerance; without one the guard measures the replay pairs' own distances at start-up
    (robust 5 sigma, at least ``nondeterminism_margin`` x the largest and at least ``replay_floor``).
    ``domains``: failure domain per rank (e.g. node or rack index) for choosing the third rank.
    ``compare_training_pass``: digest the training pass's gradients (needs one microbatch per step);
    ``False`` compares two recomputations instead (for gradient accumulation). ``sync_invariants=False``
    saves the per-step all-gather; anomalies are then handled by each rank alone (no replay).
    """

    def __init__(self, model: torch.nn.Module, loss_fn: LossFn, *, every: int = 100,
                 replay_every: int = 10_000, rotate: bool = False, reporter: Reporter | None = None,
                 calibration: ReplayCalibration | None = None, sigmas: float = 5.0,
                 domains: list[int] | None = None, process_group: Any = None,
                 invariants: Invariants | None = None, on_nonfinite: NonFiniteHook = default_on_nonfinite,
                 watchdog: HangWatchdog | None = None, deterministic: bool = True,
                 compare_training_pass: bool = True, sync_invariants: bool = True,
                 nondeterminism_margin: float = 10.0, nondeterminism_floor: float = 1e-6,
                 replay_floor: float = MIN_REPLAY_TOLERANCE) -> None:
        if every < 0 or replay_every < 0:
            raise ConfigError("every and replay_every must be >= 0 (0 disables)")
        self.model = model
        self.ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        self.module: torch.nn.Module = model.module if self.ddp else model
        self.loss_fn = loss_fn
        self.every, self.replay_every, self.rotate = int(every), int(replay_every), rotate
        self.calibration, self.sigmas, self.domains = calibration, sigmas, domains
        self.group = process_group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        self.world = dist.get_world_size(process_group) if self.distributed else 1
        if self.world < 2:
            self.distributed = False
        self.reporter = reporter if reporter is not None else Reporter(
            rank=dist.get_rank() if self.distributed else None)
        # ranks in results and events are job (global) ranks; self.rank indexes the process group
        self.job_rank = (dist.get_rank() if self.distributed
                         else self.reporter.rank if self.reporter.rank is not None else 0)
        self.invariants = invariants if invariants is not None else Invariants()
        self.on_nonfinite = on_nonfinite
        self.watchdog = watchdog
        self.compare_training_pass = compare_training_pass
        self.sync_invariants = sync_invariants
        self.margin, self.floor = nondeterminism_margin, nondeterminism_floor
        self.replay_floor = float(replay_floor)
        self.watermark = Watermark()
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        if not named:
            raise ConfigError("the model has no parameters that require gradients")
        self.names = tuple(n for n, _ in named)
        self.params = [p for _, p in named]
        self.device = self.params[0].device
        self.selfcheck_tolerance: float | None = None
        self.startup_report: StartupReport | None = None
        self.checks_total = 0
        self.failures_total = 0
        self._rng: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._capture_step: int | None = None
        self._begun: int | None = None
        self._captured: list[tuple[list[int], PendingDigest]] = []
        self._bucket_norms: list[tuple[list[int], torch.Tensor]] = []
        self._det_prev: tuple[bool, bool] | None = None
        self._last_replay = ReplayRound(incidents=(), duration_s=0.0)
        self._loss_scale: float | None = None
        self.scaler_overflows_total = 0
        if deterministic:
            self._enable_determinism()
        if self.ddp:
            self._index_of = {p.data_ptr(): i for i, p in enumerate(self.params)}
            model.register_comm_hook(None, self._make_comm_hook())

    # ------------------------------------------------------------------ setup
    def _enable_determinism(self) -> None:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        self._det_prev = (torch.are_deterministic_algorithms_enabled(),
                          torch.is_deterministic_algorithms_warn_only_enabled())
        # warn_only: an op without a deterministic kernel warns (and start-up names it) instead of
        # making the training step raise
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False

    def close(self) -> None:
        """Restore the deterministic-algorithms setting found at construction."""
        if self._det_prev is not None:
            torch.use_deterministic_algorithms(self._det_prev[0], warn_only=self._det_prev[1])
            self._det_prev = None

    def _checking(self, what: str) -> contextlib.AbstractContextManager[None]:
        """The watchdog's wider limit around a long check (nothing without a watchdog)."""
        return self.watchdog.checking(what) if self.watchdog is not None else contextlib.nullcontext()

    def startup(self, batch: Any) -> StartupReport:
        """Probe determinism on ``batch`` and, in a distributed job without a stored calibration,
        measure the replay pairs' healthy distances (collective: every rank calls it)."""
        with self._checking("startup"):
            return self._startup(batch)

    def _startup(self, batch: Any) -> StartupReport:
        op = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                g1, g2 = self._recompute(batch), self._recompute(batch)
            except RuntimeError as exc:  # strict mode set by the caller: torch refuses and names the op
                match = _NONDET_OP.search(str(exc))
                if match is None:
                    raise
                op = match.group(1)
                torch.use_deterministic_algorithms(True, warn_only=True)
                g1, g2 = self._recompute(batch), self._recompute(batch)
        for w in caught:
            match = _NONDET_OP.search(str(w.message))
            if match is not None and op is None:
                op = match.group(1)
            elif match is None:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        mismatched = tuple(bit_digest(g1, self.names).mismatches(bit_digest(g2, self.names)))
        deterministic = op is None and not mismatched
        if not deterministic:
            with warnings.catch_warnings():  # torch already said it once, above
                warnings.filterwarnings("ignore", message=".*does not have a deterministic implementation")
                g3 = self._recompute(batch)
            fps = [fingerprint(g1), fingerprint(g2), fingerprint(g3)]
            spread = max(_distance(a, b) for i, a in enumerate(fps) for b in fps[i + 1:])
            self.selfcheck_tolerance = max(self.floor, self.margin * spread)
            what = f"op {op}" if op else "an op torch did not name"
            msg = (f"fleethealth: the backward is NOT bitwise deterministic ({what}; differing parameters: "
                   f"{', '.join(mismatched) or 'none seen in two runs'}). The self-check falls back to a "
                   f"relative tolerance of {self.selfcheck_tolerance:.3g} and will MISS corruption smaller "
                   "than that; replace the op with a deterministic one to restore the bitwise check.")
            warnings.warn(msg, NondeterminismWarning, stacklevel=2)
            _log.error(msg)
        if self.distributed and self.calibration is None and self.replay_every:
            self.calibration = self._calibrate(batch)
        self.startup_report = StartupReport(
            deterministic=deterministic, nondeterministic_op=op, mismatched=mismatched,
            selfcheck_tolerance=self.selfcheck_tolerance,
            replay_tolerance=None if self.calibration is None else self.calibration.tolerance)
        return self.startup_report

    def _calibrate(self, batch: Any) -> ReplayCalibration:
        """The replay pairs (``r`` and ``r + world // 2``) each compute the source's microbatch, as a
        replay does; their distances set the tolerance (:meth:`ReplayCalibration.from_pair_distances`)."""
        distances = pair_distances(self, batch, replay_round_plan(self.world))
        cal = ReplayCalibration.from_pair_distances(distances, sigmas=self.sigmas, margin=self.margin,
                                                    floor=self.replay_floor)
        _log.info("fleethealth: replay calibrated on %d pair distances (max %.3g): tolerance %.3g",
                  len(distances), max(distances, default=0.0), cal.tolerance)
        return cal

    # ------------------------------------------------------------------ schedule
    def selfcheck_due(self, step: int) -> bool:
        """Whether this rank self-checks at ``step``."""
        if not self.every or step % self.every:
            return False
        return not self.rotate or (step // self.every) % self.world == self.rank

    def replay_due(self, step: int) -> bool:
        return self.distributed and bool(self.replay_every) and step % self.replay_every == 0

    def begin(self, step: int) -> None:
        """Call before the forward of ``step``: snapshots the RNG (a few kB, so dropout replays exactly
        on check steps and after an anomaly) and, on check steps, arms the DDP capture of the
        training-pass gradients."""
        self._captured = []
        self._bucket_norms = []
        self._begun = step
        self._capture_step = step if self.selfcheck_due(step) else None
        self._rng = self._snapshot_rng()

    def _snapshot_rng(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.get_rng_state(), cuda

    def rng_snapshot(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The RNG state recomputations of this step run under (taken now if :meth:`begin` was not
        called); a replay sends it with the microbatch so dropout masks match across ranks."""
        if self._rng is None:
            self._rng = self._snapshot_rng()
        return self._rng

    def _make_comm_hook(self) -> Callable[..., Any]:
        """DDP communication hook: digest each bucket's local gradients (on check steps) before the
        default all-reduce, and name the collective for the watchdog. Built as a closure without
        annotations because DDP validates hook annotations against the runtime types."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def hook(state, bucket):  # noqa: ANN001, ANN202 - see the docstring
            if self.compare_training_pass:
                idx = [self._index_of[p.data_ptr()] for p in bucket.parameters()]
                if self._capture_step is not None:
                    pending = bit_digest_async(bucket.gradients(), [self.names[i] for i in idx])
                    self._captured.append((idx, pending))
                else:  # one norm kernel per bucket: enough to re-check the training pass after an anomaly
                    self._bucket_norms.append((idx, bucket.buffer().detach().norm()))
            if self.watchdog is not None:
                self.watchdog.collective(f"ddp.all_reduce(bucket {bucket.index()})")
            return allreduce_hook(self.group, bucket)

        return hook

    # ------------------------------------------------------------------ compute
    def _recompute(self, batch: Any, rng: tuple[torch.Tensor, torch.Tensor | None] | None = None
                   ) -> list[torch.Tensor]:
        """This rank's gradients for ``batch`` on its device, leaving RNG, buffers and ``.grad`` untouched.

        ``rng``: the RNG snapshot to replay under (default: this rank's snapshot from :meth:`begin`)."""
        rng = rng if rng is not None else self._rng
        buffers = [b.detach().clone() for b in self.module.buffers()]
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            if rng is not None:
                torch.set_rng_state(rng[0])
                if rng[1] is not None and self.device.type == "cuda":
                    torch.cuda.set_rng_state(rng[1], self.device)
            loss = self.loss_fn(self.module, batch)
            if self._loss_scale is not None:  # as GradScaler.scale(loss) did for the training pass
                loss = loss * self._loss_scale
            grads = torch.autograd.grad(loss, self.params, allow_unused=True)
        with torch.no_grad():
            for b, saved in zip(self.module.buffers(), buffers, strict=True):
                b.copy_(saved)
        return [torch.zeros_like(p) if g is None else g for g, p in zip(grads, self.params, strict=True)]

    def _training_grads(self) -> list[torch.Tensor] | None:
        if self.ddp or not self.compare_training_pass:
            return None
        return [torch.zeros_like(p) if p.grad is None else p.grad for p in self.params]

    def _training_pass_known(self, step: int) -> bool:
        """False when the training pass used dropout masks the guard cannot replay (no begin(step))."""
        return self._begun == step or not any(
            m.training and isinstance(m, torch.nn.modules.dropout._DropoutNd) for m in self.module.modules())

    def _training_digest(self, step: int) -> BitDigest | None:
        if not self._training_pass_known(step):
            return None
        if self.ddp:
            if self._capture_step != step or not self._captured:
                return None
            return _merge([(idx, pending.result()) for idx, pending in self._captured], self.names)
        grads = self._training_grads()
        return None if grads is None else bit_digest(grads, self.names)

    def _compare_bucket_norms(self, grads: list[torch.Tensor]) -> tuple[bool, tuple[str, str], tuple[str, ...]]:
        """Compare the training pass's per-bucket gradient norms (DDP, captured every step) with the
        same norms of a recomputation, bit for bit: the same kernel over the same flat layout."""
        train = torch.stack([n for _, n in self._bucket_norms])
        again = torch.stack([torch.cat([grads[i].reshape(-1) for i in idx]).norm() for idx, _ in self._bucket_norms])
        da, db = bit_digest([train]), bit_digest([again])
        bad = (train.view(torch.int32) != again.view(torch.int32)).tolist() if train.dtype == torch.float32 else [
            not torch.equal(a, b) for a, b in zip(train, again, strict=True)]
        mismatched = tuple(self.names[i] for (idx, _), b in zip(self._bucket_norms, bad, strict=True) if b
                           for i in idx)
        return da == db, (da.hex, db.hex), mismatched

    def _loss_and_norm(self, loss: torch.Tensor | float) -> tuple[float, float]:
        """The loss and the total 2-norm of the ``.grad`` tensors, read to the host in one copy (the
        step's one forced synchronisation outside the collectives). Per-gradient norms are combined
        with ``torch.linalg.vector_norm``, which every supported torch has."""
        grads = [p.grad.detach() for p in self.params if p.grad is not None]
        values: list[torch.Tensor] = []
        if isinstance(loss, torch.Tensor):
            values.append(loss.detach().reshape(()).to(self.device, torch.float64))
        if grads:
            foreach = getattr(torch, "_foreach_norm", None)
            norms = foreach(grads) if foreach is not None else [torch.linalg.vector_norm(g) for g in grads]
            values.append(torch.linalg.vector_norm(torch.stack([n.to(self.device, torch.float64) for n in norms])))
        host = torch.stack(values).cpu().tolist() if values else []
        loss_value = host.pop(0) if isinstance(loss, torch.Tensor) else float(loss)
        return float(loss_value), float(host[0]) if grads else 0.0

    # ------------------------------------------------------------------ checks
    def selfcheck(self, step: int, batch: Any) -> CheckResult:
        """Recompute ``batch`` and compare with the training pass (or a first recomputation); emits."""
        with self._checking("selfcheck"):
            return self._selfcheck(step, batch)

    def _selfcheck(self, step: int, batch: Any) -> CheckResult:
        t0 = time.perf_counter()
        tol = None
        if self.selfcheck_tolerance is None:
            first = self._training_digest(step)
            grads = self._recompute(batch)
            if first is None and self._bucket_norms and self._training_pass_known(step):
                passed, digests, mismatched = self._compare_bucket_norms(grads)
            else:
                second = bit_digest(grads, self.names)
                if first is None:
                    first, second = second, bit_digest(self._recompute(batch), self.names)
                mismatched = tuple(first.mismatches(second))
                passed, digests = not mismatched and first == second, (first.hex, second.hex)
        else:
            grads = self._training_grads() or self._recompute(batch)
            fa, fb = fingerprint(grads), fingerprint(self._recompute(batch))
            tol = self.selfcheck_tolerance
            passed, digests, mismatched = _distance(fa, fb) <= tol, (_fp_hex(fa), _fp_hex(fb)), ()
        result = CheckResult(check=CheckKind.SELFCHECK, step=step, rank=self.job_rank, passed=passed,
                             classification=None if passed else Classification.TRANSIENT, digests=digests,
                             duration_s=time.perf_counter() - t0, tolerance=tol, mismatched=mismatched)
        self._emit(result, "" if passed else f"self-check FAILED on rank {self.job_rank} (transient): "
                   f"bits differ in {', '.join(mismatched) or 'the gradients'}")
        return result

    def _emit(self, r: CheckResult, message: str = "") -> None:
        self.checks_total += 1
        self.failures_total += not r.passed
        self.reporter.emit(sdc_check_event(
            ts=self.reporter.now(), check=r.check, passed=r.passed, classification=r.classification,
            digests=list(r.digests), duration_s=r.duration_s, peer_ranks=list(r.peer_ranks),
            culprit_rank=r.culprit_rank, tolerance=r.tolerance, rank=r.rank, step=r.step, message=message))

    def _gather_ints(self, values: list[int], what: str) -> np.ndarray:
        """All-gather a few small integers per rank; returns shape ``(world, len(values))``."""
        local = np.asarray(values, dtype=np.int64)[None, :]
        if not self.distributed:
            return local
        if self.watchdog is not None:
            self.watchdog.collective(f"all_gather({what})")
        device = torch.device("cuda", torch.cuda.current_device()) if _backend(self.group) == "nccl" else "cpu"
        t = torch.as_tensor(local[0], device=device)
        out = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(out, t, group=self.group)
        return torch.stack(out).cpu().numpy()

    def replay(self, step: int, batch: Any, sources: list[int] | None = None) -> list[CheckResult]:
        """Cross-rank replay (collective): every rank calls it with the same ``sources`` (``None``: all
        pairs). Returns this rank's results (one per pair it took part in) and emits them."""
        if not self.distributed:
            return []
        with self._checking("replay"):
            return self._replay(step, batch, sources)

    def _replay(self, step: int, batch: Any, sources: list[int] | None) -> list[CheckResult]:
        if self.calibration is None:
            self.calibration = self._calibrate(batch)
        plan = replay_round_plan(self.world, sources)
        outcome: ReplayRound = run_replay(self, batch, plan, self.calibration.tolerance, self.domains)
        results = []
        for incident in outcome.incidents:
            if self.rank not in incident.ranks:
                continue
            suspect = incident.culprit == self.rank or (incident.culprit is None and not incident.agreed
                                                        and self.rank in incident.pair)
            own = incident.fingerprints[self.rank]
            peers = tuple(r for r in incident.ranks if r != self.rank)
            culprit = None if incident.culprit is None else _global(self.group, incident.culprit)
            r = CheckResult(check=CheckKind.REPLAY, step=step, rank=self.job_rank, passed=not suspect,
                            classification=incident.classification,
                            digests=(_fp_hex(own), *(_fp_hex(incident.fingerprints[p]) for p in peers)),
                            duration_s=outcome.duration_s, peer_ranks=tuple(_global(self.group, p) for p in peers),
                            culprit_rank=culprit,
                            tolerance=self.calibration.tolerance)
            source = _global(self.group, incident.pair[0])
            msg = "" if incident.agreed else (
                f"replay of rank {source}'s microbatch disagrees (distance {incident.distance:.3g} "
                f"> {self.calibration.tolerance:.3g}); "
                + ("no majority" if culprit is None else f"the vote names rank {culprit}"))
            self._emit(r, msg)
            results.append(r)
        self._last_replay = outcome
        return results

    # ------------------------------------------------------------------ the step hook
    def after_backward(self, step: int, batch: Any, loss: torch.Tensor | float, *,
                       loss_scale: float | None = None) -> StepVerdict:
        """Run everything due at ``step`` after the training backward; every rank calls it each step.

        ``loss`` is the unscaled loss. With mixed precision pass ``loss_scale=scaler.get_scale()``:
        recomputations scale their loss the same way (so the bits still match), the invariants see
        the unscaled gradient norm, and a non-finite gradient with a finite loss counts as the
        scaler's own overflow (``scaler_overflows_total``; the scaler skips that step itself).
        """
        self._loss_scale = None if loss_scale is None else float(loss_scale)
        if self.startup_report is None:
            self.startup(batch)
        loss_value, norm = self._loss_and_norm(loss)
        norm /= self._loss_scale or 1.0
        if self._loss_scale is not None and math.isfinite(loss_value) and not math.isfinite(norm):
            self.scaler_overflows_total += 1
            inv = InvariantVerdict(step, loss_value, norm, self.invariants.ceiling(), False, "")
        else:
            inv = self.invariants.check(step, loss_value, norm)
        code = {"": _CODE_OK, "grad_spike": _CODE_SPIKE, "nonfinite_loss": _CODE_NAN_LOSS,
                "nonfinite_grad": _CODE_NAN_GRAD}[inv.reason]
        codes = self._gather_ints([code], "invariants")[:, 0] if self.sync_invariants else np.array([code])
        anomaly = bool((codes != _CODE_OK).any())
        joint = anomaly and (self.sync_invariants or not self.distributed)  # every rank knows of it
        checks: list[CheckResult] = []
        sc_step = bool(self.every) and step % self.every == 0
        state = _SC_NONE
        if self.selfcheck_due(step) or anomaly:
            sc = self.selfcheck(step, batch)
            checks.append(sc)
            state = _SC_PASS if sc.passed else _SC_FAIL
        states = self._gather_ints([state], "selfcheck")[:, 0] if (sc_step or joint) else np.array([state])
        if (states != _SC_NONE).any():
            self.watermark.record(step, bool((states != _SC_FAIL).all()))
        nan_ranks = [int(r) for r in np.flatnonzero(codes == _CODE_NAN_LOSS)]
        replay_sources: list[int] | None | bool = False
        if self.replay_due(step):
            replay_sources = None
        if joint and self.distributed:
            replay_sources = nan_ranks or None
        replayed: list[CheckResult] = []
        if replay_sources is not False:
            replayed = self.replay(step, batch, replay_sources)  # type: ignore[arg-type]
            checks.extend(replayed)
            self.watermark.record(step, self._last_replay.all_agreed)
        classification = self._classify_anomaly(codes, states, nan_ranks, joint) if anomaly else None
        verdict = StepVerdict(step=step, skip_update=anomaly, invariants=inv, checks=tuple(checks),
                              classification=classification)
        self._bucket_norms = []
        if self.watchdog is not None:
            self.watchdog.beat(step)
        if nan_ranks or (codes == _CODE_NAN_GRAD).any():
            self.on_nonfinite(inv, None if classification is None else classification.value)
        return verdict

    def _classify_anomaly(self, codes: np.ndarray, states: np.ndarray, nan_ranks: list[int],
                          joint: bool) -> Classification | None:
        """Transient when a self-check on a suspect rank failed; else the replay decides."""
        suspects = nan_ranks or list(range(len(codes)))
        if any(states[r] == _SC_FAIL for r in suspects if r < len(states)):
            return Classification.TRANSIENT
        if not (self.distributed and joint):
            return classify(True, None)
        outcome = self._last_replay
        bad = [i for i in outcome.incidents if not i.agreed]
        if not bad:
            return classify(True, True)
        return bad[0].classification


def _distance(a: np.ndarray, b: np.ndarray) -> float:
    return fingerprint_distance(a, b)


def _merge(pieces: list[tuple[list[int], BitDigest]], names: tuple[str, ...]) -> BitDigest | None:
    """Reassemble per-bucket digests into parameter order (``None`` if a parameter is missing)."""
    rows: dict[int, tuple[np.ndarray, str]] = {}
    for idx, d in pieces:
        for j, i in enumerate(idx):
            rows[i] = (d.parts[d.bounds[j]:d.bounds[j + 1]], d.layout[j])
    if len(rows) != len(names):
        return None
    parts, bounds, layout = [], [0], []
    for i in range(len(names)):
        p, lay = rows[i]
        parts.append(p)
        bounds.append(bounds[-1] + len(p))
        layout.append(lay)
    return BitDigest(parts=np.concatenate(parts), bounds=tuple(bounds), layout=tuple(layout), names=names)


def _backend(group: Any) -> str:
    return str(dist.get_backend(group)).lower()


def _global(group: Any, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _to_cpu(batch: Any) -> Any:
    return tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, batch)


def _to_device(batch: Any, device: torch.device) -> Any:
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, batch)
