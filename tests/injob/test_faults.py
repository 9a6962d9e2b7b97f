"""``FaultInjector``: off unless attached; a transient flip changes one gradient bit once, at its step;
a deterministic fault gives the same wrong matmul output on every forward from its step on."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from fleethealth.errors import ConfigError
from fleethealth.injob.faults import FaultInjector, detection_step

sys.path.insert(0, str(Path(__file__).parent))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def _grads(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    model(x).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_transient_flips_one_bit_of_one_gradient_element_once() -> None:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    clean = _grads(_model(), x)
    model = _model()
    fault = FaultInjector("transient", step=3, bit=22, target="2.bias", index=1).attach(model)
    fault.begin(2)
    assert all(torch.equal(a, b) for a, b in zip(_grads(model, x), clean, strict=True))
    fault.begin(3)
    hit = _grads(model, x)
    bias = [n for n, _ in model.named_parameters()].index("2.bias")
    words = (hit[bias].view(torch.int32) ^ clean[bias].view(torch.int32)).tolist()
    assert words == [0, 1 << 22] and fault.fired_at == 3 and fault.fired_total == 1
    assert all(torch.equal(a, b) for i, (a, b) in enumerate(zip(hit, clean, strict=True)) if i != bias)
    again = _grads(model, x)  # the recomputation of the same step sees the healthy value
    assert all(torch.equal(a, b) for a, b in zip(again, clean, strict=True))


def test_deterministic_is_the_same_wrong_answer_every_time_from_its_step() -> None:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(2))
    model = _model()
    healthy = model(x)
    fault = FaultInjector("deterministic", step=10, bit=31, index=3).attach(model)
    fault.begin(9)
    assert torch.equal(model(x), healthy)
    fault.begin(10)
    first = model(x)
    fault.begin(11)
    assert torch.equal(model(x), first) and not torch.equal(first, healthy)
    assert fault.fired_at == 10 and fault.fired_total == 2
    fault.detach()
    assert torch.equal(model(x), healthy)


@pytest.mark.parametrize(("kind", "kwargs", "match"), [
    ("cosmic", {"step": 0}, "unknown fault"), ("transient", {"step": -1}, "step"),
    ("transient", {"step": 0, "bit": 32}, "bit"), ("transient", {"step": 0, "target": "nope"}, "nope"),
    ("transient", {"step": 0, "index": 999}, "index"),
])
def test_bad_fault_settings_are_config_errors(kind: str, kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        FaultInjector(kind, **kwargs).attach(_model())


def _gpt() -> torch.nn.Module:
    import _tinygpt
    torch.manual_seed(0)
    return _tinygpt.TinyGPT()


def test_default_deterministic_target_changes_a_causal_transformers_loss() -> None:
    """Element 0 of the first Linear is token 0's query: it attends to one key, so corrupting it changes
    nothing. The default (the last element) and a probe-checked target do change the loss."""
    import _tinygpt
    b = _tinygpt.batch(torch.Generator().manual_seed(3))
    model = _gpt()
    healthy = _tinygpt.lm_loss(model, b)
    old = FaultInjector("deterministic", step=0, bit=22, index=0).attach(model)  # what the default used to be
    old.begin(0)
    assert torch.equal(_tinygpt.lm_loss(model, b), healthy) and old.fired_at == 0  # fired, changed nothing
    old.detach()
    new = FaultInjector("deterministic", step=0, bit=22).attach(model, probe=(_tinygpt.lm_loss, b))
    new.begin(0)
    assert new.chosen == "q" and not torch.equal(_tinygpt.lm_loss(model, b), healthy)
    new.detach()
    with pytest.raises(ConfigError, match="does not change the loss"):
        FaultInjector("deterministic", step=0, bit=22, index=0, target="q").attach(model, probe=(_tinygpt.lm_loss, b))


def test_transient_flips_a_gradient_element_that_matters_or_says_it_cannot() -> None:
    import _tinygpt
    b = _tinygpt.batch(torch.Generator().manual_seed(4))
    model = _gpt()
    model.unused = torch.nn.Parameter(torch.ones(3))  # in no computation: its gradient is zero
    with pytest.raises(ConfigError, match="non-zero"):
        FaultInjector("transient", step=0, target="unused").attach(model, probe=(_tinygpt.lm_loss, b))
    probed = FaultInjector("transient", step=0).attach(model, probe=(_tinygpt.lm_loss, b))
    assert probed.chosen == "tok.weight"
    probed.detach()
    unused = int(next(i for i in range(_tinygpt.VOCAB) if not (b[0] == i).any()))  # a token not in the batch
    fault = FaultInjector("transient", step=1, bit=22, target="tok.weight", index=unused * _tinygpt.DIM)
    fault.attach(model)
    fault.begin(1)
    _tinygpt.lm_loss(model, b).backward()
    assert fault.fired_at is None and "is 0" in fault.note  # the unused row's gradient is 0: it says so
    model.zero_grad()
    auto = FaultInjector("transient", step=2, bit=22, target="tok.weight").attach(model)
    auto.begin(2)
    _tinygpt.lm_loss(model, b).backward()
    assert auto.fired_at == 2 and auto.note == ""


def test_detection_step_at_default_cadences() -> None:
    """The latency the module docstring's table states, for a 5,000-step and a 50,000-step run."""
    assert detection_step("transient", 300) == 300 and detection_step("transient", 301) is None
    assert detection_step("deterministic", 50, run_steps=5_000) is None  # no replay after step 0 in the run
    assert detection_step("deterministic", 50, run_steps=50_000) == 10_000
    assert detection_step("deterministic", 50, replay_every=40, run_steps=120) == 80
