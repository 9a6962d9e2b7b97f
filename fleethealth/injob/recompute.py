"""Recompute one microbatch's gradients on this rank's device, as the training pass did: the same
RNG snapshot (so dropout masks match), the same loss scale, buffers and ``.grad`` left untouched.
The self-check, the replay and the start-up probe all compare such recomputations."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["LossFn", "RngState", "Recompute"]

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]
RngState = tuple[torch.Tensor, torch.Tensor | None]
"""The CPU generator state and, on a CUDA device, that device's generator state."""


class Recompute:
    """``recompute(batch, rng=None)`` -> this rank's gradients for ``batch``, one per parameter.

    ``rng`` is the step's RNG snapshot (set by :meth:`SdcGuard.begin`); ``loss_scale`` multiplies the
    loss as ``GradScaler.scale(loss)`` did for the training pass (``None``: no scaling).
    """

    def __init__(self, module: torch.nn.Module, params: Sequence[torch.nn.Parameter], loss_fn: LossFn) -> None:
        self.module = module
        self.params = list(params)
        self.loss_fn = loss_fn
        self.device = self.params[0].device
        self.rng: RngState | None = None
        self.loss_scale: float | None = None
        self.active = False
        """True while a recomputation runs (hooks on the training pass ignore it)."""

    def snapshot_rng(self) -> RngState:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.get_rng_state(), cuda

    def rng_snapshot(self) -> RngState:
        """The step's snapshot, taken now if none was."""
        if self.rng is None:
            self.rng = self.snapshot_rng()
        return self.rng

    def __call__(self, batch: Any, rng: RngState | None = None) -> list[torch.Tensor]:
        """This rank's gradients for ``batch`` on its device, leaving RNG, buffers and ``.grad`` untouched.

        ``rng``: the RNG snapshot to replay under (default: the step's snapshot)."""
        was, self.active = self.active, True
        try:
            return self._run(batch, rng)
        finally:
            self.active = was

    def _run(self, batch: Any, rng: RngState | None) -> list[torch.Tensor]:
        rng = rng if rng is not None else self.rng
        buffers = [b.detach().clone() for b in self.module.buffers()]
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            if rng is not None:
                torch.set_rng_state(rng[0])
                if rng[1] is not None and self.device.type == "cuda":
                    torch.cuda.set_rng_state(rng[1], self.device)
            loss = self.loss_fn(self.module, batch)
            if self.loss_scale is not None:  # as GradScaler.scale(loss) did for the training pass
                loss = loss * self.loss_scale
            grads = torch.autograd.grad(loss, self.params, allow_unused=True)
        with torch.no_grad():
            for b, saved in zip(self.module.buffers(), buffers, strict=True):
                b.copy_(saved)
        return [torch.zeros_like(p) if g is None else g for g, p in zip(grads, self.params, strict=True)]
