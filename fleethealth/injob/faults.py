"""Fault injection for proving the in-job SDC defence on a real run (off unless asked).

Nothing here runs unless a training loop builds a :class:`FaultInjector` and attaches it; a job
without one carries no hook at all. Two fault models, after what silent data corruption looks like
on real hardware (seed 000 §7):

- ``transient`` — one bit of one gradient element flips on one rank at one step, once: a tensor
  hook on the chosen parameter XORs ``bit`` of its element ``index`` in the *training pass*'s
  gradient (before DDP copies it into a bucket), then disarms, so the self-check's recomputation of
  the same microbatch sees the healthy value. The bitwise self-check is the check that sees it.
- ``deterministic`` — from ``step`` on, every output of the chosen ``Linear`` (a matmul) on the
  rank has ``bit`` of its element ``index`` flipped, every time: the same wrong answer twice, so the
  self-check passes and only the cross-rank replay sees it.

::

    fault = FaultInjector("deterministic", step=50, bit=22)
    fault.attach(model)              # the unwrapped module, on the faulty rank only
    for step, batch in ...:
        fault.begin(step)            # before the forward
        ...
    fault.fired_at                   # the first step the fault changed a value (None: never)

``target`` names the parameter (transient) or module (deterministic) by its dotted name; the
default is the first parameter with a gradient / the first ``Linear``.
"""

from __future__ import annotations

from typing import Any

import torch

from fleethealth.errors import ConfigError

__all__ = ["FAULT_KINDS", "FaultInjector"]

FAULT_KINDS = ("transient", "deterministic")


def _flip(value: torch.Tensor, bit: int) -> torch.Tensor:
    """``value`` (one float32 element) with ``bit`` of its IEEE-754 word flipped."""
    word = value.detach().to(torch.float32).reshape(1).view(torch.int32)
    return (word ^ (1 << bit) if bit < 31 else word ^ torch.iinfo(torch.int32).min).view(torch.float32)[0]


class FaultInjector:
    """One injected fault (``kind`` in :data:`FAULT_KINDS`) starting at ``step``; see the module docstring.

    ``bit``: which bit of the float32 word to flip (0-30 mantissa/exponent, 31 the sign);
    ``index``: which element (flat index) of the gradient or output; ``target``: the parameter or
    module name (default: the first one that fits).
    """

    def __init__(self, kind: str, *, step: int, bit: int = 22, index: int = 0, target: str | None = None) -> None:
        if kind not in FAULT_KINDS:
            raise ConfigError(f"unknown fault {kind!r} (known: {', '.join(FAULT_KINDS)})")
        if not isinstance(step, int) or step < 0:
            raise ConfigError(f"fault step must be a non-negative integer, got {step!r}")
        if not 0 <= bit <= 31:
            raise ConfigError(f"fault bit must be 0..31, got {bit!r}")
        self.kind, self.step, self.bit, self.index, self.target = kind, step, bit, index, target
        self.current: int | None = None
        self.fired_at: int | None = None
        self.fired_total = 0
        self._armed = False
        self._handle: Any = None

    def attach(self, module: torch.nn.Module) -> FaultInjector:
        """Install the hook on ``module`` (the unwrapped model, not a DDP wrapper)."""
        if self._handle is not None:
            raise ConfigError("the fault injector is already attached")
        if self.kind == "transient":
            params = dict(module.named_parameters())
            name = self.target or next((n for n, p in params.items() if p.requires_grad), None)
            if name not in params:
                raise ConfigError(f"no parameter {name!r} to inject a transient fault into")
            self._check_index(params[name].numel(), name)
            self._handle = params[name].register_hook(self._on_grad)
        else:
            modules = dict(module.named_modules())
            name = self.target or next((n for n, m in modules.items() if isinstance(m, torch.nn.Linear)), None)
            if name not in modules:
                raise ConfigError(f"no module {name!r} to inject a deterministic fault into")
            self._handle = modules[name].register_forward_hook(self._on_output)
        return self

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def begin(self, step: int) -> None:
        """Call before the forward of ``step``: arms the one-shot transient flip at its step."""
        self.current = step
        self._armed = self.kind == "transient" and step == self.step and self.fired_at is None

    def _check_index(self, numel: int, name: str) -> None:
        if not 0 <= self.index < numel:
            raise ConfigError(f"fault index {self.index} is outside {name} ({numel} elements)")

    def _note(self) -> None:
        self.fired_total += 1
        if self.fired_at is None:
            self.fired_at = self.current

    def _on_grad(self, grad: torch.Tensor) -> torch.Tensor | None:
        if not self._armed:
            return None
        self._armed = False  # once: the recomputation of the same microbatch sees the healthy value
        out = grad.clone()
        flat = out.view(-1)
        flat[self.index] = _flip(flat[self.index], self.bit).to(out.dtype)
        self._note()
        return out

    def _on_output(self, _module: torch.nn.Module, _inputs: Any, output: torch.Tensor) -> torch.Tensor | None:
        if self.current is None or self.current < self.step:
            return None
        self._check_index(output.numel(), "the module's output")
        with torch.no_grad():
            flat = output.detach().reshape(-1)
            delta = torch.zeros_like(flat)
            delta[self.index] = _flip(flat[self.index], self.bit).to(flat.dtype) - flat[self.index]
        self._note()
        return output + delta.view_as(output)
