"""SdcGuard in one process (CPU, a tiny model): the bitwise self-check, invariants and start-up probe.

Faults are injected with parameter hooks on the training pass only, as a transient hardware fault
would corrupt one computation and not its recomputation.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator

import pytest
import torch

from fleethealth.errors import ConfigError
from fleethealth.injob.guard import NondeterminismWarning, SdcGuard
from fleethealth.injob.invariants import Invariants, NonFiniteLoss
from fleethealth.injob.reporter import Reporter
from fleethealth.payloads.sdc_check import SdcCheck
from fleethealth.schema import Event


def loss_fn(module: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.cross_entropy(module(x), y)


def _model(seed: int = 0, extra: torch.nn.Module | None = None) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Dropout(0.2)]
    if extra is not None:
        layers.append(extra)
    return torch.nn.Sequential(*layers, torch.nn.Linear(16, 3))


class _Faults:
    """A parameter hook that corrupts chosen training-pass gradients (never the recomputations)."""

    def __init__(self, param: torch.nn.Parameter) -> None:
        self.step = -1
        self.training = False
        self.actions: dict[int, object] = {}
        self.always: object | None = None
        param.register_hook(self)

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        if self.always is not None:
            grad = self.always(grad)
        action = self.actions.get(self.step) if self.training else None
        return grad if action is None else action(grad)


def _flip_bit(bit: int, index: int = 3) -> object:
    def flip(grad: torch.Tensor) -> torch.Tensor:
        out = grad.clone()
        out.reshape(-1).view(torch.int32)[index] ^= 1 << bit
        return out
    return flip


def _train(guard: SdcGuard, model: torch.nn.Module, steps: range, faults: _Faults | None = None,
           nan_at: int | None = None) -> list:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(7)
    torch.manual_seed(11)  # the dropout stream
    verdicts = []
    for step in steps:
        x, y = torch.randn(8, 8, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        if step == nan_at:
            x[0, 0] = float("inf")
        if faults is not None:
            faults.step, faults.training = step, True
        guard.begin(step)
        loss = loss_fn(model, (x, y))
        loss.backward()
        if faults is not None:
            faults.training = False
        verdict = guard.after_backward(step, (x, y), loss)
        verdicts.append(verdict)
        if not verdict.skip_update:
            opt.step()
        opt.zero_grad()
    return verdicts


@pytest.fixture
def events() -> list[Event]:
    return []


@pytest.fixture
def make_guard(events: list[Event]) -> Iterator:
    made: list[SdcGuard] = []

    def make(model: torch.nn.Module, **kw) -> SdcGuard:
        kw.setdefault("reporter", Reporter(job="train-1", rank=3, gpu=3, sink=events.append))
        guard = SdcGuard(model, loss_fn, **kw)
        made.append(guard)
        return guard

    yield make
    for g in made:
        g.close()


def test_500_healthy_checks_raise_no_false_alarm(make_guard, events: list[Event]) -> None:
    model = _model()
    guard = make_guard(model, every=1)
    verdicts = _train(guard, model, range(520))
    assert guard.startup_report.deterministic
    records = [SdcCheck.from_event(e) for e in events]
    assert len(records) == 520 and all(r.passed for r in records)
    assert all(r.digests[0] == r.digests[1] for r in records)
    assert not any(v.skip_update for v in verdicts) and guard.failures_total == 0
    assert guard.watermark.last_verified_step == 519 and not guard.watermark.suspect


def test_guard_leaves_training_bit_identical(make_guard) -> None:
    """RNG stream, BatchNorm statistics and .grad are untouched: same weights with or without checks."""
    plain, checked = _model(), _model()
    _train(make_guard(plain, every=0, replay_every=0, sync_invariants=False), plain, range(25))
    _train(make_guard(checked, every=2), checked, range(25))
    for a, b in zip(plain.state_dict().values(), checked.state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bit", [0, 13, 22, 31])
def test_single_bit_flip_is_caught_at_that_step_on_that_rank(make_guard, events: list[Event], bit: int) -> None:
    model = _model()
    faults = _Faults(model[0].weight)
    faults.actions[40] = _flip_bit(bit)
    guard = make_guard(model, every=10)
    verdicts = _train(guard, model, range(60), faults)
    failed = [(v.step, c) for v in verdicts for c in v.failed]
    assert [s for s, _ in failed] == [40]
    result = failed[0][1]
    assert result.rank == 3 and result.mismatched == ("0.weight",) and result.classification.value == "transient"
    bad = [e for e in events if not e.data["passed"]]
    assert len(bad) == 1 and bad[0].rank == 3 and bad[0].gpu == 3 and bad[0].step == 40
    assert bad[0].data["digests"][0] != bad[0].data["digests"][1] and "0.weight" in bad[0].message
    assert guard.watermark.last_verified_step == 30 and guard.watermark.failed_step == 40


def test_deterministic_corruption_passes_the_self_check(make_guard, events: list[Event]) -> None:
    """The same wrong answer twice: invisible to the self-check (the replay's job, see test_distributed)."""
    model = _model()
    faults = _Faults(model[0].weight)
    faults.always = lambda g: g * 1.01
    guard = make_guard(model, every=5)
    _train(guard, model, range(50), faults)
    assert len(events) == 10 and all(e.data["passed"] for e in events)


def test_nan_loss_from_data_skips_reports_and_aborts(make_guard, events: list[Event]) -> None:
    model = _model()
    guard = make_guard(model, every=10)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(NonFiniteLoss, match="non-finite loss at step 3"):
        _train(guard, model, range(10), nan_at=3)
    # the out-of-cycle self-check was reported before the abort: it reproduces, so it passed
    assert [e.step for e in events] == [0, 3] and events[-1].data["passed"]
    assert guard.invariants.nonfinite_total == 1
    assert not all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))  # steps 0-2 ran
    assert all(torch.isfinite(p).all() for p in model.parameters())  # the NaN update never landed


def test_transient_nan_is_classified_and_handed_to_the_hook(make_guard, events: list[Event]) -> None:
    model = _model()
    faults = _Faults(model[0].weight)
    faults.actions[12] = lambda g: g * float("nan")
    seen = []
    guard = make_guard(model, every=100, on_nonfinite=lambda v, c: seen.append((v.step, v.reason, c)))
    verdicts = _train(guard, model, range(15), faults)
    assert seen == [(12, "nonfinite_grad", "transient")]
    assert verdicts[12].skip_update and verdicts[12].classification.value == "transient"
    assert [e.step for e in events if not e.data["passed"]] == [12]
    assert all(torch.isfinite(p).all() for p in model.parameters())  # the poisoned update was skipped


def test_gradient_spike_is_skipped_counted_and_classified(make_guard, events: list[Event]) -> None:
    model = _model()
    faults = _Faults(model[0].weight)
    faults.actions[40] = lambda g: g * 1e4
    guard = make_guard(model, every=100, invariants=Invariants(warmup=20))
    verdicts = _train(guard, model, range(45), faults)
    assert [v.step for v in verdicts if v.skip_update] == [40]
    assert verdicts[40].invariants.reason == "grad_spike" and guard.invariants.spikes_total == 1
    assert verdicts[40].classification.value == "transient"
    assert [(e.step, e.data["passed"]) for e in events] == [(0, True), (40, False)]


class _NoisyScale(torch.autograd.Function):
    """x * 1 forward; the backward adds noise at the 1e-6 level, like an atomics-ordered reduction.
    With ``name`` set it reports itself the way torch's own ops do under deterministic algorithms:
    a warning in warn-only mode, a RuntimeError in strict mode."""

    name: str | None = None
    calls = 0

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        if _NoisyScale.name and torch.are_deterministic_algorithms_enabled():
            text = (f"{_NoisyScale.name} does not have a deterministic implementation, but you set "
                    "'torch.use_deterministic_algorithms(True)'.")
            if not torch.is_deterministic_algorithms_warn_only_enabled():
                raise RuntimeError(text)
            warnings.warn(text, UserWarning, stacklevel=2)
        _NoisyScale.calls += 1  # its own stream: replaying torch's RNG does not reproduce it
        noise = torch.rand(grad.shape, generator=torch.Generator().manual_seed(_NoisyScale.calls))
        return grad * (1 + 1e-6 * noise)


class _Noisy(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _NoisyScale.apply(x)


@pytest.mark.parametrize("op", [None, "scatter_add_cuda_kernel"])
def test_nondeterministic_backward_falls_back_to_a_tolerance_loudly(make_guard, events: list[Event],
                                                                    op: str | None) -> None:
    _NoisyScale.name = op
    try:
        model = _model(extra=_Noisy())
        faults = _Faults(model[0].weight)
        faults.actions[30] = lambda g: g * 1.5
        guard = make_guard(model, every=5)
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            verdicts = _train(guard, model, range(40), faults)
        warned = [w for w in warned if issubclass(w.category, NondeterminismWarning)]
        assert len(warned) == 1 and "NOT bitwise deterministic" in str(warned[0].message)
        report = guard.startup_report
        assert not report.deterministic and report.nondeterministic_op == op
        assert report.selfcheck_tolerance is not None and report.selfcheck_tolerance > 0
        text = str(warned[0].message)
        assert (op in text) if op else ("0.weight" in text or "an op torch did not name" in text)
        # no false alarm stream in tolerance mode, and a gross corruption is still caught
        assert [v.step for v in verdicts if v.failed] == [30]
        assert all(e.data["tolerance"] == report.selfcheck_tolerance for e in events)
    finally:
        _NoisyScale.name = None


def test_two_recomputations_mode_for_gradient_accumulation(make_guard, events: list[Event]) -> None:
    model = _model()
    guard = make_guard(model, every=4, compare_training_pass=False)
    _train(guard, model, range(20))
    assert len(events) == 5 and all(e.data["passed"] for e in events)


def test_determinism_setting_is_restored_and_bad_config_rejected(make_guard) -> None:
    before = torch.are_deterministic_algorithms_enabled()
    guard = make_guard(_model())
    assert torch.are_deterministic_algorithms_enabled()
    guard.close()
    assert torch.are_deterministic_algorithms_enabled() == before
    with pytest.raises(ConfigError):
        SdcGuard(_model(), loss_fn, every=-1)
    frozen = _model()
    for p in frozen.parameters():
        p.requires_grad_(False)
    with pytest.raises(ConfigError, match="no parameters"):
        SdcGuard(frozen, loss_fn, deterministic=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_guard(_model(), every=1).close()


def test_strict_determinism_refusal_names_the_op(make_guard) -> None:
    """A caller who set strict deterministic algorithms: torch refuses with the op's name at start-up."""
    _NoisyScale.name = "index_put_cuda_kernel"
    try:
        model = _model(extra=_Noisy())
        guard = make_guard(model, every=5)
        torch.use_deterministic_algorithms(True)
        batch = (torch.randn(8, 8), torch.randint(0, 3, (8,)))
        with pytest.warns(NondeterminismWarning, match="index_put_cuda_kernel"):
            report = guard.startup(batch)
        assert report.nondeterministic_op == "index_put_cuda_kernel" and not report.deterministic
        assert torch.is_deterministic_algorithms_warn_only_enabled()  # training can run on
    finally:
        _NoisyScale.name = None


def test_rotation_checks_one_rank_per_check_step(make_guard) -> None:
    """rotate=True: with 4 ranks, rank 2 checks at every 4th check step (200, 600, ...); the default
    checks every rank at every check step."""
    rotating = make_guard(_model(), every=100, rotate=True)
    rotating.world, rotating.rank = 4, 2
    assert [s for s in range(0, 1001, 50) if rotating.selfcheck_due(s)] == [200, 600, 1000]
    together = make_guard(_model(), every=100)
    together.world, together.rank = 4, 2
    assert [s for s in range(0, 401, 50) if together.selfcheck_due(s)] == [0, 100, 200, 300, 400]
    assert together.replay(0, None) == []  # no process group: nothing to replay against


def test_mixed_precision_loss_scale_keeps_the_bits_matching(make_guard, events: list[Event]) -> None:
    """GradScaler multiplies the loss before backward; given the scale, the recomputation does too."""
    model = _model()
    faults = _Faults(model[0].weight)
    faults.actions[20] = _flip_bit(5)
    faults.actions[33] = lambda g: g * float("inf")  # an fp16-style overflow: the scaler's business
    guard = make_guard(model, every=5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(7)
    skipped = []
    for step in range(40):
        batch = (torch.randn(8, 8, generator=gen), torch.randint(0, 3, (8,), generator=gen))
        faults.step, faults.training = step, True
        guard.begin(step)
        loss = loss_fn(model, batch)
        scaler.scale(loss).backward()
        faults.training = False
        verdict = guard.after_backward(step, batch, loss, loss_scale=scaler.get_scale())
        if verdict.skip_update:
            skipped.append(step)
        else:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
    assert [e.step for e in events if not e.data["passed"]] == [20]
    # the flipped step's update is skipped; the overflow is the scaler's to skip, not the guard's
    assert len(events) == 8 and skipped == [20] and guard.scaler_overflows_total == 1
    assert scaler.get_scale() < 2.0**16  # the scaler saw the overflow and backed off


def test_gradient_norm_needs_no_torch_2_6_helper(make_guard, monkeypatch) -> None:
    """The injob extra allows torch >= 2.3; torch.nn.utils.get_total_norm only exists from 2.6."""
    monkeypatch.delattr(torch.nn.utils, "get_total_norm", raising=False)
    model = _model()
    guard = make_guard(model, every=2)
    batch = (torch.randn(8, 8, generator=torch.Generator().manual_seed(3)), torch.randint(0, 3, (8,)))
    guard.begin(0)
    loss = loss_fn(model, batch)
    loss.backward()
    verdict = guard.after_backward(0, batch, loss)
    expected = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double().norm().item()
    assert verdict.invariants.grad_norm == pytest.approx(expected, rel=1e-6)
    assert verdict.invariants.loss == pytest.approx(loss.item()) and not verdict.failed


def test_slow_checks_are_not_reported_as_a_hang(make_guard) -> None:
    """Watchdog timeout 0.1 s with abort=True; every recomputation (start-up probe, self-checks)
    takes 0.25 s. The checks run under the wider check limit, so nothing fires or aborts; a real
    stall after the last step still fires."""
    from fleethealth.injob.watchdog import HangWatchdog

    aborted: list[bool] = []
    wd = HangWatchdog(0.1, reporter=Reporter(rank=3, sink=lambda e: None), abort=True,
                      abort_fn=lambda: aborted.append(True), poll_s=0.01)
    model = _model()
    training = {"on": False}

    def slow_loss(module: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if not training["on"]:
            time.sleep(0.25)
        return loss_fn(module, batch)

    guard = make_guard(model, every=2, watchdog=wd)
    guard.loss_fn = slow_loss
    gen = torch.Generator().manual_seed(7)
    with wd:
        for step in range(3):
            batch = (torch.randn(8, 8, generator=gen), torch.randint(0, 3, (8,), generator=gen))
            guard.begin(step)
            training["on"] = True
            loss = slow_loss(model, batch)
            loss.backward()
            training["on"] = False
            assert not guard.after_backward(step, batch, loss).failed
            model.zero_grad()
        assert wd.fired_total == 0 and not aborted and guard.checks_total == 2
        deadline = time.monotonic() + 5.0
        while not aborted and time.monotonic() < deadline:
            time.sleep(0.02)
    assert wd.fired_total == 1 and aborted and wd.last_report.step == 2
