"""GPU check of fleethealth's kernels (called by bench/gpu_check.sh): one JSON object.

On cuda:0 of a machine with CuPy: the exact known-answer GEMMs (verdicts) and their throughput
against ``torch.matmul`` on the same shapes and dtypes (cuBLAS through CuPy where torch has no
CUDA), measured with CUDA events in the same run; ABFT verification time as a fraction of the
GEMM it checks; memory-pattern bandwidth against a plain device copy; NCCL bus bandwidth across
the local GPUs (skipped, with the reason, on a one-GPU machine).
Exit 0 when every part ran and every test passed, 1 otherwise, 2 with one line when there is no
GPU or no CuPy.

    python bench/gpu_kernels.py [--n 8192] [--iters 20]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson

from fleethealth.errors import DeviceError
from fleethealth.kernels.abft import run_abft
from fleethealth.kernels.backend import Backend, Precision, cuda_device_count, encode
from fleethealth.kernels.collective import run_nccl
from fleethealth.kernels.gemm import gemm_tflops, run_exact, run_repeat
from fleethealth.kernels.memory import Pattern, run_memory


def _event_time(cp: Any, fn: Callable[[], Any], iters: int) -> float:
    """Mean seconds per call of ``fn`` over ``iters`` calls, by CUDA events, after two warm-ups."""
    fn()
    fn()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / 1e3 / iters


def _reference_matmul(cp: Any, a_host: np.ndarray, b_host: np.ndarray, precision: Precision) -> tuple[str, Callable]:
    try:
        import torch

        if torch.cuda.is_available():
            torch.backends.cuda.matmul.allow_tf32 = False
            dtype = {Precision.FP32: torch.float32, Precision.FP16: torch.float16, Precision.BF16: torch.bfloat16}
            a = torch.from_numpy(a_host.astype(np.float32)).to("cuda:0", dtype[precision])
            b = torch.from_numpy(b_host.astype(np.float32)).to("cuda:0", dtype[precision])
            return "torch.matmul", lambda: torch.matmul(a, b)
    except ImportError:
        pass
    if precision is Precision.BF16:
        raise DeviceError("no bf16 reference: torch with CUDA is not installed and CuPy has no bfloat16")
    dtype = np.float32 if precision is Precision.FP32 else np.float16
    a, b = cp.asarray(a_host.astype(dtype)), cp.asarray(b_host.astype(dtype))
    return "cupy.matmul (cuBLAS)", lambda: cp.matmul(a, b)


def _gemm(backend: Backend, n: int, iters: int) -> list[dict[str, Any]]:
    cp = backend.xp
    rng = np.random.default_rng(0)
    rows = []
    for precision in Precision:
        exact = run_exact(backend, 4096, 4096, 4096, precision=precision, iters=3)
        a_host = rng.uniform(-1, 1, (n, n)).astype(np.float32)
        b_host = rng.uniform(-1, 1, (n, n)).astype(np.float32)
        a, b = cp.asarray(encode(a_host, precision)), cp.asarray(encode(b_host, precision))
        ours = _event_time(cp, lambda a=a, b=b, p=precision: backend.matmul(a, b, p), iters)
        name, ref_fn = _reference_matmul(cp, a_host, b_host, precision)
        ref = _event_time(cp, ref_fn, iters)
        rows.append({"dtype": precision.value, "n": n, "exact_verdict": exact.verdict.value,
                     "exact_mismatches": exact.mismatch_total, "tflops": round(gemm_tflops(n, n, n, ours), 2),
                     "reference": name, "reference_tflops": round(gemm_tflops(n, n, n, ref), 2),
                     "ratio": round(ref / ours, 4)})
        del a, b
        cp.get_default_memory_pool().free_all_blocks()
    repeat = run_repeat(backend, 4096, 4096, 4096, runs=5)
    rows.append({"dtype": "fp32", "n": 4096, "repeat_verdict": repeat.verdict.value, "runs": 5})
    return rows


def _abft(backend: Backend) -> list[dict[str, Any]]:
    rows = []
    for n in (4096, 8192):
        for precision in (Precision.FP32, Precision.BF16):
            r = run_abft(backend, n, n, n, precision=precision, iters=5)
            rows.append({"n": n, "dtype": precision.value, "verdict": r.verdict.value,
                         "gemm_s": r.extra["gemm_s"], "encode_s": r.extra["encode_s"], "verify_s": r.extra["verify_s"],
                         "verify_fraction": round(r.extra["overhead"], 5),
                         "encode_plus_verify_fraction": round((r.extra["encode_s"] + r.extra["verify_s"])
                                                              / r.extra["gemm_s"], 5)})
    return rows


def _memory(backend: Backend, fraction: float, iters: int) -> dict[str, Any]:
    cp = backend.xp
    nbytes = int(backend.free_memory_bytes() * fraction) // 512 * 512
    results = run_memory(backend, nbytes, patterns=(Pattern.CHECKERBOARD, Pattern.MOVING_INVERSIONS,
                                                    Pattern.ADDRESS, Pattern.WALKING_ONES))
    cp.get_default_memory_pool().free_all_blocks()
    src = cp.zeros(nbytes // 16, dtype=cp.uint64)
    dst = cp.empty_like(src)
    copy_s = _event_time(cp, lambda: cp.copyto(dst, src), iters)
    copy_gbps = 2 * src.nbytes / copy_s / 1e9
    return {"nbytes": nbytes, "copy_gbps": round(copy_gbps, 1),
            "patterns": {r.test: {"verdict": r.verdict.value, "gbps": round(r.throughput, 1),
                                  "ratio_to_copy": round(r.throughput / copy_gbps, 3)} for r in results}}


def _collective(backend: Backend, gpus: int) -> dict[str, Any]:
    if gpus < 2:
        return {"skipped": f"the NCCL collective test needs two GPUs, this machine has {gpus}"}
    results = run_nccl(list(range(gpus)), elements=1 << 26, iters=10, model=backend.model)
    return {r.test: {"verdict": r.verdict.value, "busbw_gbps": round(r.throughput, 1)} for r in results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8192, help="GEMM size for the throughput comparison")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--memory-fraction", type=float, default=0.25)
    args = parser.parse_args(argv)
    try:
        gpus = cuda_device_count()
        if gpus < 1:
            raise DeviceError("CuPy sees no CUDA device")
        backend = Backend.for_device("cuda:0")
    except DeviceError as exc:
        print(f"gpu_kernels: cannot run: {exc}", file=sys.stderr)
        return 2
    out: dict[str, Any] = {"bench": "gpu_kernels", "device": "cuda:0", "model": backend.model, "gpus": gpus}
    ok = True
    with backend.activate():
        for name, part in (("gemm", lambda: _gemm(backend, args.n, args.iters)), ("abft", lambda: _abft(backend)),
                           ("memory", lambda: _memory(backend, args.memory_fraction, args.iters)),
                           ("collective", lambda: _collective(backend, gpus))):
            try:
                out[name] = part()
            except Exception as exc:  # report the part that broke and keep measuring the others
                out[name] = {"error": f"{type(exc).__name__}: {exc}"}
                ok = False
    text = orjson.dumps(out).decode()
    ok = ok and '"fail"' not in text
    sys.stdout.write(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode() + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
