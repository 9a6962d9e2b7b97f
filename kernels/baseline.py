"""Performance as health: each test's throughput against a baseline for its device model.

After SuperBench's baseline rules: a test whose answers are right but whose throughput falls more
than ``slow_fraction`` (default 5 %) below the baseline gets the verdict ``slow`` — correct but
degraded hardware (a throttling GPU, a bad HBM stack, a PCIe link trained down).

The baseline for (device model, suite, test) is, in order:

1. the **fleet median** of earlier correct results (verdict ``pass`` or ``slow``) of the same model,
   suite and test, computed by the store over its ``selftest`` events (or from records given
   directly), once at least ``min_samples`` exist;
2. a **shipped default** (:data:`SHIPPED`), for the full suite on common GPU models only: floor
   values that a healthy device of the model clears on the full suite's shapes;
3. none — throughput cannot make the verdict ``slow``, and the record says ``baseline: null``.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from fleethealth.errors import ConfigError
from fleethealth.kernels.results import SelfTestResult, Verdict
from fleethealth.schema import Event, EventKind

if TYPE_CHECKING:
    from fleethealth.store.protocol import OpsStore

__all__ = ["DEFAULT_SLOW_FRACTION", "SHIPPED", "Baseline", "BaselineBook", "model_family"]

DEFAULT_SLOW_FRACTION = 0.05

SHIPPED: dict[tuple[str, str], float] = {
    # (model family, test) -> floor throughput on the full suite (TFLOP/s or GB/s). Dense cuBLAS
    # rates are roughly 60-70 % of the data-sheet peaks, memory patterns about 60 % of peak HBM.
    ("H100", "gemm_exact_fp32"): 30.0, ("H100", "gemm_abft_fp32"): 30.0, ("H100", "gemm_repeat_fp32"): 30.0,
    ("H100", "gemm_exact_fp16"): 450.0, ("H100", "gemm_exact_bf16"): 450.0,
    ("H100", "memory_checkerboard"): 2000.0, ("H100", "memory_moving_inversions"): 2000.0,
    ("H200", "gemm_exact_fp32"): 30.0, ("H200", "gemm_abft_fp32"): 30.0, ("H200", "gemm_repeat_fp32"): 30.0,
    ("H200", "gemm_exact_fp16"): 450.0, ("H200", "gemm_exact_bf16"): 450.0,
    ("H200", "memory_checkerboard"): 2800.0, ("H200", "memory_moving_inversions"): 2800.0,
    ("A100", "gemm_exact_fp32"): 12.0, ("A100", "gemm_abft_fp32"): 12.0, ("A100", "gemm_repeat_fp32"): 12.0,
    ("A100", "gemm_exact_fp16"): 180.0, ("A100", "gemm_exact_bf16"): 180.0,
    ("A100", "memory_checkerboard"): 1200.0, ("A100", "memory_moving_inversions"): 1200.0,
}
"""Shipped floors, applied to the ``full`` suite only (quick-suite shapes are too small to compare)."""

_FAMILY = re.compile(r"\b(H100|H200|A100|B200|L40S|GH200)\b")


def model_family(model: str) -> str | None:
    """``NVIDIA H100 80GB HBM3`` -> ``H100``; ``None`` for models without a family entry (CPUs)."""
    match = _FAMILY.search(model or "")
    return match.group(1) if match else None


@dataclass(frozen=True)
class Baseline:
    """Expected throughput ``value`` (in the test's unit) and where it came from (``source``:
    ``fleet median of N`` or ``shipped``)."""

    value: float
    source: str


class BaselineBook:
    """Looks up baselines and turns a passing result into ``slow`` when it is too far below one."""

    def __init__(self, *, fleet: Mapping[tuple[str, str, str], tuple[float, int]] | None = None,
                 shipped: Mapping[tuple[str, str], float] | None = None,
                 slow_fraction: float = DEFAULT_SLOW_FRACTION, min_samples: int = 3) -> None:
        if not 0.0 < slow_fraction < 1.0:
            raise ConfigError(f"slow_fraction must be in (0, 1), got {slow_fraction}")
        if min_samples < 1:
            raise ConfigError(f"min_samples must be >= 1, got {min_samples}")
        self.fleet = dict(fleet or {})
        self.shipped = dict(SHIPPED if shipped is None else shipped)
        self.slow_fraction = slow_fraction
        self.min_samples = min_samples

    @classmethod
    def from_records(cls, records: Iterable[Mapping[str, Any]], **kwargs: Any) -> BaselineBook:
        """Fleet medians from self-test records (``Event.data`` of ``selftest`` events, or the lines
        of ``fleethealth selftest --json``): correct results only (``pass`` or ``slow``)."""
        samples: dict[tuple[str, str, str], list[float]] = defaultdict(list)
        for data in records:
            if not isinstance(data, Mapping) or data.get("verdict") not in ("pass", "slow"):
                continue
            value = data.get("throughput")
            if isinstance(value, bool) or not isinstance(value, int | float) or not np.isfinite(value) or value <= 0:
                continue
            key = (str(data.get("model", "")), str(data.get("suite", "")), str(data.get("test", "")))
            samples[key].append(float(value))
        fleet = {key: (float(np.median(vals)), len(vals)) for key, vals in samples.items()}
        return cls(fleet=fleet, **kwargs)

    @classmethod
    def from_events(cls, events: Iterable[Event], **kwargs: Any) -> BaselineBook:
        """Fleet medians from the ``selftest`` events among ``events``."""
        return cls.from_records((e.data for e in events if e.kind is EventKind.SELFTEST), **kwargs)

    @classmethod
    def from_store(cls, store: OpsStore, *, since: float | None = None, **kwargs: Any) -> BaselineBook:
        """Fleet medians computed in the store (one grouped query over the ``selftest`` events with
        verdict ``pass`` or ``slow``, optionally only those at or after event time ``since``)."""
        fleet = {(model, suite, test): (value, n)
                 for model, suite, test, value, n in store.selftest_throughput_medians(since=since)}
        return cls(fleet=fleet, **kwargs)

    def lookup(self, model: str, suite: str, test: str) -> Baseline | None:
        fleet = self.fleet.get((model, suite, test))
        if fleet is not None and fleet[1] >= self.min_samples:
            return Baseline(fleet[0], f"fleet median of {fleet[1]}")
        family = model_family(model)
        if suite == "full" and family is not None and (family, test) in self.shipped:
            return Baseline(self.shipped[(family, test)], "shipped")
        return None

    def judge(self, result: SelfTestResult) -> SelfTestResult:
        """``result`` with its baseline filled in, and verdict ``slow`` when it passed but its
        throughput is below (1 − slow_fraction) × baseline. A failure stays a failure."""
        base = self.lookup(result.model, result.suite, result.test)
        if base is None:
            return result
        extra = {**result.extra, "baseline_source": base.source}
        judged = replace(result, baseline=base.value, extra=extra)
        floor = (1.0 - self.slow_fraction) * base.value
        if result.verdict is Verdict.PASS and result.throughput < floor:
            shortfall = 1.0 - result.throughput / base.value
            return replace(judged, verdict=Verdict.SLOW,
                           detail=(f"{result.detail}; " if result.detail else "")
                           + f"{shortfall:.0%} below baseline {base.value:.4g} {result.unit} ({base.source})")
        return judged
