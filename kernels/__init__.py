"""Known-answer compute tests: GEMM, ABFT checksums, memory patterns, collectives (CuPy or NumPy/torch)."""

from fleethealth.kernels.abft import AbftCheck, AbftEncoding, checksum_verify, encode_operands, verify_product
from fleethealth.kernels.backend import Backend, Precision, resolve_devices
from fleethealth.kernels.baseline import Baseline, BaselineBook
from fleethealth.kernels.faults import Fault, FaultKind
from fleethealth.kernels.results import Mismatch, SelfTestResult, Verdict
from fleethealth.kernels.suite import GROUPS, SUITES, run_suite

__all__ = [
    "AbftCheck",
    "AbftEncoding",
    "Backend",
    "Baseline",
    "BaselineBook",
    "Fault",
    "FaultKind",
    "GROUPS",
    "Mismatch",
    "Precision",
    "SUITES",
    "SelfTestResult",
    "Verdict",
    "checksum_verify",
    "encode_operands",
    "resolve_devices",
    "run_suite",
    "verify_product",
]
