"""The guard's own rollback (a transient fault, in the job) lands only on a validated checkpoint once the
loop gives it validation results, the same rule as the policy's."""

from __future__ import annotations

import torch

from fleethealth.injob.guard import SdcGuard
from fleethealth.injob.reporter import Reporter


def _loss(module: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.cross_entropy(module(x), y)


def _run(validity: dict[int, bool]) -> tuple[int | None, str]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    flip = {"armed": False}

    def corrupt(grad: torch.Tensor) -> torch.Tensor:   # one bit of the training pass, never the recomputation
        if not flip["armed"]:
            return grad
        out = grad.clone()
        out.reshape(-1).view(torch.int32)[3] ^= 1 << 22
        return out

    model[0].weight.register_hook(corrupt)
    guard = SdcGuard(model, _loss, every=10, replay_every=0, reporter=Reporter(job="j", rank=0, sink=lambda e: None),
                     follow_advice=False)
    guard.validity = validity
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(7)
    try:
        for step in range(41):
            batch = (torch.randn(8, 8, generator=gen), torch.randint(0, 3, (8,), generator=gen))
            guard.begin(step)
            flip["armed"] = step == 40
            loss = _loss(model, batch)
            loss.backward()
            flip["armed"] = False
            verdict = guard.after_backward(step, batch, loss)
            if not verdict.skip_update:
                opt.step()
            opt.zero_grad()
            if step in (10, 20, 30):
                guard.checkpoint(step, f"/ck/{step}")
        return verdict.rollback_to, verdict.rollback_reason
    finally:
        guard.close()


def test_the_guard_skips_an_invalid_checkpoint_and_keeps_the_marks_rule_without_results():
    assert _run({})[0] == 30                                   # no validation results: the marks alone
    assert _run({10: True, 20: True, 30: False})[0] == 20      # the newest is invalid: the one before it
    target, why = _run({10: False, 20: False, 30: False})
    assert target is None and "needs a human" in why
