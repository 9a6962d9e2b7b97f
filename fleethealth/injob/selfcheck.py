"""The bitwise self-check (seed 000 §7, R3 first layer): a rank recomputes its own microbatch and
compares the gradients' bits with the training pass's.

The training pass's gradients are ``.grad`` for a plain module; under DDP each bucket is digested by a
communication hook before its all-reduce (:meth:`SelfCheck.comm_hook`), and on other steps the hook
keeps one gradient norm per bucket so the training pass can still be re-checked after an anomaly.

Gradient accumulation (several forwards and backwards per optimizer step, with or without DDP's
``no_sync``): ``.grad`` and the DDP buckets then hold the *sum* over the microbatches, which no
recomputation of one microbatch reproduces. So on check steps tensor hooks on the parameters copy
each backward's own gradient (before it is accumulated; the last backward's copy survives), and a
step with more than one forward compares that copy with a recomputation of the last microbatch
(the ``batch`` passed to the check). Where the loop divides each microbatch's loss by the number of
microbatches and ``loss_fn`` does not, the recomputation is retried once with the loss scaled by
``1 / forwards`` (the same root gradient, so the same bits); a scale that makes it pass is kept.
Where the backward is not bitwise reproducible, :meth:`SelfCheck.probe` measures the spread of
healthy recomputations and the check falls back to a relative tolerance (``tolerance``).
"""

from __future__ import annotations

import logging
import os
import re
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from fleethealth.injob.digest import (
    BitDigest,
    PendingDigest,
    bit_digest,
    bit_digest_async,
    fingerprint,
    fingerprint_distance,
)
from fleethealth.injob.recompute import Recompute
from fleethealth.injob.results import CheckResult, NondeterminismWarning, fingerprint_hex
from fleethealth.injob.watchdog import HangWatchdog
from fleethealth.payloads.sdc_check import CheckKind, Classification

__all__ = ["SelfCheck", "enable_determinism", "restore_determinism"]

_log = logging.getLogger("fleethealth.injob")
_NONDET_OP = re.compile(r"(\S+) does not have a deterministic implementation")


def enable_determinism() -> tuple[bool, bool, bool]:
    """Ask torch for deterministic algorithms; returns the previous setting for :func:`restore_determinism`.

    ``torch.utils.deterministic.fill_uninitialized_memory`` (which deterministic mode turns on: every
    ``torch.empty`` filled with NaN, a debugging aid) is switched off: it makes no well-defined op
    more reproducible and cost 4 % of a small transformer's CPU step (``bench/injob_overhead.py``)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    fill = _fill_module()
    prev = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
            bool(getattr(fill, "fill_uninitialized_memory", False)))
    # warn_only: an op without a deterministic kernel warns (and start-up names it) instead of
    # making the training step raise
    torch.use_deterministic_algorithms(True, warn_only=True)
    if fill is not None:
        fill.fill_uninitialized_memory = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    return prev


def _fill_module() -> Any:
    return getattr(getattr(torch, "utils", None), "deterministic", None)


def restore_determinism(prev: tuple[bool, ...]) -> None:
    torch.use_deterministic_algorithms(prev[0], warn_only=prev[1])
    fill = _fill_module()
    if fill is not None and len(prev) > 2:
        fill.fill_uninitialized_memory = prev[2]


class SelfCheck:
    """One rank's self-check of its training pass against a recomputation.

    ``names`` are the checked parameters' names (in ``recompute.params`` order); ``ddp``: the model is
    wrapped in ``DistributedDataParallel`` (install :meth:`comm_hook`); ``compare_training_pass``:
    digest the training pass (``False`` compares two recomputations). ``margin`` / ``floor`` set the
    fallback tolerance from the probe's spread.
    """

    def __init__(self, recompute: Recompute, names: tuple[str, ...], *, ddp: bool, compare_training_pass: bool,
                 margin: float, floor: float) -> None:
        self.recompute = recompute
        self.names = names
        self.ddp = ddp
        self.compare_training_pass = compare_training_pass
        self.margin, self.floor = margin, floor
        self.tolerance: float | None = None
        self._begun: int | None = None
        self._capture_step: int | None = None
        self._captured: list[tuple[list[int], PendingDigest]] = []
        self._bucket_norms: list[tuple[list[int], torch.Tensor]] = []
        self._index_of = {p.data_ptr(): i for i, p in enumerate(recompute.params)}
        # gradient accumulation: each backward's own gradients on check steps (see the module docstring)
        self._micro_handles: list[Any] = []
        self._micro: list[torch.Tensor | None] = []
        self._micro_at: list[int] = []
        self.forwards = 0
        self._fired: set[int] = set()  # the forward counts at which a backward's hooks fired (check steps)
        self.accumulation_scale: float | None = None

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return self.recompute.params

    # ------------------------------------------------------------------ the training pass
    def arm(self, step: int, capture: bool) -> None:
        """Before the forward of ``step``: forget the last step's capture; ``capture`` the training
        pass's bucket digests at this step (a check step)."""
        self._captured = []
        self._bucket_norms = []
        self._begun = step
        self._capture_step = step if capture else None
        self.forwards = 0
        self._fired = set()
        self.release()
        if capture:
            self._micro = [None] * len(self.params)
            self._micro_at = [-1] * len(self.params)
            self._micro_handles = [p.register_hook(self._micro_hook(i)) for i, p in enumerate(self.params)]

    def _micro_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if self.recompute.active:  # the guard's own recomputation, not the training pass
                return
            buf = self._micro[i]
            if buf is None or buf.shape != grad.shape or buf.dtype != grad.dtype:
                buf = self._micro[i] = torch.empty_like(grad)
            buf.copy_(grad.detach())
            self._micro_at[i] = self.forwards
            self._fired.add(self.forwards)
        return hook

    def release(self) -> None:
        """Remove the per-backward capture hooks (end of a check step)."""
        for h in self._micro_handles:
            h.remove()
        self._micro_handles = []

    def _micro_digest(self, step: int) -> BitDigest | None:
        """The last backward's own gradients at ``step`` (``None`` if they were not captured)."""
        if self._capture_step != step or not self._micro or not self._training_pass_known(step):
            return None
        grads = [torch.zeros_like(p) if g is None or at != self.forwards else g
                 for g, at, p in zip(self._micro, self._micro_at, self.params, strict=True)]
        return bit_digest(grads, self.names)

    def clear_norms(self) -> None:
        self._bucket_norms = []

    def finish(self) -> None:
        """End of a step's checks: drop the capture hooks and the per-bucket norms; count afresh."""
        self.release()
        self._micro = []
        self._fired = set()
        self._bucket_norms = []
        self.forwards = 0

    def accumulated(self, step: int) -> bool:
        """Whether ``.grad`` (and the DDP buckets) at ``step`` sum several backwards. Where the
        backwards were watched (check steps) it is counted; elsewhere any step with more than one
        training forward counts as one (the safe side: the check then recomputes twice)."""
        if self._capture_step == step and self._fired:
            return len(self._fired) > 1
        return self.forwards > 1

    def count_forward(self) -> None:
        """A training forward began (the guard's forward pre-hook; recomputations do not count)."""
        if not self.recompute.active and torch.is_grad_enabled() and self.recompute.module.training:
            self.forwards += 1
            self.recompute.rng = self.recompute.snapshot_rng()  # this microbatch's dropout masks start here

    def comm_hook(self, group: Any, watchdog: HangWatchdog | None) -> Callable[..., Any]:
        """DDP communication hook: digest each bucket's local gradients (on check steps) before the
        default all-reduce, and name the collective for the watchdog. Built as a closure without
        annotations because DDP validates hook annotations against the runtime types."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def hook(state, bucket):  # noqa: ANN001, ANN202 - see the docstring
            if self.compare_training_pass and self.forwards <= 1:  # accumulated buckets hold a sum
                idx = [self._index_of[p.data_ptr()] for p in bucket.parameters()]
                if self._capture_step is not None:
                    pending = bit_digest_async(bucket.gradients(), [self.names[i] for i in idx])
                    self._captured.append((idx, pending))
                else:  # one norm kernel per bucket: enough to re-check the training pass after an anomaly
                    self._bucket_norms.append((idx, bucket.buffer().detach().norm()))
            if watchdog is not None:
                watchdog.collective(f"ddp.all_reduce(bucket {bucket.index()})")
            return allreduce_hook(group, bucket)

        return hook

    def _training_grads(self) -> list[torch.Tensor] | None:
        if self.ddp or not self.compare_training_pass:
            return None
        return [torch.zeros_like(p) if p.grad is None else p.grad for p in self.params]

    def _training_pass_known(self, step: int) -> bool:
        """False when the training pass used dropout masks the guard cannot replay (no begin(step))."""
        return self._begun == step or not any(
            m.training and isinstance(m, torch.nn.modules.dropout._DropoutNd) for m in self.recompute.module.modules())

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

    # ------------------------------------------------------------------ start-up and the check
    def probe(self, batch: Any) -> tuple[bool, str | None, tuple[str, ...]]:
        """Recompute ``batch`` twice and compare bit for bit: ``(deterministic, op torch named,
        mismatched parameters)``. When not deterministic, set ``tolerance`` from three recomputations'
        spread and warn (:class:`NondeterminismWarning`)."""
        op = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                g1, g2 = self.recompute(batch), self.recompute(batch)
            except RuntimeError as exc:  # strict mode set by the caller: torch refuses and names the op
                match = _NONDET_OP.search(str(exc))
                if match is None:
                    raise
                op = match.group(1)
                torch.use_deterministic_algorithms(True, warn_only=True)
                g1, g2 = self.recompute(batch), self.recompute(batch)
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
                g3 = self.recompute(batch)
            fps = [fingerprint(g1), fingerprint(g2), fingerprint(g3)]
            spread = max(fingerprint_distance(a, b) for i, a in enumerate(fps) for b in fps[i + 1:])
            self.tolerance = max(self.floor, self.margin * spread)
            what = f"op {op}" if op else "an op torch did not name"
            msg = (f"fleethealth: the backward is NOT bitwise deterministic ({what}; differing parameters: "
                   f"{', '.join(mismatched) or 'none seen in two runs'}). The self-check falls back to a "
                   f"relative tolerance of {self.tolerance:.3g} and will MISS corruption smaller "
                   "than that; replace the op with a deterministic one to restore the bitwise check.")
            warnings.warn(msg, NondeterminismWarning, stacklevel=3)
            _log.error(msg)
        return deterministic, op, mismatched

    def run(self, step: int, batch: Any, rank: int) -> CheckResult:
        """Recompute ``batch`` and compare with the training pass (or a first recomputation); ``rank``
        is the job rank the result names."""
        t0 = time.perf_counter()
        tol = None
        accumulated = self.accumulated(step)
        if self.tolerance is None and accumulated:
            passed, digests, mismatched = self._run_accumulated(step, batch)
        elif self.tolerance is None:
            first = self._training_digest(step)
            if first is None and not self._bucket_norms:  # e.g. DDP with two forwards and one backward
                first = self._micro_digest(step)
            grads = self.recompute(batch)
            if first is None and self._bucket_norms and self._training_pass_known(step):
                passed, digests, mismatched = self._compare_bucket_norms(grads)
            else:
                second = bit_digest(grads, self.names)
                if first is None:
                    first, second = second, bit_digest(self.recompute(batch), self.names)
                mismatched = tuple(first.mismatches(second))
                passed, digests = not mismatched and first == second, (first.hex, second.hex)
        else:
            grads = (None if accumulated else self._training_grads()) or self.recompute(batch)
            fa, fb = fingerprint(grads), fingerprint(self.recompute(batch))
            tol = self.tolerance
            passed, mismatched = fingerprint_distance(fa, fb) <= tol, ()
            digests = (fingerprint_hex(fa), fingerprint_hex(fb))
        return CheckResult(check=CheckKind.SELFCHECK, step=step, rank=rank, passed=passed,
                           classification=None if passed else Classification.TRANSIENT, digests=digests,
                           duration_s=time.perf_counter() - t0, tolerance=tol, mismatched=mismatched)

    def _recompute_scaled(self, batch: Any, scale: float | None) -> list[torch.Tensor]:
        prev = self.recompute.loss_scale
        if scale is not None:
            self.recompute.loss_scale = scale * (prev if prev is not None else 1.0)
        try:
            return self.recompute(batch)
        finally:
            self.recompute.loss_scale = prev

    def _run_accumulated(self, step: int, batch: Any) -> tuple[bool, tuple[str, str], tuple[str, ...]]:
        """A step of several microbatches: the last backward's own gradients against a recomputation
        of the last microbatch (two recomputations when they were not captured)."""
        first = self._micro_digest(step)
        second = bit_digest(self._recompute_scaled(batch, self.accumulation_scale), self.names)
        if first is None:
            first, second = second, bit_digest(self._recompute_scaled(batch, self.accumulation_scale), self.names)
        elif first != second and self.accumulation_scale is None:
            scale = 1.0 / len(self._fired)  # the loop divides its loss by the microbatch count; loss_fn does not
            again = bit_digest(self._recompute_scaled(batch, scale), self.names)
            if again == first:
                self.accumulation_scale = scale
                _log.info("fleethealth: gradient accumulation over %d microbatches: the loop divides the loss by "
                          "%d and loss_fn does not; recomputations scale their loss by 1/%d", self.forwards,
                          self.forwards, self.forwards)
                second = again
        mismatched = tuple(first.mismatches(second))
        return not mismatched and first == second, (first.hex, second.hex), mismatched


def _merge(pieces: Sequence[tuple[list[int], BitDigest]], names: tuple[str, ...]) -> BitDigest | None:
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
