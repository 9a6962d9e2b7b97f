"""The CuPy paths on a real CUDA device: cuBLAS GEMMs (tensor cores for fp16/bf16), the memory
RawKernels, NCCL collectives. Skipped, with the reason, on a machine without CuPy or a GPU."""

from __future__ import annotations

import pytest

from fleethealth.errors import DeviceError
from fleethealth.kernels.backend import Backend, Precision, cuda_device_count
from fleethealth.kernels.faults import Fault
from fleethealth.kernels.results import Verdict


def _gpus() -> int:
    try:
        return cuda_device_count()
    except DeviceError as exc:
        pytest.skip(f"no CUDA device: {exc}")


@pytest.fixture
def gpu() -> Backend:
    if _gpus() < 1:
        pytest.skip("no CUDA device: CuPy sees 0 GPUs")
    return Backend.for_device("cuda:0")


@pytest.mark.gpu
@pytest.mark.parametrize("precision", list(Precision))
def test_exact_gemm_on_the_gpu_is_bitwise_right_and_a_flip_is_located(gpu: Backend, precision: Precision) -> None:
    from fleethealth.kernels.gemm import run_exact

    result = run_exact(gpu, 1024, 768, 2048, precision=precision, iters=3)
    assert result.verdict is Verdict.PASS, result.mismatches
    fault = Fault("bitflip", seed=1)
    broken = run_exact(gpu, 256, 256, 256, precision=precision, fault=fault)
    hit = fault.injected[0]
    assert (broken.mismatches[0].row, broken.mismatches[0].col) == (hit.index // 256, hit.index % 256)


@pytest.mark.gpu
def test_abft_and_repeatability_on_the_gpu(gpu: Backend) -> None:
    from fleethealth.kernels.abft import run_abft
    from fleethealth.kernels.gemm import run_repeat

    for precision in Precision:
        healthy = run_abft(gpu, 2048, 2048, 2048, precision=precision)
        assert healthy.verdict is Verdict.PASS and healthy.extra["calibrated"], healthy.detail
    assert run_repeat(gpu, 2048, 2048, 2048, runs=5).verdict is Verdict.PASS
    fault = Fault("bitflip", seed=2)
    broken = run_abft(gpu, 1024, 1024, 1024, fault=fault)
    assert broken.verdict is Verdict.FAIL and broken.mismatches[0].row == fault.injected[0].index // 1024
    for n, precision in ((4096, Precision.FP32), (4096, Precision.BF16), (8192, Precision.BF16)):  # the GPU suites
        fault = Fault("bitflip", seed=n)
        broken = run_abft(gpu, n, n, n, precision=precision, fault=fault)
        hit = fault.injected[0]
        assert broken.verdict is Verdict.FAIL and broken.extra["calibrated"]
        assert [(m.row, m.col) for m in broken.mismatches] == [(hit.index // n, hit.index % n)]


@pytest.mark.gpu
def test_memory_rawkernels_pass_and_catch_a_stuck_bit(gpu: Backend) -> None:
    from fleethealth.kernels.memory import MemoryTester, Pattern, run_memory

    assert all(r.verdict is Verdict.PASS for r in run_memory(gpu, 64 << 20))
    fault = Fault("stuck-bit", seed=3)
    scan = MemoryTester(gpu, 1 << 20, fault=fault).scan(Pattern.WALKING_ONES)
    assert scan.total == 63 and set(scan.offsets.tolist()) == {fault.injected[0].index * 8}


@pytest.mark.gpu
def test_nccl_collectives_across_local_gpus() -> None:
    from fleethealth.kernels.collective import run_nccl

    n = _gpus()
    if n < 2:
        pytest.skip(f"the NCCL collective test needs two GPUs, this machine has {n}")
    assert all(r.verdict is Verdict.PASS for r in run_nccl(list(range(n)), elements=1 << 20))
    fault = Fault("bitflip", seed=4)
    results = run_nccl(list(range(n)), elements=1 << 20, fault=fault)
    assert results[1].extra["ranks_named"] == [n - 1]
