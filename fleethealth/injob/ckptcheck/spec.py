"""A state dict's tensors by dotted name, and their shapes and dtypes: what the training thread reads.

Light on purpose (torch only, not ``torch.distributed.checkpoint``): :meth:`CheckpointValidator.saved
<fleethealth.injob.ckptcheck.background.CheckpointValidator.saved>` calls :func:`spec_of` on the step
path, where an import of seconds would be a stall. Names are dotted paths as DCP flattens a nested
state (``model.0.weight``, ``optim.state.0.exp_avg``; list items by index).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from fleethealth.injob.ckptcheck.rules import TensorSpec

__all__ = ["dtype_name", "flat_tensors", "spec_of"]


def flat_tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in nested dicts, lists and tuples, with its dotted name."""
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from flat_tensors(v, f"{prefix}{k}.")
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from flat_tensors(v, f"{prefix}{i}.")
    elif isinstance(obj, torch.Tensor):
        yield prefix[:-1], obj


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` → ``float32``."""
    return str(dtype).removeprefix("torch.")


def spec_of(state: Mapping[str, Any]) -> dict[str, TensorSpec]:
    """The tensors of a state dict: shapes and dtypes only, read from the tensors' metadata without
    touching their data (no copy, no device synchronisation)."""
    return {name: TensorSpec(name, tuple(int(d) for d in t.shape), dtype_name(t.dtype))
            for name, t in flat_tensors(state)}
