"""The collective and device helpers the in-job checks share: global ranks of a process group, a
small all-gather of integers, and moving a microbatch between host and device."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from fleethealth.injob.watchdog import HangWatchdog

__all__ = ["backend", "global_rank", "gather_ints", "to_cpu", "to_device"]


def backend(group: Any) -> str:
    """The process group's backend in lower case (``nccl``, ``gloo``)."""
    return str(dist.get_backend(group)).lower()


def global_rank(group: Any, rank: int) -> int:
    """The job (global) rank of ``rank`` in ``group`` (``None``: the default group)."""
    return rank if group is None else dist.get_global_rank(group, rank)


def gather_ints(values: list[int], what: str, *, group: Any, world: int, distributed: bool,
                watchdog: HangWatchdog | None = None) -> np.ndarray:
    """All-gather a few small integers per rank; returns shape ``(world, len(values))`` (one row
    when not ``distributed``). The watchdog learns the collective's name first."""
    local = np.asarray(values, dtype=np.int64)[None, :]
    if not distributed:
        return local
    if watchdog is not None:
        watchdog.collective(f"all_gather({what})")
    device = torch.device("cuda", torch.cuda.current_device()) if backend(group) == "nccl" else "cpu"
    t = torch.as_tensor(local[0], device=device)
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t, group=group)
    return torch.stack(out).cpu().numpy()


def to_cpu(batch: Any) -> Any:
    """Every tensor of ``batch`` (any nesting of lists, tuples, dicts) detached and on the host."""
    return tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, batch)


def to_device(batch: Any, device: torch.device) -> Any:
    """Every tensor of ``batch`` moved to ``device``."""
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, batch)
