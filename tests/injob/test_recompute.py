"""Recomputing a microbatch: the same gradients under the step's RNG snapshot, nothing of the
training state disturbed (RNG, buffers, ``.grad``), and the loss scale applied as the scaler does."""

from __future__ import annotations

import torch

from fleethealth.injob.recompute import Recompute


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Dropout(0.5),
                               torch.nn.Linear(16, 1))


def _loss(module: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return module(batch).square().mean()


def test_same_snapshot_same_gradients_and_nothing_disturbed() -> None:
    model = _model().train()
    params = list(model.parameters())
    recompute = Recompute(model, params, _loss)
    batch = torch.randn(32, 8)
    recompute.rng = recompute.snapshot_rng()
    rng_before = torch.get_rng_state()
    buffers_before = [b.clone() for b in model.buffers()]
    first, second = recompute(batch), recompute(batch)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), buffers_before, strict=True))
    assert all(p.grad is None for p in params)
    # another dropout mask (a fresh snapshot after the generator moved) gives other gradients
    torch.rand(1)
    other = recompute(batch, rng=recompute.snapshot_rng())
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))


def test_loss_scale_scales_the_gradients_and_unused_parameters_read_zero() -> None:
    model = _model().eval()
    extra = torch.nn.Parameter(torch.ones(3))
    recompute = Recompute(model, [*model.parameters(), extra], _loss)
    batch = torch.randn(4, 8)
    plain = recompute(batch)
    recompute.loss_scale = 1024.0
    scaled = recompute(batch)
    assert all(torch.equal(a * 1024.0, b) for a, b in zip(plain, scaled, strict=True))
    assert torch.equal(plain[-1], torch.zeros(3))
    assert recompute.rng_snapshot() is recompute.rng_snapshot()  # taken once, then kept
