"""The rollback loop in one process: checkpoint step semantics, pruning only what the watermark
does not need, the guard's own target, and the policy's advice read through the inbox without
blocking (the probe side is tests/probe/test_rollback_relay.py)."""

from __future__ import annotations

import time

import pytest
import torch

from fleethealth.errors import ConfigError
from fleethealth.injob.guard import SdcGuard
from fleethealth.injob.inbox import RollbackInbox
from fleethealth.injob.reporter import Reporter
from fleethealth.payloads.advice import Advice, write_advice
from fleethealth.payloads.checkpoint import CheckpointRecord
from fleethealth.payloads.rollback import Marks, choose, deletable, retained


def loss_fn(module: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.cross_entropy(module(x), y)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def _guard(tmp_path, **kw) -> tuple[SdcGuard, torch.nn.Module, list]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 3))
    events: list = []
    guard = SdcGuard(model, loss_fn, every=2, reporter=Reporter(job="loop", rank=0, sink=events.append),
                     inbox=RollbackInbox("loop", tmp_path), **kw)
    return guard, model, events


def _run(guard: SdcGuard, model: torch.nn.Module, steps: int, *, flip_at: int | None = None,
         on_step=None) -> list[tuple[int, int | None]]:  # noqa: ANN001
    """Train ``steps`` steps with a checkpoint every 2 (kept in memory under its uri); return the
    (step, rollback_to) pairs of the rollbacks the loop carried out."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    saved: dict[str, dict] = {}
    fired = {"done": False}

    def flip(grad: torch.Tensor) -> torch.Tensor:
        if guard.checker.recompute.active or fired["done"] or step != flip_at:
            return grad
        fired["done"] = True
        grad = grad.clone()
        grad.view(-1).view(torch.int32)[0] ^= 1 << 22
        return grad

    model[0].weight.register_hook(flip)
    done, step = [], 0
    while step < steps:
        if on_step is not None:
            on_step(step)
        guard.begin(step)
        loss = loss_fn(model, _batch(step))
        loss.backward()
        v = guard.after_backward(step, _batch(step), loss)
        if not v.skip_update:
            opt.step()
        opt.zero_grad()
        if v.rollback_to is not None:
            target = next(c for c in guard.book if c.step == v.rollback_to)
            model.load_state_dict(saved[target.uri])
            for c in guard.rolled_back(target.step):
                saved.pop(c.uri)
            done.append((step, target.step))
            step = target.step + 1
            continue
        if step % 2 == 0:
            uri = f"mem://{step}"
            saved[uri] = {k: t.clone() for k, t in model.state_dict().items()}
            guard.checkpoint(step, uri)
            for c in guard.prune():
                saved.pop(c.uri)
        step += 1
    return done


def test_checkpoint_step_is_the_step_whose_update_it_includes(tmp_path) -> None:
    guard, model, _ = _guard(tmp_path)
    guard.begin(0)
    loss = loss_fn(model, _batch(0))
    with pytest.raises(ConfigError, match="after a forward of the next step"):
        guard.checkpoint(-1, "x")  # written mid-step: neither before nor after an update
    loss.backward()
    guard.after_backward(0, _batch(0), loss)
    with pytest.raises(ConfigError, match="not the last step the guard saw"):
        guard.checkpoint(1, "x")  # one step ahead: a rollback would land one update late
    assert guard.checkpoint(0, "x").step == 0


def test_transient_rolls_back_to_the_policys_target_and_prunes_only_what_is_not_needed(tmp_path) -> None:
    guard, model, events = _guard(tmp_path)
    assert _run(guard, model, 12, flip_at=6) == [(6, 4)]
    failed = [e for e in events if e.kind.value == "sdc_check" and not e.data["passed"]]
    assert [e.step for e in failed] == [6]
    # after the rollback the checks pass again and the book reaches on, pruned to what the marks need
    assert [c.step for c in guard.book] == [10] and guard.watermark.last_verified_step == 10
    assert guard.failure is None


def test_policy_advice_through_the_inbox_is_carried_out_once(tmp_path) -> None:
    guard, model, _ = _guard(tmp_path)

    def advise(step: int) -> None:
        if step == 9:  # the policy decided (on evidence from elsewhere, about step 9) while step 9 ran
            write_advice(tmp_path, Advice(id="r1", ts=time.time(), job="loop", target_step=8, target_uri="mem://8",
                                          failed_step=None, classification="transient", guard="allowed"))

    # read at the next check step (10), carried out once: the re-run of step 10 does not repeat it
    assert _run(guard, model, 14, on_step=advise) == [(10, 8)]


def test_advice_to_an_unknown_checkpoint_is_ignored(tmp_path, caplog) -> None:
    guard, model, _ = _guard(tmp_path)
    write_advice(tmp_path, Advice(id="r2", ts=time.time(), job="loop", target_step=3, target_uri=None,
                                  failed_step=5, classification="transient", guard="allowed"))
    assert _run(guard, model, 8) == []
    assert "not a checkpoint this job recorded" in caplog.text


def test_inbox_is_one_stat_when_nothing_changed_and_survives_bad_files(tmp_path) -> None:
    inbox = RollbackInbox("j/1", tmp_path)
    assert inbox.poll() is None  # no file yet
    a = Advice(id="a", ts=1.0, job="j/1", target_step=40, target_uri="u", failed_step=50,
               classification="transient", guard="allowed")
    path = write_advice(tmp_path, a)
    assert path.name == "j_1.json" and inbox.poll() == a and inbox.poll() is None
    path.write_bytes(b"{not json")
    assert inbox.poll() is None and inbox.errors_total == 1 and inbox.latest == a
    older = Advice(**{**a.to_obj(), "id": "old", "ts": 0.5})
    write_advice(tmp_path, older)
    assert inbox.poll() is None and inbox.latest == a  # never goes back to an older advice
    newer = Advice(**{**a.to_obj(), "id": "b", "ts": 2.0, "target_step": 60})
    write_advice(tmp_path, newer)
    assert inbox.poll() == newer
    assert not any(p.name.endswith(".tmp") for p in path.parent.iterdir())


def test_one_rule_for_guard_and_policy_and_deletable_is_the_complement_of_retained() -> None:
    book = [CheckpointRecord(s, f"c{s}", None, None) for s in (20, 40, 60, 80)]
    # marks at or after the failing step vouch for nothing; the class picks the mark
    marks = [Marks(60, 40), Marks(90, 80)]
    assert choose(book, marks, "transient", 70)[2].step == 60
    assert choose(book, marks, "persistent", 70)[2].step == 40
    assert choose(book, marks, None, 30)[2] is None  # no replay passed before the failure: a human
    m = Marks(60, 40)
    keep, gone = retained(book, m), deletable(book, m)
    assert [c.step for c in gone] == [20] and sorted(keep + gone, key=lambda c: c.step) == book


def test_two_forwards_one_backward_and_eval_forwards_are_not_accumulation(tmp_path) -> None:
    """A loss over two forwards with one backward (loss_fn does both), and a forward in eval mode
    between steps, are not gradient accumulation: no false SDC, the training pass is still checked."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 3))

    def pair_loss(module: torch.nn.Module, batch) -> torch.Tensor:  # noqa: ANN001
        (xa, ya), (xb, yb) = batch
        return loss_fn(module, (xa, ya)) + loss_fn(module, (xb, yb))

    events: list = []
    guard = SdcGuard(model, pair_loss, every=2, reporter=Reporter(job="pair", rank=0, sink=events.append),
                     follow_advice=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    flipped = {"done": False}

    def flip(grad: torch.Tensor) -> torch.Tensor:
        if guard.checker.recompute.active or flipped["done"] or step != 4:
            return grad
        flipped["done"] = True
        grad = grad.clone()
        grad.view(-1).view(torch.int32)[0] ^= 1 << 22
        return grad

    model[0].weight.register_hook(flip)
    for step in range(6):
        batch = (_batch(step), _batch(100 + step))
        guard.begin(step)
        loss = pair_loss(model, batch)
        loss.backward()
        v = guard.after_backward(step, batch, loss)
        assert v.microbatches == 2
        if not v.skip_update:
            opt.step()
        opt.zero_grad()
        model.eval()
        with torch.enable_grad():
            loss_fn(model, _batch(200 + step))  # an evaluation forward: not counted
        model.train()
    failed = [(e.step, e.data["passed"]) for e in events if e.kind.value == "sdc_check" and not e.data["passed"]]
    assert failed == [(4, False)]  # only the flipped step; the two-forward steps pass bitwise
