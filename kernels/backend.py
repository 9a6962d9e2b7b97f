"""One array interface over CuPy (a CUDA device) and NumPy (the host CPU).

:func:`resolve_devices` turns ``cpu``, ``cuda:N`` or ``all`` into device names and raises
:class:`~fleethealth.errors.DeviceError` with one clear line when a device cannot be used (CuPy
missing, no GPU, ``cuda:3`` on a two-GPU machine). :class:`Backend` holds the array module
(``xp``), moves arrays between host and device, synchronises for timing and runs the GEMM under
test. ``cupy`` is imported here and nowhere else outside ``kernels/``, and only when a CUDA
device is asked for, so every module imports and runs on a CPU-only machine.

Low-precision operands are kept in their storage format: ``fp32`` as float32, ``fp16`` as
float16, ``bf16`` as the raw 16-bit pattern in a uint16 array (NumPy has no bfloat16; bf16 is the
upper half of a float32, so widening is a 16-bit shift and exact).
"""

from __future__ import annotations

import functools
import os
import platform
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np

from fleethealth.errors import ConfigError, DeviceError

__all__ = ["Precision", "Backend", "resolve_devices", "cuda_device_count", "encode", "widen", "raw_bits"]

_DEVICE_RE = re.compile(r"^(cpu|all|cuda:(\d{1,3}))$")

# cuBLAS / CUDA enum values (cublas_api.h, library_types.h).
_CUDA_R_32F, _CUDA_R_16F, _CUDA_R_16BF = 0, 2, 14
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_GEMM_DEFAULT = -1
_CUBLAS_OP_N = 0


class Precision(StrEnum):
    """Operand format of a GEMM; every precision accumulates and writes its result in fp32."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"

    @property
    def exact_int(self) -> int:
        """Every integer of magnitude <= this is exactly representable in the operand format
        (2^p for p significand bits: fp32 24, fp16 11, bf16 8)."""
        return {Precision.FP32: 1 << 24, Precision.FP16: 1 << 11, Precision.BF16: 1 << 8}[self]

    @property
    def storage(self) -> np.dtype:
        return np.dtype({Precision.FP32: np.float32, Precision.FP16: np.float16,
                         Precision.BF16: np.uint16}[self])


def encode(values: np.ndarray, precision: Precision) -> np.ndarray:
    """Round float32 ``values`` (host) to ``precision``'s storage format, round-to-nearest-even."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if precision is Precision.FP32:
        return values
    if precision is Precision.FP16:
        return values.astype(np.float16)
    bits = values.view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def widen(xp: Any, arr: Any, precision: Precision) -> Any:
    """The operand as float32 on its own device; exact for every precision (a widening)."""
    if precision is Precision.FP32:
        return arr
    if precision is Precision.FP16:
        return arr.astype(xp.float32)
    return (arr.astype(xp.uint32) << 16).view(xp.float32)


def raw_bits(arr: Any) -> Any:
    """The array's raw bit patterns as an unsigned-integer view of the same width."""
    return arr.view({2: "uint16", 4: "uint32", 8: "uint64"}[arr.dtype.itemsize])


@functools.lru_cache(maxsize=1)
def _cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise DeviceError("CuPy is not installed (pip install 'fleethealth[gpu]'); "
                          "use --device cpu on a machine without a GPU") from exc
    return cupy


def cuda_device_count() -> int:
    """Number of CUDA devices CuPy sees; raises :class:`DeviceError` without CuPy or a driver."""
    cp = _cupy()
    try:
        return int(cp.cuda.runtime.getDeviceCount())
    except Exception as exc:  # cupy raises CUDARuntimeError without a driver
        raise DeviceError(f"no usable CUDA driver or device ({exc})") from exc


def resolve_devices(spec: str, *, count: Callable[[], int] | None = None) -> list[str]:
    """``cpu`` -> ``["cpu"]``; ``cuda:N`` -> ``["cuda:N"]`` after checking it exists; ``all`` -> every
    CUDA device when CuPy sees at least one, else ``["cpu"]``. ``count`` replaces
    :func:`cuda_device_count` (the number of CUDA devices)."""
    count = cuda_device_count if count is None else count
    match = _DEVICE_RE.match(spec or "")
    if match is None:
        raise ConfigError(f"unknown device {spec!r} (expected cpu, cuda:N or all)")
    if spec == "cpu":
        return ["cpu"]
    if spec == "all":
        try:
            have = count()
        except DeviceError:
            return ["cpu"]
        return [f"cuda:{i}" for i in range(have)] or ["cpu"]
    index = int(match.group(2))
    have = count()
    if index >= have:
        what = "no CUDA devices" if have == 0 else f"{have} CUDA device{'s' if have > 1 else ''} " \
                                                   f"(cuda:0..cuda:{have - 1})"
        raise DeviceError(f"{spec} requested but this machine has {what}")
    return [spec]


@functools.lru_cache(maxsize=1)
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return "cpu:" + " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return "cpu:" + (platform.processor() or platform.machine() or "unknown")


@dataclass(frozen=True)
class Backend:
    """Arrays, timing and the GEMM under test on one device (``cpu`` or ``cuda:N``)."""

    device: str
    xp: Any
    index: int | None = None

    @classmethod
    def for_device(cls, device: str) -> Backend:
        if device == "cpu":
            return cls(device="cpu", xp=np)
        names = resolve_devices(device)
        if names != [device]:
            raise ConfigError(f"a backend needs one device, got {device!r}")
        return cls(device=device, xp=_cupy(), index=int(device.split(":", 1)[1]))

    @property
    def is_gpu(self) -> bool:
        return self.index is not None

    @property
    def model(self) -> str:
        """The device model, e.g. ``NVIDIA H100 80GB HBM3`` or ``cpu:AMD EPYC 7B13``; keys baselines."""
        if not self.is_gpu:
            return _cpu_model()
        name = self.xp.cuda.runtime.getDeviceProperties(self.index)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)

    def activate(self) -> Any:
        """Context manager making this device current (a no-op on the CPU)."""
        if self.is_gpu:
            return self.xp.cuda.Device(self.index)
        return _NullContext()

    def asarray(self, host: np.ndarray) -> Any:
        """A copy of ``host`` in this device's memory (on the CPU a separate buffer, as on a GPU)."""
        return self.xp.asarray(host) if self.is_gpu else np.array(host, order="C", copy=True)

    def to_host(self, arr: Any) -> np.ndarray:
        return self.xp.asnumpy(arr) if self.is_gpu else np.asarray(arr)

    def synchronize(self) -> None:
        if self.is_gpu:
            self.xp.cuda.Device(self.index).synchronize()

    def timed(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        """Run ``fn`` and return its value and the seconds it took, the device synchronised."""
        self.synchronize()
        start = time.perf_counter()
        out = fn()
        self.synchronize()
        return out, time.perf_counter() - start

    def free_memory_bytes(self) -> int:
        if self.is_gpu:
            free, _total = self.xp.cuda.runtime.memGetInfo()
            return int(free)
        try:
            with open("/proc/meminfo", encoding="utf-8") as fh:
                for line in fh:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 1 << 30

    def matmul(self, a: Any, b: Any, precision: Precision) -> Any:
        """C = A·B with fp32 accumulation and an fp32 result; ``a`` (m×k), ``b`` (k×n) in storage format.

        On the CPU, fp16/bf16 operands are widened exactly to fp32 and multiplied by the BLAS
        sgemm, so the arithmetic is fp32 accumulation of exact products. On a GPU the operands go
        to ``cublasGemmEx`` in their own format (tensor cores for fp16/bf16) with
        ``CUBLAS_COMPUTE_32F``, and the result is fp32.
        """
        m, k = a.shape
        k2, n = b.shape
        if k != k2:
            raise ConfigError(f"inner dimensions differ: {a.shape} x {b.shape}")
        if not self.is_gpu:
            return np.matmul(widen(np, a, precision), widen(np, b, precision))
        if precision is Precision.FP32 and os.environ.get("CUPY_TF32") == "1":
            raise ConfigError("CUPY_TF32=1 lets cuBLAS round fp32 operands to TF32; unset it for the self-test")
        return self._gemm_ex(a, b, m, n, k, precision)

    def _gemm_ex(self, a: Any, b: Any, m: int, n: int, k: int, precision: Precision) -> Any:
        from cupy_backends.cuda.libs import cublas  # only reached with CuPy installed

        cp = self.xp
        dtype = {Precision.FP32: _CUDA_R_32F, Precision.FP16: _CUDA_R_16F, Precision.BF16: _CUDA_R_16BF}[precision]
        a = cp.ascontiguousarray(a)
        b = cp.ascontiguousarray(b)
        c = cp.empty((m, n), dtype=cp.float32)
        one = np.array(1.0, dtype=np.float32)
        zero = np.array(0.0, dtype=np.float32)
        handle = cp.cuda.device.get_cublas_handle()
        mode = cublas.getPointerMode(handle)
        cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)  # alpha and beta live on the host
        try:
            # Row-major C = A·B is column-major Cᵀ = Bᵀ·Aᵀ: pass B first, leading dimensions n, k, n.
            cublas.gemmEx(handle, _CUBLAS_OP_N, _CUBLAS_OP_N, n, m, k, one.ctypes.data, b.data.ptr, dtype, n,
                          a.data.ptr, dtype, k, zero.ctypes.data, c.data.ptr, _CUDA_R_32F, n,
                          _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT)
        finally:
            cublas.setPointerMode(handle, mode)
        return c


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
