"""The in-job SDC defence a training loop adds in a few lines (seed 000 §7 and revision R3).

::

    guard = SdcGuard(model, loss_fn)              # loss_fn(module, microbatch) -> scalar loss
    for step, batch in enumerate(loader):
        guard.begin(step)                         # arms the check-step capture
        loss = loss_fn(model, batch)
        loss.backward()
        verdict = guard.after_backward(step, batch, loss)
        if not verdict.skip_update:
            optimizer.step()
        optimizer.zero_grad()
        if verdict.rollback_to is not None:       # the same on every rank; see the README's rollback loop
            ...                                   # restore that checkpoint, guard.rolled_back(step)

What runs where:

- **every step**: the cheap invariants (:mod:`~fleethealth.injob.invariants`). Under DDP they judge
  the all-reduced gradient norm, identical on every rank, so no collective of the guard's own runs
  on an ordinary step; only when they fire do the ranks all-gather their codes (one tiny collective)
  to skip, classify and act together. Without DDP (``sync_invariants``) the codes are all-gathered
  every step;
- **gradient accumulation**: a forward pre-hook counts training forwards; with more than one per
  step the self-check compares the last backward's own gradients with a recomputation of the last
  microbatch (:mod:`~fleethealth.injob.selfcheck`), never the accumulated sum;
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

Every check result is emitted through a :class:`~fleethealth.injob.reporter.Reporter` (to the node probe
unless a sink is given) and feeds :attr:`SdcGuard.watermark`.

Where the host waits for the device. ``skip_update`` must be known before ``optimizer.step()``, so
:meth:`SdcGuard.after_backward` reads to the host, every step, one copy of ``[loss, total gradient
norm]`` (one synchronisation); without DDP, in a distributed job with ``sync_invariants``, also the
all-gather of one integer per rank. Check steps add the digest copies (two integers per chunk) and
one all-gather of a few integers per rank (invariant code, self-check outcome, the policy's advice:
the verdict every rank derives alike); replay steps the fingerprints and object collectives. Nothing else waits:
the DDP per-bucket norms kept for re-checking after an anomaly stay on the device.

A watchdog passed to the guard runs start-up, self-checks and replays under its wider
``check_timeout_s`` (:meth:`~fleethealth.injob.watchdog.HangWatchdog.checking`), so a slow healthy check
is not reported or aborted as a hang.

The guard composes the parts and owns the schedule: :mod:`~fleethealth.injob.recompute` (a
microbatch's gradients again), :mod:`~fleethealth.injob.selfcheck` (the bitwise self-check),
:mod:`~fleethealth.injob.crossrank` (the replay), :mod:`~fleethealth.injob.distributed` (collective
helpers) and :mod:`~fleethealth.injob.results` (what it returns).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from fleethealth.errors import ConfigError
from fleethealth.injob.crossrank import (
    ReplayPeers,
    ReplayRound,
    calibrate,
    replay_results,
    replay_round_plan,
    run_replay,
)
from fleethealth.injob.distributed import gather_ints, global_rank
from fleethealth.injob.inbox import RollbackInbox
from fleethealth.injob.invariants import Invariants, InvariantVerdict, NonFiniteHook, default_on_nonfinite
from fleethealth.injob.recompute import LossFn, Recompute, RngState
from fleethealth.injob.replay import MIN_REPLAY_TOLERANCE, ReplayCalibration
from fleethealth.injob.reporter import Reporter
from fleethealth.injob.results import CheckResult, NondeterminismWarning, StartupReport, StepVerdict
from fleethealth.injob.selfcheck import SelfCheck, enable_determinism, restore_determinism
from fleethealth.injob.watchdog import HangWatchdog
from fleethealth.injob.watermark import Watermark
from fleethealth.payloads.checkpoint import CheckpointRecord, checkpoint_event
from fleethealth.payloads.rollback import choose
from fleethealth.payloads.sdc_check import Classification, classify

__all__ = ["SdcGuard", "CheckResult", "StepVerdict", "StartupReport", "NondeterminismWarning"]

_log = logging.getLogger("fleethealth.injob")
_C = TypeVar("_C")
_CODE_OK, _CODE_SPIKE, _CODE_NAN_LOSS, _CODE_NAN_GRAD = 0, 1, 2, 3
_SC_NONE, _SC_PASS, _SC_FAIL = 0, 1, 2


class SdcGuard:
    """Bitwise self-check, cross-rank replay, invariants and watermark for one training process.

    ``model`` is a module or a ``DistributedDataParallel`` wrapper; ``loss_fn(module, batch)`` computes
    the scalar loss of one microbatch (the guard calls it on the unwrapped module to recompute).
    ``every`` / ``replay_every``: check cadences in steps (0 disables). ``calibration``: the stored
    replay tolerance; without one the guard measures the replay pairs' own distances at start-up
    (robust 5 sigma, at least ``nondeterminism_margin`` x the largest and at least ``replay_floor``).
    ``domains``: failure domain per rank (e.g. node or rack index) for choosing the third rank.
    ``compare_training_pass``: digest the training pass's gradients (with gradient accumulation, the
    last backward's own; detected, nothing to set); ``False`` compares two recomputations instead.
    ``sync_invariants=False`` handles anomalies on each rank alone (no gather, no replay; under DDP
    there is no per-step gather either way). ``inbox``: where the policy's rollback advice is read
    (default: :class:`~fleethealth.injob.inbox.RollbackInbox` for the reporter's job, ``follow_advice=False``
    for none). ``on_nonfinite``: :class:`~fleethealth.injob.invariants.NonFiniteAction` by default.
    """

    def __init__(self, model: torch.nn.Module, loss_fn: LossFn, *, every: int = 100,
                 replay_every: int = 10_000, rotate: bool = False, reporter: Reporter | None = None,
                 calibration: ReplayCalibration | None = None, sigmas: float = 5.0,
                 domains: list[int] | None = None, process_group: Any = None,
                 invariants: Invariants | None = None, on_nonfinite: NonFiniteHook = default_on_nonfinite,
                 watchdog: HangWatchdog | None = None, deterministic: bool = True,
                 compare_training_pass: bool = True, sync_invariants: bool = True,
                 nondeterminism_margin: float = 10.0, nondeterminism_floor: float = 1e-6,
                 replay_floor: float = MIN_REPLAY_TOLERANCE, inbox: RollbackInbox | None = None,
                 follow_advice: bool = True) -> None:
        if every < 0 or replay_every < 0:
            raise ConfigError("every and replay_every must be >= 0 (0 disables)")
        self.model = model
        self.ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        self.module: torch.nn.Module = model.module if self.ddp else model
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
        self.recompute = Recompute(self.module, self.params, loss_fn)
        self.checker = SelfCheck(self.recompute, self.names, ddp=self.ddp,
                                 compare_training_pass=compare_training_pass,
                                 margin=nondeterminism_margin, floor=nondeterminism_floor)
        self.startup_report: StartupReport | None = None
        self.accumulation_seen = False
        self.book: list[CheckpointRecord] = []
        self.validity: dict[int, bool] = {}
        """Checkpoint step → valid (:meth:`~fleethealth.injob.ckptcheck.CheckpointValidator.validity`): once
        not empty, only a valid checkpoint is a rollback target. The loop sets it alike on every rank (the
        validator runs on one: broadcast its result), since every rank derives the target itself."""
        """The checkpoints recorded with :meth:`checkpoint` and not yet pruned or discarded (oldest first)."""
        self.inbox = inbox if inbox is not None or not follow_advice or not self.reporter.job else RollbackInbox(
            self.reporter.job)
        self._handled: set[int] = set()  # failed steps whose rollback the loop carried out
        self._handled_ids: set[str] = set()  # advice ids carried out (or ignored)
        self.failure: StepVerdict | None = None
        """The first step since the last rollback whose check failed (its agreed verdict)."""
        self._last_step: int | None = None
        self._forward_hook = self.module.register_forward_pre_hook(lambda _m, _a: self.checker.count_forward())
        self.checks_total = 0
        self.failures_total = 0
        self._det_prev: tuple[bool, ...] | None = None
        self._last_replay = ReplayRound(incidents=(), duration_s=0.0)
        self.scaler_overflows_total = 0
        if deterministic:
            self._det_prev = enable_determinism()
        if self.ddp:
            model.register_comm_hook(None, self.checker.comm_hook(self.group, self.watchdog))

    # ------------------------------------------------------------------ parts
    @property
    def loss_fn(self) -> LossFn:
        return self.recompute.loss_fn

    @loss_fn.setter
    def loss_fn(self, fn: LossFn) -> None:
        self.recompute.loss_fn = fn

    @property
    def compare_training_pass(self) -> bool:
        return self.checker.compare_training_pass

    @compare_training_pass.setter
    def compare_training_pass(self, value: bool) -> None:
        self.checker.compare_training_pass = value

    @property
    def selfcheck_tolerance(self) -> float | None:
        """The self-check's relative tolerance; ``None`` while it is bitwise."""
        return self.checker.tolerance

    @selfcheck_tolerance.setter
    def selfcheck_tolerance(self, value: float | None) -> None:
        self.checker.tolerance = value

    def _peers(self) -> ReplayPeers:
        return ReplayPeers(recompute=self.recompute, rank=self.rank, world=self.world, group=self.group,
                           watchdog=self.watchdog)

    # ------------------------------------------------------------------ setup
    def close(self) -> None:
        """Restore the deterministic-algorithms setting found at construction; remove the guard's
        forward hook."""
        self._forward_hook.remove()
        if self._det_prev is not None:
            restore_determinism(self._det_prev)
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
        deterministic, op, mismatched = self.checker.probe(batch)
        if self.distributed and self.calibration is None and self.replay_every:
            self.calibration = self._calibrate(batch)
        self.startup_report = StartupReport(
            deterministic=deterministic, nondeterministic_op=op, mismatched=mismatched,
            selfcheck_tolerance=self.selfcheck_tolerance,
            replay_tolerance=None if self.calibration is None else self.calibration.tolerance)
        return self.startup_report

    def _calibrate(self, batch: Any) -> ReplayCalibration:
        return calibrate(self._peers(), batch, sigmas=self.sigmas, margin=self.margin, floor=self.replay_floor)

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
        self.checker.arm(step, capture=self.selfcheck_due(step))
        self.recompute.rng = self.recompute.snapshot_rng()

    def rng_snapshot(self) -> RngState:
        """The RNG state recomputations of this step run under (taken now if :meth:`begin` was not
        called); a replay sends it with the microbatch so dropout masks match across ranks."""
        return self.recompute.rng_snapshot()

    # ------------------------------------------------------------------ compute
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

    def _gather_ints(self, values: list[int], what: str) -> np.ndarray:
        return gather_ints(values, what, group=self.group, world=self.world, distributed=self.distributed,
                           watchdog=self.watchdog)

    # ------------------------------------------------------------------ checks
    def selfcheck(self, step: int, batch: Any) -> CheckResult:
        """Recompute ``batch`` and compare with the training pass (or a first recomputation); emits."""
        with self._checking("selfcheck"):
            result = self.checker.run(step, batch, self.job_rank)
        self._emit(result, "" if result.passed else f"self-check FAILED on rank {self.job_rank} (transient): "
                   f"bits differ in {', '.join(result.mismatched) or 'the gradients'}")
        return result

    def _emit(self, r: CheckResult, message: str = "") -> None:
        self.checks_total += 1
        self.failures_total += not r.passed
        self.reporter.emit(r.to_event(self.reporter.now(), message))

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
        peers = self._peers()
        outcome = run_replay(peers, batch, replay_round_plan(self.world, sources), self.calibration.tolerance,
                             self.domains)
        results = []
        for result, message in replay_results(outcome, peers, step=step, job_rank=self.job_rank,
                                              tolerance=self.calibration.tolerance):
            self._emit(result, message)
            results.append(result)
        self._last_replay = outcome
        return results

    def checkpoint(self, step: int, uri: str) -> CheckpointRecord:
        """Record a checkpoint written at ``step`` to ``uri``: returns the record with both verification
        marks (store it beside the checkpoint) and, on the job's rank 0, emits the ``checkpoint`` event
        the detectors and the policy choose rollback targets from. Never raises on delivery.

        ``step`` is the step whose update the checkpoint includes (see
        :mod:`fleethealth.payloads.rollback`): call it after :meth:`after_backward` of ``step`` and
        its ``optimizer.step()`` (or skipped update). Any other step raises :class:`ConfigError`: a
        checkpoint stamped one step off would make a rollback land one update early or late."""
        if self._last_step is not None and step != self._last_step:
            raise ConfigError(f"checkpoint step {step} is not the last step the guard saw ({self._last_step}): "
                              "a checkpoint's step is the step whose update it includes, written after that "
                              "step's after_backward and optimizer.step()")
        if self.checker.forwards:
            raise ConfigError(f"checkpoint at step {step} after a forward of the next step: write it after "
                              f"step {step}'s update and before step {step + 1}'s forward")
        record = self.watermark.checkpoint(step, uri)
        self.book = [c for c in self.book if c.step != step] + [record]
        if self.job_rank == 0:
            self.reporter.emit(checkpoint_event(ts=self.reporter.now(), step=step, uri=uri,
                                                last_verified_step=record.last_verified_step,
                                                last_replay_step=record.last_replay_step))
        return record

    # ------------------------------------------------------------------ the step hook
    def after_backward(self, step: int, batch: Any, loss: torch.Tensor | float, *,
                       loss_scale: float | None = None) -> StepVerdict:
        """Run everything due at ``step`` after the training backward; every rank calls it each step.

        ``batch`` is the step's microbatch, or with gradient accumulation its *last* microbatch (the
        one the self-check recomputes); ``loss`` is the unscaled loss. With mixed precision pass
        ``loss_scale=scaler.get_scale()``: recomputations scale their loss the same way (so the bits
        still match), the invariants see the unscaled gradient norm, and a non-finite gradient with a
        finite loss on every rank counts as the scaler's own overflow (``scaler_overflows_total``; the
        scaler skips that step itself).
        """
        try:
            return self._after_backward(step, batch, loss, loss_scale)
        finally:
            self.checker.finish()

    def _after_backward(self, step: int, batch: Any, loss: torch.Tensor | float,
                        loss_scale: float | None) -> StepVerdict:
        micro = max(1, self.checker.forwards)
        if micro > 1 and not self.accumulation_seen:
            self.accumulation_seen = True
            _log.info("fleethealth: gradient accumulation seen (%d forwards before step %d's check): the self-check "
                      "compares the last microbatch's own gradients", micro, step)
        scale = self.recompute.loss_scale = None if loss_scale is None else float(loss_scale)
        if self.startup_report is None:
            self.startup(batch)
        self._last_step = step
        loss_value, norm = self._loss_and_norm(loss)
        norm /= scale or 1.0
        fold = self.distributed and self.ddp and self.sync_invariants
        if fold:
            codes, inv = self._invariants_folded(step, loss_value, norm, scale)
        else:
            codes, inv = self._invariants_gathered(step, loss_value, norm, scale)
        anomaly = bool((codes != _CODE_OK).any())
        joint = anomaly and (self.sync_invariants or not self.distributed)  # every rank knows of it
        checks: list[CheckResult] = []
        sc_step = bool(self.every) and step % self.every == 0
        state = _SC_NONE
        if self.selfcheck_due(step) or anomaly:
            sc = self.selfcheck(step, batch)
            checks.append(sc)
            state = _SC_PASS if sc.passed else _SC_FAIL
        advice = self._advice_ints() if sc_step else [-1, -1]
        if fold and (sc_step or anomaly):  # the one gather of the step: every rank's code, check state, advice
            rows = self._gather_ints([int(codes[0]), state, *advice], "verdict")
            codes, states, advised = rows[:, 0], rows[:, 1], rows[:, 2:]
            anomaly = bool((codes != _CODE_OK).any())
            joint = anomaly
        elif sc_step or joint:
            rows = self._gather_ints([state, *advice], "selfcheck")
            states, advised = rows[:, 0], rows[:, 1:]
        else:
            states, advised = np.array([state]), np.array([advice])
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
            self.watermark.record(step, self._last_replay.all_agreed, "replay")
        failed_sc = [int(r) for r in np.flatnonzero(states == _SC_FAIL)]
        replay_bad = [i for i in self._last_replay.incidents if not i.agreed] if replay_sources is not False else []
        check, culprits, classification = None, (), None
        if failed_sc:
            check, culprits, classification = "selfcheck", tuple(failed_sc), Classification.TRANSIENT
        elif replay_bad:
            check = "replay"
            culprits = tuple(sorted({i.culprit for i in replay_bad if i.culprit is not None}))
            classification = (self._classify_anomaly(codes, states, nan_ranks, joint) if anomaly
                              else replay_bad[0].classification)
        elif anomaly:
            check, culprits = "invariants", tuple(nan_ranks)
            classification = self._classify_anomaly(codes, states, nan_ranks, joint)
        culprits = tuple(global_rank(self.group, int(r)) for r in culprits)
        verdict = StepVerdict(step=step, skip_update=anomaly or bool(failed_sc) or bool(replay_bad),
                              invariants=inv, checks=tuple(checks), classification=classification,
                              check=check, culprits=culprits, microbatches=micro)
        if check in ("selfcheck", "replay") and self.failure is None:
            self.failure = verdict
        rollback_to, why = self._rollback_decision(step, advised)
        if rollback_to is not None or why:
            verdict = dataclasses.replace(verdict, rollback_to=rollback_to, rollback_reason=why)
        if self.watchdog is not None:
            self.watchdog.beat(step)
        if nan_ranks or (codes == _CODE_NAN_GRAD).any():
            self.on_nonfinite(inv, None if classification is None else classification.value)
        return verdict

    def _code(self, reason: str) -> int:
        return {"": _CODE_OK, "grad_spike": _CODE_SPIKE, "nonfinite_loss": _CODE_NAN_LOSS,
                "nonfinite_grad": _CODE_NAN_GRAD}[reason]

    def _invariants_gathered(self, step: int, loss_value: float, norm: float,
                             scale: float | None) -> tuple[np.ndarray, InvariantVerdict]:
        """Each rank judges its own loss and norm; the codes are all-gathered every step
        (``sync_invariants``) so every rank skips, classifies and aborts together."""
        if scale is not None and math.isfinite(loss_value) and not math.isfinite(norm):
            self.scaler_overflows_total += 1
            inv = InvariantVerdict(step, loss_value, norm, self.invariants.ceiling(), False, "")
        else:
            inv = self.invariants.check(step, loss_value, norm)
        code = self._code(inv.reason)
        codes = self._gather_ints([code], "invariants")[:, 0] if self.sync_invariants else np.array([code])
        return codes, inv

    def _invariants_folded(self, step: int, loss_value: float, norm: float,
                           scale: float | None) -> tuple[np.ndarray, InvariantVerdict]:
        """Under DDP the gradient norm is taken on the all-reduced gradients, identical on every rank,
        so the decision whether anything is wrong needs no collective of its own: a rank's non-finite
        loss makes every rank's reduced gradient non-finite, a spike on one rank shows in the reduced
        norm. The invariants are judged on the reduced norm alone (so their state stays identical on
        every rank); only when they fire, or on a check step, do the ranks gather their own codes
        (:meth:`_after_backward`). A rank whose loss alone is non-finite while the reduced gradient is
        finite is logged: the update it shares with every rank is finite."""
        local_nan = not math.isfinite(loss_value)
        ceiling = self.invariants.ceiling()
        if scale is not None and not math.isfinite(norm):
            # AMP: an overflow of the scaler, unless a rank's loss was non-finite (the gather decides)
            rows = self._gather_ints([_CODE_NAN_LOSS if local_nan else _CODE_OK], "invariants")[:, 0]
            if not (rows == _CODE_NAN_LOSS).any():
                self.scaler_overflows_total += 1
                return np.array([_CODE_OK]), InvariantVerdict(step, loss_value, norm, ceiling, False, "")
        inv = self.invariants.check(step, 0.0, norm)
        if local_nan:
            if inv.reason == "":
                _log.warning("fleethealth: non-finite loss %s on rank %d at step %d with a finite all-reduced "
                             "gradient; the update is applied on every rank", loss_value, self.job_rank, step)
            else:
                inv = InvariantVerdict(step, loss_value, norm, inv.ceiling, True, "nonfinite_loss")
        elif inv.loss != loss_value:
            inv = InvariantVerdict(step, loss_value, norm, inv.ceiling, inv.skip_update, inv.reason)
        code = self._code(inv.reason)
        return np.array([code]), inv

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

    # ------------------------------------------------------------------ rollback
    def _advice_ints(self) -> list[int]:
        """This rank's newest policy advice not yet carried out: ``[target_step, failed_step]`` (-1: none)."""
        if self.inbox is None:
            return [-1, -1]
        self.inbox.poll()
        a = self.inbox.latest
        if (a is None or a.target_step is None or a.id in self._handled_ids
                or (a.failed_step is not None and a.failed_step in self._handled)):
            return [-1, -1]
        return [a.target_step, -1 if a.failed_step is None else a.failed_step]

    def _rollback_decision(self, step: int, advised: np.ndarray) -> tuple[int | None, str]:
        """The checkpoint step every rank restores now, from values every rank holds: the guard's own
        failure at this step (the policy's rule over the watermark and the book), else the newest
        policy advice any rank has received (gathered on check steps)."""
        if self.failure is not None and self.failure.step == step:
            target = self.rollback_target()
            cls = "unclassified" if self.failure.classification is None else self.failure.classification.value
            if target is None:
                return None, (f"{self.failure.check} failed at step {step} ({cls}) and no checkpoint at or before "
                              "a passing check is known: needs a human")
            return target.step, f"{self.failure.check} failed at step {step} ({cls})"
        rows = advised[(advised[:, 0] >= 0)] if advised.size else advised
        if not len(rows):
            return None, ""
        target_step, failed_step = (int(v) for v in max(map(tuple, rows.tolist()), key=lambda r: (r[1], r[0])))
        if target_step >= step:
            return None, ""
        if not any(c.step == target_step for c in self.book):
            self._handled.add(failed_step)
            if self.inbox is not None and self.inbox.latest is not None:
                self._handled_ids.add(self.inbox.latest.id)
            _log.error("fleethealth: the policy advises a rollback to step %d, which is not a checkpoint this "
                       "job recorded (%s); ignored", target_step, [c.step for c in self.book])
            return None, ""
        return target_step, f"the policy's rollback for the failure at step {failed_step}"

    def rollback_target(self, checkpoints: Sequence[_C] | None = None) -> _C | CheckpointRecord | None:
        """The checkpoint to roll back to after the first failed check since the last
        :meth:`rolled_back` (``None``: no failure, or no clean checkpoint). The same rule as the
        policy's (:func:`~fleethealth.payloads.rollback.choose`): the watermark's marks and each
        checkpoint record's marks before the failing step, the bound for the agreed classification, and
        only validated checkpoints once :attr:`validity` holds results.
        ``checkpoints`` default to the guard's own :attr:`book`."""
        if self.failure is None:
            return None
        book: Sequence[Any] = self.book if checkpoints is None else checkpoints
        cls = None if self.failure.classification is None else self.failure.classification.value
        marks = [self.watermark.marks] + [c.marks for c in book if isinstance(c, CheckpointRecord)]
        return choose(book, marks, cls, self.failure.step, validity=self.validity)[2]

    def rolled_back(self, step: int) -> list[CheckpointRecord]:
        """The loop restored the checkpoint of ``step`` (it includes that step's update): the
        watermark resumes from it (:meth:`Watermark.reset`), the failure is forgotten, and the next
        step the loop runs is ``step + 1``. Returns the checkpoints of the abandoned steps (newer than
        ``step``), dropped from the book: the loop deletes their files."""
        if self.failure is not None:
            self._handled.add(self.failure.step)
        latest = None if self.inbox is None else self.inbox.latest
        if latest is not None and latest.target_step == step:
            self._handled_ids.add(latest.id)
            if latest.failed_step is not None:
                self._handled.add(latest.failed_step)
        self.watermark.reset(step)
        self.failure = None
        self._last_step = step
        dropped = [c for c in self.book if c.step > step]
        self.book = [c for c in self.book if c.step <= step]
        return dropped

    def prune(self, checkpoints: Sequence[_C] | None = None) -> list[_C] | list[CheckpointRecord]:
        """The checkpoints the loop may delete now: none a rollback could need under the current marks
        (:func:`~fleethealth.payloads.rollback.deletable`). Nothing while a failure awaits its
        rollback. Without ``checkpoints`` the guard's :attr:`book` is used and the returned records
        leave it."""
        if self.failure is not None:
            return []
        if checkpoints is not None:
            return self.watermark.deletable(checkpoints)
        gone = self.watermark.deletable(self.book)
        self.book = [c for c in self.book if all(c is not g for g in gone)]
        return gone
