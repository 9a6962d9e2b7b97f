"""``fleethealth demo --injob``: the in-job SDC defence proved on a real (CPU) torch training run.

The launcher starts a DDP job of ``world`` ranks with gloo on the CPU (``torch.multiprocessing``,
no torchrun; the job itself is :mod:`fleethealth.demo_injob_worker`), each rank placed on a node of
its own. Everything after the training process is the production path:

    rank --Reporter/wire.Sender--> the node's probe socket (probe.daemon.DatagramListener)
         --> probe.aggregator.StepAggregator (node filled in) --> probe.delivery.Delivery (spool)
         --> embedded Kafka-protocol broker --> detectors.runner.Runner (detectors + policy) --> chDB

1. A clean run of the job gives the reference weights.
2. The run under test: the in-job library emits its checks, its checkpoints (files in the checkpoint
   directory, records with both verification marks) and ``job_start`` / ``job_exit``; a fault of
   :class:`fleethealth.injob.FaultInjector` runs on one node (``transient``: one bit of one gradient
   element on one rank at one step; ``deterministic``: one rank's matmul output, every step from
   one on). When a check fails every rank skips the step's update with the same verdict; a
   ``transient`` fault is rolled back **by the job itself** (``StepVerdict.rollback_to``, the policy's
   rule applied in the job) and the job trains on; any other class halts the job.
3. The launcher reads the ``sdc`` finding and the ``rollback`` recommendation **from the store**.
   After a transient it checks that the policy chose the checkpoint the job already rolled back to;
   after a halt it acts on it: restores the target checkpoint, replaces the culprit rank's node with
   a spare (the quarantined device keeps its fault), and trains to the end.
4. The final weights are compared bit for bit with the clean run's.

With ``corrupt_step`` (``--corrupt-checkpoint STEP``, a deterministic fault only) rank 0 also validates
every checkpoint in the background (:class:`fleethealth.injob.ckptcheck.CheckpointValidator`,
``checkpoint_validated`` events through the same path) and writes the checkpoint of that step corrupt —
one weight 100x, as a rank failing while it wrote would: its digests match, its norm does not. The
policy must refuse it, name it, and roll back to the newest *validated* checkpoint before it; the
resumed run must still end bitwise equal to the clean one.

Cadences (steps): self-check every 10, replay every 40, checkpoint every 10, 120 steps; the
transient flip lands at step 70 on rank 2, the deterministic fault starts at step 50 on rank 1 —
after the passing replay at 40, so a clean checkpoint exists (else the right answer is "no clean
checkpoint: needs a human", and the demo says so and fails).
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fleethealth.errors import ConfigError, FleetHealthError

__all__ = ["FAULTS", "DemoFailed", "InjobResult", "check_ckpt_dir", "check_world", "run_injob_demo", "run_injob_main",
           "summary"]

FAULTS = ("none", "transient", "deterministic")
JOB = "injob-demo"
_FAULT_AT = {"transient": (70, 2, 22, "4.bias", 0), "deterministic": (50, 1, 31, "0", 3)}
"""fault -> (step, rank, bit, target, element index)."""
_RANK_MEMORY = 400 << 20
_TIMEOUT_S = 300.0


class DemoFailed(FleetHealthError):
    """The job or the pipeline did not get through (a rank died, nothing arrived in time)."""


@dataclass
class InjobResult:
    """What the in-job demo saw. ``ok`` is the exit criterion (see :func:`run_injob_demo`)."""

    fault: str
    world: int
    steps: int
    injected_at_step: int | None = None
    injected_rank: int | None = None
    detected_at_step: int | None = None
    detected_by: str | None = None
    classification: str | None = None
    culprit_rank: int | None = None
    culprit_node: str | None = None
    quarantined: bool = False
    rollback_step: int | None = None
    rollback_uri: str | None = None
    rollback_guard: str | None = None
    halted_at_step: int | None = None
    in_job_rollback: tuple[int, int] | None = None
    """``(failed step, checkpoint step)`` of the rollback the job carried out by itself (transient)."""
    replaced_with: str | None = None
    steps_retrained: int = 0
    sdc_findings: int = 0
    findings_by_kind: dict[str, int] = field(default_factory=dict)
    sdc_findings_after_rollback: int = 0
    checkpoints_written: int = 0
    job_exits: list[str] = field(default_factory=list)
    events_stored: int = 0
    events_dropped: int = 0
    final_bitwise_equal_to_clean: bool = False
    corrupt_step: int | None = None
    """The checkpoint written corrupt on purpose (``None``: none, and no validation)."""
    validations: dict[str, int] = field(default_factory=dict)
    """``checkpoint_validated`` events in the store, by result."""
    refused_checkpoints: list[list[Any]] = field(default_factory=list)
    """``[step, why]`` of each checkpoint the rollback passed over for its validation."""
    wall_s: float = 0.0
    detect_wait_s: float = 0.0
    phases_s: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        if self.fault == "none":
            return self.sdc_findings == 0 and self.final_bitwise_equal_to_clean
        in_job_agrees = self.in_job_rollback is None or self.in_job_rollback[1] == self.rollback_step
        refused = self.corrupt_step is None or (
            self.rollback_step != self.corrupt_step and self.validations.get("invalid", 0) == 1
            and [s for s, _ in self.refused_checkpoints] == [self.corrupt_step])
        return (refused and self.sdc_findings > 0 and self.rollback_step is not None
                and self.injected_at_step is not None and self.rollback_step <= self.injected_at_step and in_job_agrees
                and self.final_bitwise_equal_to_clean)

    def to_obj(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok, "wall_s": round(self.wall_s, 2),
                "detect_wait_s": round(self.detect_wait_s, 2),
                "phases_s": {k: round(v, 2) for k, v in self.phases_s.items()}}


# ---------------------------------------------------------------------------- input checks
def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _available_memory() -> int | None:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def check_world(world: int) -> None:
    """Refuse a world size the replay cannot use or this machine cannot run (one line, ConfigError)."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 4 or world % 2:
        raise ConfigError(f"--world {world}: the cross-rank replay pairs rank r with r + world/2 and a third "
                          "rank votes, so the world size must be an even number of at least 4")
    cpus, memory = _cpus(), _available_memory()
    most = 4 * cpus
    if memory is not None:
        most = min(most, memory // _RANK_MEMORY)
    if world > most:
        have = f"{cpus} CPUs" + ("" if memory is None else f", {memory / 2**30:.1f} GiB available")
        raise ConfigError(f"--world {world}: this machine can run at most {max(most, 0)} ranks ({have})")


def check_ckpt_dir(path: Path) -> None:
    """The checkpoint directory must be writable and hold no checkpoints of another run."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"checkpoint directory {path} cannot be written: {exc.strerror or exc}") from None
    old = sorted(path.glob("ckpt-*"))
    if old:
        raise ConfigError(f"checkpoint directory {path} already holds checkpoints ({old[0].name}, ...); "
                          "give an empty one")


# ---------------------------------------------------------------------------- the node probes
class _Probes:
    """One probe socket and step aggregator per node, read by one thread, delivered through one spool."""

    def __init__(self, sockets: dict[str, str], delivery: Any) -> None:
        from fleethealth.probe.aggregator import StepAggregator
        from fleethealth.probe.daemon import DatagramListener

        self.listeners = {n: DatagramListener(p) for n, p in sockets.items()}
        self.aggregators = {n: StepAggregator(n) for n in sockets}
        self.delivery = delivery
        self.submitted = 0
        self._stop = threading.Event()
        self._selector = selectors.DefaultSelector()
        for node, listener in self.listeners.items():
            self._selector.register(listener, selectors.EVENT_READ, node)
        self._thread = threading.Thread(target=self._run, name="fh-injob-probes", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=0.1):
                node = key.data
                agg = self.aggregators[node]
                now = time.monotonic()
                for datagram in self.listeners[node].receive():
                    agg.feed(datagram, now, time.time())
                drained = agg.drain(now)
                for msg in (*drained.batches, *drained.events):
                    self.delivery.submit(msg)
                self.submitted += len(drained.batches) + len(drained.events)

    @property
    def received(self) -> int:
        return sum(a.stats.datagrams_total for a in self.aggregators.values())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._selector.close()
        for listener in self.listeners.values():
            listener.close()


# ---------------------------------------------------------------------------- the launcher
class _Launcher:
    def __init__(self, spec: Any) -> None:
        """Start the ranks (they import torch and run the clean job while the pipeline comes up);
        :meth:`attach` the pipeline before waiting on them."""
        import torch.multiprocessing as mp

        from fleethealth.demo_injob_worker import worker

        self.spec = spec
        self.runner: Any = None
        self.probes: Any = None
        # a fork server that imported torch once forks every rank: four fresh interpreters each
        # importing torch and torch._dynamo (which DDP and every optimiser load when built) cost tens
        # of seconds on a small CI machine
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch._dynamo", "fleethealth.demo_injob_worker"])
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(spec.world)]
        self.procs = [ctx.Process(target=worker, args=(r, spec, self.commands[r], self.results), daemon=True,
                                  name=f"fh-injob-rank{r}") for r in range(spec.world)]
        self.reports: dict[str, dict[int, Any]] = {}
        self.consumed = 0
        self.sent = 0
        self.dropped = 0
        for p in self.procs:
            p.start()

    def attach(self, runner: Any, probes: _Probes) -> None:
        self.runner, self.probes = runner, probes

    def pump(self, timeout_s: float = 0.2) -> int:
        got = self.runner.process_once(timeout_s)
        self.consumed += got
        return got

    def wait_phase(self, phase: str, deadline: float) -> dict[int, Any]:
        """Run the detectors while every rank finishes ``phase``; return the ranks' reports."""
        import queue

        while len(self.reports.get(phase, {})) < self.spec.world:
            try:
                kind, rank, payload = self.results.get_nowait()
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise DemoFailed(f"the job did not finish its {phase} phase within {_TIMEOUT_S:.0f} s") from None
                dead = [p.name for p in self.procs if not p.is_alive()]
                if dead:
                    raise DemoFailed(f"{', '.join(dead)} exited during the {phase} phase") from None
                self.pump()
                continue
            if kind == "error":
                raise DemoFailed(f"rank {rank} failed: {str(payload).strip().splitlines()[-1]}")
            self.reports.setdefault(payload.phase, {})[rank] = payload
        reports = self.reports[phase]
        if phase != "clean":
            self.sent += sum(r.events_sent for r in reports.values())
            self.dropped += sum(r.events_dropped for r in reports.values())
        return reports

    def quiesce(self, deadline: float) -> None:
        """Until everything the ranks sent is received, delivered, consumed and concluded."""
        while True:
            delivery = self.probes.delivery.stats
            if (self.probes.received >= self.sent and delivery.spool.records == 0
                    and delivery.delivered_total >= self.probes.submitted
                    and self.consumed + self.runner.consumer.dead_lettered_total >= delivery.delivered_total):
                if self.pump(0.3) == 0:  # an empty poll releases everything held for event-time order
                    return
            elif time.monotonic() > deadline:
                raise DemoFailed(f"the pipeline did not catch up within {_TIMEOUT_S:.0f} s (sent {self.sent}, "
                                 f"received {self.probes.received}, delivered {delivery.delivered_total}, "
                                 f"consumed {self.consumed})")
            else:
                self.pump(0.1)

    def order(self, *command: Any) -> None:
        for q in self.commands:
            q.put(command)

    def close(self) -> None:
        self.order("stop")
        for p in self.procs:
            p.join(timeout=10.0)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)


class _Marks:
    """Seconds spent in each named phase, each measured from the previous mark."""

    def __init__(self, into: dict[str, float], since: float) -> None:
        self.into, self.last = into, since

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.into[name] = now - self.last
        self.last = now


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _equal(a: Path, b: Path) -> bool:
    if not (a.exists() and b.exists()):
        return False
    with np.load(a) as x, np.load(b) as y:
        if sorted(x.files) != sorted(y.files):
            return False
        return all(x[k].dtype == y[k].dtype and x[k].shape == y[k].shape
                   and x[k].tobytes() == y[k].tobytes() for k in x.files)


def run_injob_demo(fault: str = "none", *, world: int = 4, steps: int = 120, every: int = 10,
                   replay_every: int = 40, ckpt_every: int = 10, ckpt_dir: Path | None = None,
                   seed: int = 0, corrupt_step: int | None = None) -> InjobResult:
    """Run the in-job demo with ``fault`` (one of :data:`FAULTS`); see the module docstring.

    ``ok`` on the result: for a fault, the detectors found it, the rollback recommendation's step is
    at or before the step the fault was injected, and the final weights equal the clean run's bit
    for bit; for ``none``, no ``sdc`` finding and equal weights. Raises :class:`ConfigError` (one
    line) for an unknown fault, a world size this machine cannot run, or a checkpoint directory
    that cannot be written; :class:`DemoFailed` when the job or the pipeline broke down.
    """
    if fault not in FAULTS:
        raise ConfigError(f"unknown --fault {fault!r} (known: {', '.join(FAULTS)})")
    if corrupt_step is not None:
        if fault != "deterministic":
            # the transient path rolls back inside the job, whose guard would need rank 0's verdicts on every rank
            raise ConfigError("--corrupt-checkpoint goes with --fault deterministic (the job halts and the "
                              "policy's rollback is carried out)")
        if corrupt_step % ckpt_every or not 0 <= corrupt_step < steps:
            raise ConfigError(f"--corrupt-checkpoint {corrupt_step}: not a checkpoint step (every {ckpt_every} "
                              f"from 0 to {steps - 1})")
    check_world(world)
    own_ckpt = ckpt_dir is None
    work = Path(tempfile.mkdtemp(prefix="fh-injob-"))
    ckpt = work / "checkpoints" if ckpt_dir is None else Path(ckpt_dir)
    try:
        check_ckpt_dir(ckpt)
        return _run(fault, world, steps, every, replay_every, ckpt_every, ckpt, work, seed, corrupt_step)
    finally:
        for partial in ckpt.glob("*.partial*") if ckpt.exists() else ():
            with contextlib.suppress(OSError):
                partial.unlink()  # a write cut short: nothing half-written stays behind
        shutil.rmtree(work, ignore_errors=True)
        if own_ckpt:
            shutil.rmtree(ckpt, ignore_errors=True)


def _run(fault: str, world: int, steps: int, every: int, replay_every: int, ckpt_every: int, ckpt: Path,
         work: Path, seed: int, corrupt_step: int | None = None) -> InjobResult:
    from prometheus_client import CollectorRegistry

    from fleethealth.broker import EmbeddedBroker
    from fleethealth.bus import ensure_topics
    from fleethealth.demo_injob_worker import JobSpec
    from fleethealth.detectors.runner import Runner
    from fleethealth.probe.delivery import Delivery
    from fleethealth.probe.spool import Spool
    from fleethealth.store import open_store

    started = time.perf_counter()
    deadline = time.monotonic() + _TIMEOUT_S
    nodes = [f"n{i:04d}" for i in range(world + 1)]  # one per rank and a spare
    placement = tuple(nodes[:world])
    result = InjobResult(fault=fault, world=world, steps=steps, corrupt_step=corrupt_step)
    f_step, f_rank, f_bit, f_target, f_index = _FAULT_AT.get(fault, (0, 0, 22, None, 0))
    (work / "weights").mkdir()
    sockets = {n: str(work / f"{n}.sock") for n in nodes}
    spec = JobSpec(job=JOB, world=world, steps=steps, every=every, replay_every=replay_every,
                   ckpt_every=ckpt_every, seed=seed, ckpt_dir=str(ckpt), out_dir=str(work / "weights"),
                   master_port=_free_port(), placement=placement, sockets=sockets, fault=fault,
                   fault_step=f_step, fault_node=placement[f_rank] if fault != "none" else None,
                   fault_bit=f_bit, fault_target=f_target, fault_index=f_index,
                   validate=corrupt_step is not None, corrupt_step=corrupt_step)
    mark = _Marks(result.phases_s, started)
    with contextlib.ExitStack() as stack:
        launcher = _Launcher(spec)
        stack.callback(launcher.close)
        broker = stack.enter_context(EmbeddedBroker(log_path=work / "broker.log"))
        store = stack.enter_context(open_store(f"chdb://{work / 'store'}"))
        store.migrate()  # the demo owns its throwaway store: it migrates it itself
        ensure_topics(broker.dsn)
        delivery = Delivery(broker.dsn, Spool(work / "spool"), client_id="fleethealth-injob-probes",
                            batch_records=500)
        delivery.start()
        stack.callback(delivery.close)
        probes = _Probes(sockets, delivery)
        stack.callback(probes.close)
        runner = stack.enter_context(Runner(broker.dsn, store, group="fleethealth-injob-demo",
                                            registry=CollectorRegistry()))
        launcher.attach(runner, probes)
        mark("start")
        launcher.wait_phase("clean", deadline)
        mark("clean_run")
        launcher.order("run")  # the probes listen now (a rank that started earlier lost its first events)
        run = launcher.wait_phase("run", deadline)
        mark("run")
        fired = [(r.fault_fired_at, rank) for rank, r in run.items() if r.fault_fired_at is not None]
        if fired:
            result.injected_at_step, result.injected_rank = min(fired)
        result.halted_at_step = next((r.halted_at for r in run.values() if r.halted_at is not None), None)
        in_job = {r.rolled_back for r in run.values()}
        if len(in_job) != 1:
            raise DemoFailed(f"the ranks rolled back differently: {sorted(in_job)}")
        rolled = in_job.pop()
        result.in_job_rollback = tuple(rolled[0]) if rolled else None
        t_detect = time.perf_counter()
        launcher.quiesce(deadline)
        result.detect_wait_s = time.perf_counter() - t_detect
        mark("detect")
        findings = store.findings(kind="sdc", job=JOB)
        result.sdc_findings = len(findings)
        final = work / "weights" / "run-final.npz"
        if findings:
            first = min(findings, key=lambda f: (f.step if f.step is not None else -1, f.ts))
            result.detected_at_step, result.detected_by = first.step, first.detector
            result.classification = first.evidence.get("classification")
            result.culprit_rank, result.culprit_node = first.rank, first.node
            recs = store.recommendations(job=JOB)
            result.quarantined = any(r.action.value == "quarantine" and r.node == first.node for r in recs)
            rollback = next((r for r in recs if r.action.value == "rollback"), None)
            if rollback is not None:
                result.rollback_guard = rollback.guard.value
                result.rollback_step = rollback.evidence.get("target_step")
                result.rollback_uri = rollback.evidence.get("target_uri")
                result.refused_checkpoints = list(rollback.evidence.get("refused_checkpoints", []))
            if (rollback is not None and rollback.guard.value == "allowed" and result.rollback_uri
                    and result.halted_at_step is not None
                    and result.culprit_rank is not None and 0 <= result.culprit_rank < world):
                # act on the recommendation: the culprit's node is quarantined, a spare takes its rank
                new = list(placement)
                new[result.culprit_rank] = result.replaced_with = nodes[world]
                # the valid checkpoints up to the target seed the resumed job's norm band
                valid = sorted((e.step, str(e.data.get("uri"))) for e in store.events(kind="checkpoint_validated",
                                                                                       job=JOB)
                               if e.data.get("result") == "valid" and e.step is not None
                               and e.step <= result.rollback_step)
                launcher.order("resume", result.rollback_uri, tuple(new), tuple(u for _, u in valid))
                resumed = launcher.wait_phase("resume", deadline)
                result.steps_retrained = steps - min(r.first_step for r in resumed.values())
                launcher.quiesce(deadline)
                result.sdc_findings_after_rollback = len(store.findings(kind="sdc", job=JOB)) - len(findings)
                mark("resume")
                final = work / "weights" / "resume-final.npz"
        result.final_bitwise_equal_to_clean = _equal(work / "weights" / "clean-final.npz", final)
        for f in store.findings(job=JOB):
            result.findings_by_kind[f.kind.value] = result.findings_by_kind.get(f.kind.value, 0) + 1
        exits = store.events(kind="job_exit", job=JOB)
        result.job_exits = [str(e.data.get("status")) for e in sorted(exits, key=lambda e: e.ts)]
        for e in store.events(kind="checkpoint_validated", job=JOB):
            got = str(e.data.get("result"))
            result.validations[got] = result.validations.get(got, 0) + 1
        result.events_stored = len(store.events(job=JOB))
        result.events_dropped = launcher.dropped
        result.checkpoints_written = len(list(ckpt.glob("ckpt-*.json")))
        mark("compare")
    mark("shutdown")
    result.wall_s = time.perf_counter() - started
    return result


def summary(result: InjobResult, *, as_json: bool = False) -> str:
    """One JSON object, or a few lines a person reads."""
    if as_json:
        import orjson

        return orjson.dumps(result.to_obj()).decode()
    r = result
    lines = [f"in-job demo, fault {r.fault}: {r.world} CPU ranks (gloo), {r.steps} steps, "
             f"{r.checkpoints_written} checkpoints, {r.events_stored} events in the store, {r.wall_s:.1f} s"]
    if r.fault != "none":
        lines.append(f"  injected   step {r.injected_at_step} on rank {r.injected_rank}")
    if r.sdc_findings:
        lines.append(f"  detected   step {r.detected_at_step} by {r.detected_by}: {r.classification}, culprit rank "
                     f"{r.culprit_rank} on {r.culprit_node}" + (" (quarantined)" if r.quarantined else ""))
        lines.append(f"  rollback   to checkpoint step {r.rollback_step} [{r.rollback_guard}]"
                     + ("" if r.in_job_rollback is None else
                        f"; the job rolled back by itself at step {r.in_job_rollback[0]} to step "
                        f"{r.in_job_rollback[1]}")
                     + ("" if r.replaced_with is None else
                        f"; rank {r.culprit_rank} moved to {r.replaced_with}, {r.steps_retrained} steps retrained"))
        for step, why in r.refused_checkpoints:
            lines.append(f"  refused    checkpoint step {step}: {why}")
    else:
        lines.append("  detected   nothing (no sdc finding)")
    lines.append(f"  final weights bitwise equal to the clean run: {str(r.final_bitwise_equal_to_clean).lower()}")
    lines.append(f"  {'PASS' if r.ok else 'FAIL'}")
    return "\n".join(lines)


def run_injob_main(fault: str, *, world: int = 4, ckpt_dir: str | None = None, as_json: bool = False,
                   corrupt_step: int | None = None) -> int:
    """The command's body: run, print, exit 0 only when :attr:`InjobResult.ok`."""
    result = run_injob_demo(fault, world=world, ckpt_dir=None if ckpt_dir is None else Path(ckpt_dir),
                            corrupt_step=corrupt_step)
    print(summary(result, as_json=as_json))
    return 0 if result.ok else 1
