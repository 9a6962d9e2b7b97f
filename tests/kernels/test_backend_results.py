"""Device resolution, result records and their event form, baselines and the exported surface."""

from __future__ import annotations

import math

import numpy as np
import pytest

import fleethealth.kernels as kernels
from fleethealth.errors import ConfigError, DeviceError, SchemaError
from fleethealth.kernels.backend import Backend, resolve_devices
from fleethealth.kernels.baseline import BaselineBook, model_family
from fleethealth.kernels.presentation import exit_code, summary
from fleethealth.kernels.results import Mismatch, SelfTestResult, Verdict, bits_of
from fleethealth.schema import Event, EventKind, decode, encode


def _result(**kw) -> SelfTestResult:
    base = dict(suite="full", test="gemm_exact_bf16", device="cuda:1", verdict=Verdict.PASS, duration_s=0.5,
                throughput=500.0, unit="TFLOP/s", model="NVIDIA H100 80GB HBM3", ts=1000.0)
    return SelfTestResult(**{**base, **kw})


def test_device_specs_resolve_or_fail_with_one_clear_line() -> None:
    assert resolve_devices("cpu") == ["cpu"]
    assert resolve_devices("cuda:1", count=lambda: 2) == ["cuda:1"]
    assert resolve_devices("all", count=lambda: 3) == ["cuda:0", "cuda:1", "cuda:2"]
    assert resolve_devices("all", count=lambda: 0) == ["cpu"]
    with pytest.raises(DeviceError, match=r"^cuda:3 requested but this machine has 2 CUDA devices \(cuda:0..cuda:1\)$"):
        resolve_devices("cuda:3", count=lambda: 2)
    with pytest.raises(ConfigError, match="unknown device"):
        resolve_devices("gpu0")


def test_cuda_without_cupy_is_a_device_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    from fleethealth.kernels import backend

    real_import = builtins.__import__

    def no_cupy(name, *args, **kwargs):
        if name == "cupy":
            raise ImportError("No module named 'cupy'")
        return real_import(name, *args, **kwargs)

    backend._cupy.cache_clear()
    monkeypatch.setattr(builtins, "__import__", no_cupy)
    with pytest.raises(DeviceError, match="CuPy is not installed"):
        Backend.for_device("cuda:0")
    assert resolve_devices("all") == ["cpu"]
    backend._cupy.cache_clear()


def test_result_round_trips_through_an_event_on_the_wire() -> None:
    r = _result(verdict=Verdict.FAIL, mismatches=(Mismatch("C", row=1, col=2, bits=(3,), expected=1.0,
                                                           observed=9.0),), mismatch_total=4, max_error=8.0)
    event = r.to_event("n0007")
    assert event.kind is EventKind.SELFTEST and event.gpu == 1 and event.ts == 1000.0
    back = decode(Event, encode(event))
    data = back.data
    for key in ("suite", "test", "device", "verdict", "mismatches", "max_error", "duration_s", "throughput", "unit"):
        assert key in data
    again = SelfTestResult.from_data(data)
    assert again == r
    assert r.mismatches[0].describe() == "C[1,2] bits 3"


def test_non_finite_numbers_travel_as_null_and_bad_records_are_rejected() -> None:
    data = _result(throughput=math.inf, max_error=math.nan).to_data()
    assert data["throughput"] is None and data["max_error"] is None
    with pytest.raises(SchemaError, match="verdict"):
        SelfTestResult.from_data({**data, "verdict": "maybe"})
    with pytest.raises(SchemaError, match="mismatches"):
        SelfTestResult.from_data({**data, "mismatches": [{"where": "C", "colour": 1}]})


def test_bits_of_lists_the_differing_positions() -> None:
    assert bits_of(0) == () and bits_of(0b1010) == (1, 3) and bits_of(1 << 63) == (63,)


def test_baselines_fleet_median_first_then_shipped_floors_then_none() -> None:
    records = [_result(throughput=v).to_data() for v in (400.0, 500.0, 600.0)]
    records.append(_result(throughput=10.0, verdict=Verdict.FAIL).to_data())  # wrong answers never count
    book = BaselineBook.from_records(records)
    assert book.lookup("NVIDIA H100 80GB HBM3", "full", "gemm_exact_bf16").value == 500.0
    assert BaselineBook().lookup("NVIDIA H100 80GB HBM3", "full", "gemm_exact_bf16").source == "shipped"
    assert BaselineBook().lookup("NVIDIA H100 80GB HBM3", "quick", "gemm_exact_bf16") is None
    assert BaselineBook().lookup("cpu:AMD EPYC", "full", "gemm_exact_fp32") is None
    assert model_family("NVIDIA A100-SXM4-80GB") == "A100" and model_family("cpu:Xeon") is None


def test_more_than_five_percent_below_baseline_is_slow_and_a_failure_stays_a_failure() -> None:
    book = BaselineBook(fleet={("NVIDIA H100 80GB HBM3", "full", "gemm_exact_bf16"): (500.0, 9)})
    assert book.judge(_result(throughput=476.0)).verdict is Verdict.PASS
    slow = book.judge(_result(throughput=470.0))
    assert slow.verdict is Verdict.SLOW and slow.baseline == 500.0 and "6% below" in slow.detail
    assert book.judge(_result(throughput=1.0, verdict=Verdict.FAIL)).verdict is Verdict.FAIL
    with pytest.raises(ConfigError):
        BaselineBook(slow_fraction=1.5)


def test_baselines_from_the_store(store) -> None:
    events = [_result(throughput=v, ts=100.0 + i).to_event("n0001") for i, v in enumerate((300.0, 310.0, 320.0))]
    store.insert_events(events)
    book = BaselineBook.from_store(store)
    assert book.lookup("NVIDIA H100 80GB HBM3", "full", "gemm_exact_bf16").value == 310.0


def test_exit_codes_and_summary() -> None:
    assert exit_code([_result()]) == 0
    assert exit_code([_result(), _result(verdict=Verdict.SLOW)]) == 1
    assert exit_code([]) == 2
    assert summary([_result(), _result(verdict=Verdict.FAIL)]).startswith("2 tests: 1 pass, 1 fail, 0 slow")


def test_exported_names() -> None:
    assert set(kernels.__all__) == {
        "AbftCheck", "AbftEncoding", "Backend", "Baseline", "BaselineBook", "Fault", "FaultKind", "GROUPS",
        "Mismatch", "Precision", "SUITES", "SelfTestResult", "Verdict", "checksum_verify", "encode_operands",
        "resolve_devices", "run_suite", "verify_product"}
    for name in kernels.__all__:
        assert getattr(kernels, name) is not None


def test_importing_the_kernels_loads_neither_torch_nor_cupy() -> None:
    import subprocess
    import sys

    code = "import sys, fleethealth.kernels, fleethealth.sweeps; print('torch' in sys.modules, 'cupy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_store_medians_match_numpy_and_honour_since(store) -> None:
    values = [100.0, 130.0, 90.0, 120.0]
    events = [_result(throughput=v, ts=200.0 + i).to_event("n0002") for i, v in enumerate(values)]
    events.append(_result(throughput=5.0, verdict=Verdict.FAIL, ts=300.0).to_event("n0002"))
    store.insert_events(events)
    key = ("NVIDIA H100 80GB HBM3", "full", "gemm_exact_bf16")
    assert BaselineBook.from_store(store).fleet[key] == (pytest.approx(float(np.median(values))), 4)
    assert BaselineBook.from_store(store, since=202.0).fleet[key] == (pytest.approx(105.0), 2)
