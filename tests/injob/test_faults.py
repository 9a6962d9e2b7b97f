"""``FaultInjector``: off unless attached; a transient flip changes one gradient bit once, at its step;
a deterministic fault gives the same wrong matmul output on every forward from its step on."""

from __future__ import annotations

import pytest
import torch

from fleethealth.errors import ConfigError
from fleethealth.injob.faults import FaultInjector


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
