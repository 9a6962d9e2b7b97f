"""ABFT verification time as a fraction of the GEMM it checks, measured in the same run.

For n = 1024, 2048, 4096 (fp32, operands uniform in [-1, 1)): time the GEMM C = A·B, the
operand encoding (checksums and tolerances of A and B, once per operand pair) and the
verification of C (row and column sums against the checksums), on the CPU path (NumPy BLAS).
Each time is the best of ``--repeat`` runs to damp other load on the machine. Prints one JSON
object; ``verify_fraction`` is the figure the target (<= 2 % at 4096) applies to, and
``encode_plus_verify_fraction`` is the whole cost when a pair of operands is used only once.

    python bench/abft.py [--sizes 1024,2048,4096] [--repeat 2]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import orjson

from fleethealth.kernels.abft import encode_operands, verify_product
from fleethealth.kernels.backend import Backend


def _best(fn, repeat: int) -> tuple[object, float]:
    best = float("inf")
    out = None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return out, best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024,2048,4096")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args(argv)
    backend = Backend.for_device("cpu")
    rng = np.random.default_rng(0)
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        a = rng.uniform(-1.0, 1.0, (n, n)).astype(np.float32)
        b = rng.uniform(-1.0, 1.0, (n, n)).astype(np.float32)
        np.matmul(a[:64], b)  # warm the BLAS threads
        c, gemm_s = _best(lambda a=a, b=b: np.matmul(a, b), args.repeat)
        enc, encode_s = _best(lambda a=a, b=b: encode_operands(backend, a, b), args.repeat)
        check, verify_s = _best(lambda c=c, enc=enc: verify_product(backend, c, enc), args.repeat + 1)
        if not check.ok:
            print(f"healthy product failed its checks at n={n}", file=sys.stderr)
            return 1
        rows.append({"n": n, "gemm_s": round(gemm_s, 5), "gemm_tflops": round(2 * n**3 / gemm_s / 1e12, 4),
                     "encode_s": round(encode_s, 5), "verify_s": round(verify_s, 5),
                     "verify_fraction": round(verify_s / gemm_s, 5),
                     "encode_plus_verify_fraction": round((encode_s + verify_s) / gemm_s, 5),
                     "max_residual_over_tolerance": float(f"{check.max_ratio:.3g}")})
    last = rows[-1]
    out = {"bench": "abft", "device": "cpu", "model": backend.model, "dtype": "fp32", "sizes": rows,
           "target": "verify_fraction <= 0.02 at the largest n", "target_met": last["verify_fraction"] <= 0.02}
    sys.stdout.write(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
