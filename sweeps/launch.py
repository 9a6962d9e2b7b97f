"""Running the self-test suite on one node: on this machine, or on a Slurm node through ``srun -w``.

A launcher only builds an argument list (never a shell string): :class:`LocalLauncher` runs
``python -m fleethealth selftest …`` here; :class:`SrunLauncher` runs ``srun -w NODE -N 1
-n 1 … fleethealth selftest …`` so Slurm places the step on that node. :func:`run_node` executes
the list with a timeout, reads the ``--json`` records from its output and returns a
:class:`NodeRun`. :func:`slurm_idle_nodes` lists the idle nodes ``sinfo`` reports.

Both launchers may carry the scheduler (``scheduler=``) in which a node the quarantine book releases
is returned to service (:func:`fleethealth.sweeps.release.apply_release`): a
:class:`~fleethealth.adapters.kubernetes.KubernetesAdapter` for the local launcher of the sweep
CronJob, a :class:`~fleethealth.adapters.slurm.SlurmAdapter` for srun.

A drained Slurm node runs no job step, not even the sweep's. Given the Slurm adapter,
:meth:`SrunLauncher.reach` takes a
node fleethealth drained (reason ``fleethealth:``) into a maintenance reservation
(``Flags=MAINT,IGNORE_JOBS``, so no user job can land there), resumes it inside the reservation,
runs the suite with ``srun --reservation``, and afterwards drains it again with its old reason
and deletes the reservation: only a release by the quarantine book returns the node for good
(:func:`fleethealth.sweeps.release.apply_release`). A node another owner drained is not touched
and its run is an ``error``.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

import orjson

from fleethealth.adapters.base import LeftAlone, SchedulerError
from fleethealth.errors import ConfigError, DeviceError, SchemaError
from fleethealth.kernels.results import SelfTestResult, Verdict
from fleethealth.sweeps.plan import read_node_list, validate_node

__all__ = ["NodeStatus", "NodeRun", "LocalLauncher", "SrunLauncher", "run_node", "parse_records",
           "slurm_idle_nodes"]

_SUITES = ("quick", "full")


class NodeStatus(StrEnum):
    """``pass``: every test passed; ``fail``: a wrong answer; ``slow``: right but degraded;
    ``error``: the suite could not run there (exit 2, a crash, a timeout, no records)."""

    PASS = "pass"
    FAIL = "fail"
    SLOW = "slow"
    ERROR = "error"


@dataclass(frozen=True)
class NodeRun:
    """One node's self-test run: the command's exit code, its results, and ``error`` (the reason
    in one line) when it could not run."""

    node: str
    suite: str
    exit_code: int
    results: tuple[SelfTestResult, ...] = ()
    error: str = ""
    duration_s: float = 0.0
    argv: tuple[str, ...] = field(default=(), repr=False)

    @property
    def status(self) -> NodeStatus:
        if self.error or self.exit_code not in (0, 1) or not self.results:
            return NodeStatus.ERROR
        if any(r.verdict is Verdict.FAIL for r in self.results):
            return NodeStatus.FAIL
        if any(r.verdict is Verdict.SLOW for r in self.results) or self.exit_code:
            return NodeStatus.SLOW
        return NodeStatus.PASS

    @property
    def failing(self) -> tuple[str, ...]:
        return tuple(f"{r.test}@{r.device}" for r in self.results if r.verdict is not Verdict.PASS)


def _selftest_args(node: str, suite: str, device: str, only: Sequence[str] | None) -> list[str]:
    if suite not in _SUITES:
        raise ConfigError(f"unknown suite {suite!r} (known: {', '.join(_SUITES)})")
    args = ["selftest", "--suite", suite, "--device", device, "--json", "--node", validate_node(node)]
    if only:
        args += ["--only", ",".join(only)]
    return args


@dataclass(frozen=True)
class LocalLauncher:
    """Runs the suite on this machine with the running interpreter; ``scheduler`` returns a node the
    quarantine book releases (a :class:`~fleethealth.adapters.kubernetes.KubernetesAdapter`)."""

    python: str = sys.executable
    scheduler: Any = None

    def argv(self, node: str, suite: str, device: str = "all", only: Sequence[str] | None = None) -> list[str]:
        return [self.python, "-m", "fleethealth", *_selftest_args(node, suite, device, only)]


@dataclass(frozen=True)
class SrunLauncher:
    """Runs the suite on a Slurm node: ``srun -w NODE -N 1 -n 1 [extra…] COMMAND selftest …``.

    ``command`` is how the node starts fleethealth (default ``fleethealth`` on its PATH);
    ``extra`` adds srun options such as ``--exclusive`` or ``--gres=gpu:8`` (each one list item).
    ``scheduler`` (a :class:`~fleethealth.adapters.slurm.SlurmAdapter`) lets :meth:`reach` test nodes
    fleethealth drained, through a maintenance reservation held ``reserve_minutes``;
    ``reservation`` is the one :meth:`reach` made (``srun --reservation=NAME``).
    """

    srun: str = "srun"
    command: tuple[str, ...] = ("fleethealth",)
    extra: tuple[str, ...] = ()
    scheduler: Any = None
    reserve_minutes: int = 120
    reservation: str | None = None

    def argv(self, node: str, suite: str, device: str = "all", only: Sequence[str] | None = None) -> list[str]:
        for opt in self.extra:
            if not opt.startswith("-"):
                raise ConfigError(f"srun options must start with '-', got {opt!r}")
        held = [f"--reservation={self.reservation}"] if self.reservation else []
        return [self.srun, "-w", validate_node(node), "-N", "1", "-n", "1", *held, *self.extra, *self.command,
                *_selftest_args(node, suite, device, only)]

    @contextlib.contextmanager
    def reach(self, node: str) -> Iterator[SrunLauncher]:
        """Yield the launcher that reaches ``node``; see the module docstring. Raises
        :class:`~fleethealth.adapters.base.LeftAlone` for a node another owner drained."""
        slurm = self.scheduler
        if slurm is None:
            yield self
            return
        info = slurm.info(node)
        if not info.held:
            yield self
            return
        if not info.ours:
            raise LeftAlone(f"{node} is {info.state} by another owner (reason {info.reason!r}): not swept")
        name = slurm.reserve(node, minutes=self.reserve_minutes)
        try:
            slurm.resume(node)
            yield replace(self, reservation=name)
        finally:
            try:
                slurm.drain(node, info.reason)  # drained again until the quarantine book releases it
            finally:
                slurm.unreserve(node)


def parse_records(stdout: str | bytes) -> list[SelfTestResult]:
    """The results in ``selftest --json`` output; lines that are not JSON objects are skipped,
    records that do not match the schema raise :class:`SchemaError`."""
    text = stdout.decode(errors="replace") if isinstance(stdout, bytes) else stdout
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        out.append(SelfTestResult.from_data(obj))
    return out


Runner = Callable[..., subprocess.CompletedProcess]


def run_node(launcher: LocalLauncher | SrunLauncher, node: str, *, suite: str = "full", device: str = "all",
             only: Sequence[str] | None = None, timeout_s: float = 1800.0, run: Runner = subprocess.run) -> NodeRun:
    """Run the suite on ``node`` through ``launcher`` (inside :meth:`SrunLauncher.reach` when the
    launcher has one) and collect its records; a node the launcher cannot reach is an ``error`` run."""
    reach = getattr(launcher, "reach", None)
    try:
        with (reach(node) if reach is not None else contextlib.nullcontext(launcher)) as active:
            return _run_node(active, node, suite=suite, device=device, only=only, timeout_s=timeout_s, run=run)
    except SchedulerError as exc:
        return NodeRun(node, suite, 2, error=f"cannot reach {node}: {exc}")


def _run_node(launcher: LocalLauncher | SrunLauncher, node: str, *, suite: str, device: str,
              only: Sequence[str] | None, timeout_s: float, run: Runner) -> NodeRun:
    argv = launcher.argv(node, suite, device, only)
    start = time.monotonic()
    try:
        proc = run(argv, capture_output=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return NodeRun(node, suite, 124, error=f"timed out after {timeout_s:.0f} s", argv=tuple(argv),
                       duration_s=time.monotonic() - start)
    except OSError as exc:
        return NodeRun(node, suite, 127, error=f"cannot start {argv[0]}: {exc}", argv=tuple(argv),
                       duration_s=time.monotonic() - start)
    took = time.monotonic() - start
    err_lines = proc.stderr.decode(errors="replace").strip().splitlines() if proc.stderr else []
    try:
        results = tuple(parse_records(proc.stdout or b""))
    except SchemaError as exc:
        return NodeRun(node, suite, proc.returncode, error=f"bad self-test record: {exc}", argv=tuple(argv),
                       duration_s=took)
    error = ""
    if proc.returncode not in (0, 1) or not results:
        error = err_lines[-1] if err_lines else f"exit {proc.returncode} with no results"
    return NodeRun(node, suite, proc.returncode, results, error, took, tuple(argv))


def slurm_idle_nodes(sinfo: str = "sinfo", run: Runner = subprocess.run, partition: str | None = None) -> list[str]:
    """Idle nodes as ``sinfo -h -N -t idle -o %N`` reports them (one validated name per line)."""
    argv = [sinfo, "-h", "-N", "-t", "idle", "-o", "%N"]
    if partition:
        argv += ["-p", validate_node(partition)]
    try:
        proc = run(argv, capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DeviceError(f"cannot list idle nodes with {sinfo}: {exc}") from exc
    if proc.returncode != 0:
        lines = proc.stderr.decode(errors="replace").strip().splitlines()
        raise DeviceError(f"{sinfo} failed: {lines[-1] if lines else f'exit {proc.returncode}'}")
    return read_node_list(proc.stdout.decode(errors="replace"))
