"""Tiny models on a shared 2-core machine: one intra-op thread avoids oversubscription stalls."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    import sys

    torch = sys.modules.get("torch")
    if torch is None:  # torch-free tests stay torch-free
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
