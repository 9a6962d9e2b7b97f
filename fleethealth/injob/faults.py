"""Fault injection for proving the in-job SDC defence on a real run (off unless asked).

Nothing here runs unless a training loop builds a :class:`FaultInjector` and attaches it; a job
without one carries no hook at all. Two fault models, after what silent data corruption looks like
on real hardware (seed 000 §7):

- ``transient`` — one bit of one gradient element flips on one rank at one step, once: a tensor
  hook on the chosen parameter XORs ``bit`` of one element of the *training pass*'s gradient (before
  DDP copies it into a bucket), then disarms, so the self-check's recomputation of the same
  microbatch sees the healthy value. The bitwise self-check is the check that sees it.
- ``deterministic`` — from ``step`` on, every output of the chosen ``Linear`` (a matmul) on the
  rank has ``bit`` of one element flipped, every time: the same wrong answer twice, so the
  self-check passes and only the cross-rank replay sees it.

::

    fault = FaultInjector("deterministic", step=50, bit=22)
    fault.attach(model, probe=(loss_fn, batch))   # the unwrapped module, on the faulty rank only
    for step, batch in ...:
        fault.begin(step)            # before the forward
        ...
    fault.fired_at                   # the first step the fault changed a value (None: never)
    fault.note                       # why it did not, or changed nothing that matters

**Choosing a target that matters.** A corrupted value the loss does not depend on proves nothing:
in a causal transformer the first ``Linear``'s element 0 is token 0's query, which attends to one
key only, so its softmax is 1 whatever the query and the loss does not move. So by default the
deterministic fault corrupts the *last* element of the output (the last token of the last sequence,
which every causal model reads) and the transient fault the gradient element of largest magnitude
at the moment it fires (a flipped bit of a zero gradient changes nothing the optimizer applies).
``attach(..., probe=(loss_fn, batch))`` checks it: the deterministic fault takes the first
candidate ``Linear`` (``target``, else each in order) whose corruption changes ``loss_fn`` on the
probe batch, the transient fault the first parameter (``target``, else each in order) whose
gradient on the probe batch is not all zero; when none does, :class:`ConfigError` says so. A
transient fault that fires on an all-zero gradient sets :attr:`FaultInjector.note` and logs a
warning instead of reporting an effect it did not have.

**Gradient accumulation.** The self-check recomputes one microbatch: the last of the step (see
:mod:`~fleethealth.injob.selfcheck`). ``micro`` says which backward of the step the transient flip
lands in (0: the first; with N microbatches, ``N - 1`` is the one the self-check covers). A flip in
another microbatch is a fault the self-check cannot see, as on real hardware: its coverage of a
step is one microbatch in N.

**Cadences and detection latency.** At the guard's defaults (self-check every ``every`` = 100
steps, replay every ``replay_every`` = 10,000, both at step 0) a drill is detected:

=====================  ==============================================  ================================
fault                  detected at                                     latency for a run of L steps
=====================  ==============================================  ================================
transient at step s    step s only if s is a check step (s % every     0 steps, if s % 100 == 0 and
                       == 0) and the flip is in the checked            it lands in the last
                       microbatch; otherwise never by the self-check   microbatch; else undetected
deterministic from s   the first replay step after s                   ceil(s / 10,000) x 10,000 - s;
                                                                       none when that is >= L
=====================  ==============================================  ================================

So in a run shorter than ``replay_every`` steps (10,000 at the defaults) a deterministic fault that
starts after step 0 is never detected: a drill must set ``replay_every`` below the run length (the
demo uses 40 in a 120-step run) or put the fault before a replay step it will reach.
:func:`detection_step` computes the step for a drill's settings.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from fleethealth.errors import ConfigError

__all__ = ["FAULT_KINDS", "FaultInjector", "detection_step"]

_log = logging.getLogger("fleethealth.injob")

FAULT_KINDS = ("transient", "deterministic")


def _flip(value: torch.Tensor, bit: int) -> torch.Tensor:
    """``value`` (one float32 element) with ``bit`` of its IEEE-754 word flipped."""
    word = value.detach().to(torch.float32).reshape(1).view(torch.int32)
    return (word ^ (1 << bit) if bit < 31 else word ^ torch.iinfo(torch.int32).min).view(torch.float32)[0]


def detection_step(kind: str, step: int, *, every: int = 100, replay_every: int = 10_000,
                   run_steps: int | None = None) -> int | None:
    """The step at which the guard's checks see a fault injected at ``step`` (``None``: never within
    ``run_steps``): a transient flip at its own step if that is a self-check step (and it lands in the
    checked microbatch), a deterministic fault at the first replay step at or after ``step``."""
    if kind not in FAULT_KINDS:
        raise ConfigError(f"unknown fault {kind!r} (known: {', '.join(FAULT_KINDS)})")
    if kind == "transient":
        found = step if every and step % every == 0 else None
    else:
        found = math.ceil(step / replay_every) * replay_every if replay_every else None
    return None if found is None or (run_steps is not None and found >= run_steps) else found


class FaultInjector:
    """One injected fault (``kind`` in :data:`FAULT_KINDS`) starting at ``step``; see the module docstring.

    ``bit``: which bit of the float32 word to flip (0-30 mantissa/exponent, 31 the sign);
    ``index``: which element (flat index) of the gradient or output (``None``: the largest gradient
    element when the transient fires, the last output element for the deterministic fault);
    ``target``: the parameter or module name (default: the first one that fits); ``micro``: which
    backward of the step the transient flip lands in (gradient accumulation; 0 the first).
    """

    def __init__(self, kind: str, *, step: int, bit: int = 22, index: int | None = None, target: str | None = None,
                 micro: int = 0) -> None:
        if kind not in FAULT_KINDS:
            raise ConfigError(f"unknown fault {kind!r} (known: {', '.join(FAULT_KINDS)})")
        if not isinstance(step, int) or step < 0:
            raise ConfigError(f"fault step must be a non-negative integer, got {step!r}")
        if not 0 <= bit <= 31:
            raise ConfigError(f"fault bit must be 0..31, got {bit!r}")
        if not isinstance(micro, int) or micro < 0:
            raise ConfigError(f"fault micro must be a non-negative integer, got {micro!r}")
        self.kind, self.step, self.bit, self.index, self.target = kind, step, bit, index, target
        self.micro = micro
        self.current: int | None = None
        self.fired_at: int | None = None
        self.fired_total = 0
        self.note = ""
        """Empty, or why the fault did not change what it was meant to (it says so instead of claiming it)."""
        self.chosen: str | None = None
        """The parameter or module the fault was attached to."""
        self._armed = False
        self._backwards = 0
        self._handle: Any = None

    def attach(self, module: torch.nn.Module, *, probe: tuple[Callable[[torch.nn.Module, Any], torch.Tensor], Any]
               | None = None) -> FaultInjector:
        """Install the hook on ``module`` (the unwrapped model, not a DDP wrapper). With ``probe`` =
        ``(loss_fn, batch)``, choose a target whose corruption changes the loss (see the module
        docstring); :class:`ConfigError` when there is none."""
        if self._handle is not None:
            raise ConfigError("the fault injector is already attached")
        if self.kind == "transient":
            params = dict(module.named_parameters())
            names = [self.target] if self.target else [n for n, p in params.items() if p.requires_grad]
            if not names or names[0] not in params:
                raise ConfigError(f"no parameter {names[0] if names else None!r} to inject a transient fault into")
            if probe is not None:
                names = self._with_gradient(module, names, probe)
            name = names[0]
            if self.index is not None:
                self._check_index(params[name].numel(), name)
            self._handle = params[name].register_hook(self._on_grad)
        else:
            modules = dict(module.named_modules())
            names = [self.target] if self.target else [n for n, m in modules.items() if isinstance(m, torch.nn.Linear)]
            if not names or names[0] not in modules:
                raise ConfigError(f"no module {names[0] if names else None!r} to inject a deterministic fault into")
            if probe is not None:
                names = self._changing_loss(module, modules, names, probe)
            name = names[0]
            self._handle = modules[name].register_forward_hook(self._on_output)
        self.chosen = name
        return self

    def _with_gradient(self, module: torch.nn.Module, names: list[str],
                       probe: tuple[Callable[[torch.nn.Module, Any], torch.Tensor], Any]) -> list[str]:
        params = dict(module.named_parameters())
        loss_fn, batch = probe
        grads = torch.autograd.grad(loss_fn(module, batch), [params[n] for n in names], allow_unused=True)
        good = [n for n, g in zip(names, grads, strict=True) if g is not None and bool((g != 0).any())]
        if not good:
            raise ConfigError(f"no gradient of {', '.join(names)} is non-zero on the probe batch: a flipped bit "
                              "there would not change the update or the loss; name another target")
        return good

    def _changing_loss(self, module: torch.nn.Module, modules: dict[str, torch.nn.Module], names: list[str],
                       probe: tuple[Callable[[torch.nn.Module, Any], torch.Tensor], Any]) -> list[str]:
        loss_fn, batch = probe
        with torch.no_grad():
            healthy = loss_fn(module, batch)
            good = []
            for n in names:
                self.current = self.step
                handle = modules[n].register_forward_hook(self._on_output)
                try:
                    changed = not torch.equal(loss_fn(module, batch), healthy)
                finally:
                    handle.remove()
                    self.current, self.fired_at, self.fired_total = None, None, 0
                if changed:
                    good.append(n)
                    break
        if not good:
            raise ConfigError(f"corrupting element {self._where()} of {', '.join(names)} does not change the loss "
                              "on the probe batch; name another target or index")
        return good

    def _where(self) -> str:
        return "the last" if self.index is None else str(self.index)

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def begin(self, step: int) -> None:
        """Call before the forward of ``step``: arms the one-shot transient flip at its step."""
        self.current = step
        self._backwards = 0
        self._armed = self.kind == "transient" and step == self.step and self.fired_at is None

    def _check_index(self, numel: int, name: str) -> None:
        if not -numel <= self.index < numel:  # type: ignore[operator]
            raise ConfigError(f"fault index {self.index} is outside {name} ({numel} elements)")

    def _note(self) -> None:
        self.fired_total += 1
        if self.fired_at is None:
            self.fired_at = self.current

    def _on_grad(self, grad: torch.Tensor) -> torch.Tensor | None:
        if not self._armed:
            return None
        self._backwards += 1
        if self._backwards <= self.micro:
            return None
        self._armed = False  # once: the recomputation of the same microbatch sees the healthy value
        out = grad.clone()
        flat = out.view(-1)
        i = int(flat.abs().argmax()) if self.index is None else self.index
        if float(flat[i]) == 0.0:
            self.note = (f"step {self.current}: the gradient element chosen is 0; flipping bit {self.bit} would "
                         "change no update, so the fault did not fire")
            _log.warning("fleethealth: fault injector: %s", self.note)
            return None
        flat[i] = _flip(flat[i], self.bit).to(out.dtype)
        self._note()
        return out

    def _on_output(self, _module: torch.nn.Module, _inputs: Any, output: torch.Tensor) -> torch.Tensor | None:
        if self.current is None or self.current < self.step:
            return None
        self._check_index(output.numel(), "the module's output") if self.index is not None else None
        i = output.numel() - 1 if self.index is None else self.index
        with torch.no_grad():
            flat = output.detach().reshape(-1)
            delta = torch.zeros_like(flat)
            delta[i] = _flip(flat[i], self.bit).to(flat.dtype) - flat[i]
        self._note()
        return output + delta.view_as(output)
