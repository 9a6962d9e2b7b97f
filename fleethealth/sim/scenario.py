"""Fault scenarios: the YAML/JSON contract of docs/architecture.md, validated field by field.

A scenario names a fleet (racks × nodes × GPUs), one synchronous job across all of it (``job``)
or several jobs on parts of it (``jobs``: the nodes in no job stand idle), the faults to inject and
the in-job check cadence. Anything unknown — a fault kind, a field, a node that is not in the fleet
— is a :class:`ConfigError` naming it, never silently ignored.

With ``jobs``, a fault on a job's node belongs to that job (it may say so with ``job``) and counts
its steps in that job's steps; a fault on an idle node (:data:`IDLE_FAULTS` only) counts them in
the idle nodes' telemetry ticks (every :attr:`Scenario.idle_interval_s`, :attr:`Scenario.idle_ticks`
of them).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from fleethealth.errors import ConfigError
from fleethealth.sim.gpus import DEFAULT_GPU_MODEL, GPU_MODELS

__all__ = ["FleetSpec", "JobSpec", "PlacedJob", "ChecksSpec", "FaultSpec", "Scenario", "FAULT_FIELDS",
           "DEFAULT_START_TS", "IDLE_FAULTS"]

DEFAULT_START_TS = 1_767_225_600.0
"""2026-01-01T00:00:00Z: scenarios run in event time from here unless they set ``start_ts``."""

# kind -> (required fields, optional fields with defaults)
FAULT_FIELDS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "thermal_straggler": (("node", "gpu", "start_step"), {"slowdown": 0.20, "end_step": None}),
    "hot_aisle": (("rack", "start_step"), {"temp_rise_c": 15.0, "slowdown": 0.10, "end_step": None}),
    "nvlink_degraded": (("node", "start_step"), {"gpu": None, "slowdown": 0.15, "end_step": None}),
    "nic_contention": (("node", "start_step"), {"slowdown": 0.10, "end_step": None}),
    "ecc_precursor": (("node", "gpu", "start_step", "fail_step"), {}),
    # diverge_step: when the loss would diverge with no detection (the closed loop's "no detection" run)
    "sdc_transient": (("node", "gpu", "start_step"), {"diverge_step": None}),
    "sdc_deterministic": (("node", "gpu", "start_step"), {"diverge_step": None}),
    "hang": (("node", "step"), {"gpu": None, "duration_s": 120.0, "restart_s": 600.0}),
    "xid": (("node", "gpu", "step", "code"), {}),
}

IDLE_FAULTS = frozenset({"ecc_precursor", "xid"})
"""The fault kinds an idle node (in no job of a ``jobs`` scenario) can have: they need no job steps."""

_INT_FIELDS = {"gpu", "start_step", "end_step", "fail_step", "step", "code", "diverge_step"}
_FLOAT_FIELDS = {"slowdown", "temp_rise_c", "duration_s", "restart_s"}


def _section(obj: dict[str, Any], name: str, known: dict[str, type], defaults: dict[str, Any]) -> dict[str, Any]:
    raw = obj.get(name, {})
    if not isinstance(raw, dict):
        raise ConfigError(f"scenario: '{name}' must be a mapping, got {type(raw).__name__}")
    unknown = set(raw) - set(known)
    if unknown:
        raise ConfigError(f"scenario: unknown field '{name}.{sorted(unknown)[0]}' (known: {', '.join(known)})")
    out = dict(defaults)
    for key, value in raw.items():
        out[key] = _typed(f"{name}.{key}", value, known[key])
    missing = [k for k in known if k not in out]
    if missing:
        raise ConfigError(f"scenario: missing field '{name}.{missing[0]}'")
    return out


def _typed(where: str, value: Any, kind: type) -> Any:
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"scenario: '{where}' must be an integer, got {value!r}")
        if value < 0:
            raise ConfigError(f"scenario: '{where}' must be >= 0, got {value}")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise ConfigError(f"scenario: '{where}' must be a finite non-negative number, got {value!r}")
        return float(value)
    if not isinstance(value, str) or not value:
        raise ConfigError(f"scenario: '{where}' must be a non-empty string, got {value!r}")
    return value


@dataclass(frozen=True)
class FleetSpec:
    racks: int = 4
    nodes_per_rack: int = 8
    gpus_per_node: int = 8
    gpu_model: str = DEFAULT_GPU_MODEL
    """A key of :data:`fleethealth.sim.gpus.GPU_MODELS`: what the GPUs report (Hopper: no retired pages)."""

    @property
    def nodes(self) -> int:
        return self.racks * self.nodes_per_rack

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_name(self, index: int) -> str:
        return f"n{index:04d}"

    def rack_name(self, index: int) -> str:
        return f"r{index:02d}"


@dataclass(frozen=True)
class JobSpec:
    id: str = "train-1"
    steps: int = 600
    step_time_s: float = 2.0
    jitter: float = 0.02

    def node_indices(self, fleet: FleetSpec) -> tuple[int, ...]:
        """Fleet node indices the job runs on, in rank order: the whole fleet."""
        return tuple(range(fleet.nodes))


@dataclass(frozen=True)
class PlacedJob(JobSpec):
    """One job of a ``jobs`` scenario: a :class:`JobSpec` on some of the fleet's nodes."""

    nodes: tuple[int, ...] = ()

    def node_indices(self, fleet: FleetSpec) -> tuple[int, ...]:
        return self.nodes


@dataclass(frozen=True)
class ChecksSpec:
    """In-job check cadence, scaled down from production's 100 / 10,000 so short runs exercise it."""

    selfcheck_every: int = 50
    replay_every: int = 200
    checkpoint_every: int = 25
    checkpoint_blocking_s: float = 0.5
    """Seconds each save holds training up (seed 000: the ~0.5 s copy to pinned host memory), as the
    ``checkpoint_cost`` record reports it; the simulated step times do not include it."""
    checkpoint_write_s: float = 5.0
    """Seconds each save's background write takes (seed 000: ~5 s at 200 GB/s aggregate)."""


@dataclass(frozen=True)
class FaultSpec:
    """One injected fault: ``kind`` and its validated fields (see :data:`FAULT_FIELDS`)."""

    kind: str
    params: dict[str, Any] = field(default_factory=dict)
    job: str | None = None
    """The job the fault belongs to: named in the file, or (``jobs``) the job on its node; None on
    an idle node and, unless the file names it, in a one-job scenario."""

    def __getitem__(self, name: str) -> Any:
        return self.params[name]


@dataclass(frozen=True)
class Scenario:
    seed: int = 7
    fleet: FleetSpec = FleetSpec()
    job: JobSpec = JobSpec()
    faults: tuple[FaultSpec, ...] = ()
    checks: ChecksSpec = ChecksSpec()
    start_ts: float = DEFAULT_START_TS
    name: str = "scenario"
    jobs: tuple[PlacedJob, ...] = ()
    """The ``jobs`` form: several jobs on parts of the fleet (``job`` is then the first of them)."""

    @property
    def job_specs(self) -> tuple[JobSpec, ...]:
        """Every job of the scenario: ``jobs``, or the one ``job``."""
        return self.jobs or (self.job,)

    def job_of(self, name: str) -> JobSpec:
        return next(j for j in self.job_specs if j.id == name)

    @property
    def idle_nodes(self) -> tuple[int, ...]:
        """Fleet node indices in no job (only a ``jobs`` scenario has any)."""
        busy = {n for j in self.job_specs for n in j.node_indices(self.fleet)}
        return tuple(n for n in range(self.fleet.nodes) if n not in busy)

    @property
    def idle_interval_s(self) -> float:
        """Idle nodes report telemetry this often: the shortest job step."""
        return min(j.step_time_s for j in self.job_specs)

    @property
    def idle_ticks(self) -> int:
        """How many telemetry ticks the idle nodes report: the longest job's nominal length."""
        return max(1, math.ceil(max(j.steps * j.step_time_s for j in self.job_specs) / self.idle_interval_s))

    # ------------------------------------------------------------ loading
    @classmethod
    def load(cls, path: str | Path) -> Scenario:
        """Read a YAML or JSON scenario file; raise :class:`ConfigError` on anything wrong."""
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"scenario {path}: cannot read ({exc.strerror})") from None
        try:
            obj = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except (yaml.YAMLError, json.JSONDecodeError) as exc:
            first = str(exc).strip().splitlines()[0]
            fmt = "JSON" if path.suffix == ".json" else "YAML"
            raise ConfigError(f"scenario {path}: not valid {fmt} ({first})") from None
        try:
            return cls.from_obj(obj, name=path.stem)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None

    @classmethod
    def default(cls) -> Scenario:
        """The scenario shipped with the package (``fleethealth/scenarios/default.yaml``)."""
        with resources.as_file(resources.files("fleethealth.scenarios") / "default.yaml") as path:
            return cls.load(path)

    @classmethod
    def from_obj(cls, obj: Any, *, name: str = "scenario") -> Scenario:
        if not isinstance(obj, dict):
            raise ConfigError(f"scenario: expected a mapping at the top level, got {type(obj).__name__}")
        known_top = {"seed", "fleet", "job", "jobs", "faults", "checks", "start_ts", "name"}
        unknown = set(obj) - known_top
        if unknown:
            raise ConfigError(f"scenario: unknown field '{sorted(unknown)[0]}' (known: {', '.join(sorted(known_top))})")
        seed = _typed("seed", obj.get("seed", 7), int)
        fleet = FleetSpec(**_section(obj, "fleet", {"racks": int, "nodes_per_rack": int, "gpus_per_node": int,
                                                    "gpu_model": str}, vars(FleetSpec())))
        if min(fleet.racks, fleet.nodes_per_rack, fleet.gpus_per_node) < 1:
            raise ConfigError("scenario: fleet sizes must all be >= 1")
        if fleet.gpu_model not in GPU_MODELS:
            raise ConfigError(f"scenario: fleet.gpu_model {fleet.gpu_model!r} is not one of {', '.join(GPU_MODELS)}")
        if "jobs" in obj and "job" in obj:
            raise ConfigError("scenario: give either 'job' (one job across the fleet) or 'jobs', not both")
        jobs = _jobs(obj["jobs"], fleet) if "jobs" in obj else ()
        job = jobs[0] if jobs else JobSpec(**_section(
            obj, "job", {"id": str, "steps": int, "step_time_s": float, "jitter": float}, vars(JobSpec())))
        if job.steps < 1 or job.step_time_s <= 0:
            raise ConfigError("scenario: job.steps must be >= 1 and job.step_time_s > 0")
        checks = ChecksSpec(**_section(obj, "checks", {"selfcheck_every": int, "replay_every": int,
                                                       "checkpoint_every": int, "checkpoint_blocking_s": float,
                                                       "checkpoint_write_s": float}, vars(ChecksSpec())))
        if min(checks.selfcheck_every, checks.replay_every, checks.checkpoint_every) < 1:
            raise ConfigError("scenario: checks intervals must be >= 1")
        if not (0 <= checks.checkpoint_blocking_s <= 3600 and 0 <= checks.checkpoint_write_s <= 86400):
            raise ConfigError("scenario: checks.checkpoint_blocking_s must be in [0, 3600] and "
                              "checks.checkpoint_write_s in [0, 86400] seconds")
        raw_faults = obj.get("faults") or []
        if not isinstance(raw_faults, list):
            raise ConfigError("scenario: 'faults' must be a list")
        shape = cls(fleet=fleet, job=job, jobs=jobs)
        faults = tuple(_fault(i, f, shape, checks) for i, f in enumerate(raw_faults))
        start = _typed("start_ts", obj.get("start_ts", DEFAULT_START_TS), float)
        return cls(seed=seed, fleet=fleet, job=job, faults=faults, checks=checks, start_ts=start,
                   name=str(obj.get("name", name)), jobs=jobs)


_JOB_FIELDS = {"id": str, "steps": int, "step_time_s": float, "jitter": float, "nodes": object,
               "node_count": int}


def _jobs(raw: Any, fleet: FleetSpec) -> tuple[PlacedJob, ...]:
    """The ``jobs`` list: each job's ``nodes`` (a list of names or ``"n0000..n0015"``) or
    ``node_count`` (the next free nodes in fleet order after the previous job's)."""
    if not isinstance(raw, list) or not raw:
        raise ConfigError("scenario: 'jobs' must be a non-empty list")
    names = {fleet.node_name(i): i for i in range(fleet.nodes)}
    taken: dict[int, str] = {}
    jobs: list[PlacedJob] = []
    cursor = 0
    for index, item in enumerate(raw):
        where = f"jobs[{index}]"
        if not isinstance(item, dict):
            raise ConfigError(f"scenario: {where} must be a mapping")
        unknown = set(item) - set(_JOB_FIELDS)
        if unknown:
            raise ConfigError(f"scenario: {where}: unknown field '{sorted(unknown)[0]}' "
                              f"(known: {', '.join(_JOB_FIELDS)})")
        if "id" not in item:
            raise ConfigError(f"scenario: {where}: missing field 'id'")
        if ("nodes" in item) == ("node_count" in item):
            raise ConfigError(f"scenario: {where}: give exactly one of 'nodes' and 'node_count'")
        spec = {k: _typed(f"{where}.{k}", v, _JOB_FIELDS[k]) for k, v in item.items() if k not in ("nodes",)}
        if "nodes" in item:
            nodes = _node_list(f"{where}.nodes", item["nodes"], names)
        else:
            count = spec.pop("node_count")
            nodes = tuple(range(cursor, cursor + count))
            if count < 1 or nodes[-1] >= fleet.nodes:
                raise ConfigError(f"scenario: {where}: node_count {count} from node {fleet.node_name(cursor)} "
                                  f"does not fit the fleet of {fleet.nodes} nodes")
        for n in nodes:
            if n in taken:
                raise ConfigError(f"scenario: {where}: node {fleet.node_name(n)} is already in job {taken[n]!r}")
            taken[n] = spec["id"]
        if spec["id"] in {j.id for j in jobs}:
            raise ConfigError(f"scenario: {where}: job id {spec['id']!r} is used twice")
        job = PlacedJob(**{**vars(JobSpec()), **spec, "nodes": nodes})
        if job.steps < 1 or job.step_time_s <= 0:
            raise ConfigError(f"scenario: {where}: steps must be >= 1 and step_time_s > 0")
        jobs.append(job)
        cursor = max(nodes) + 1
    return tuple(jobs)


def _node_list(where: str, raw: Any, names: dict[str, int]) -> tuple[int, ...]:
    if isinstance(raw, str) and ".." in raw:
        first, _, last = raw.partition("..")
        if first not in names or last not in names or names[first] > names[last]:
            raise ConfigError(f"scenario: '{where}': {raw!r} is not a range of fleet nodes "
                              f"(n0000..n{len(names) - 1:04d})")
        return tuple(range(names[first], names[last] + 1))
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"scenario: '{where}' must be a non-empty list of nodes or a range 'nAAAA..nBBBB'")
    out = []
    for node in raw:
        if node not in names:
            raise ConfigError(f"scenario: '{where}': node {node!r} is not in the fleet")
        out.append(names[node])
    if len(set(out)) != len(out):
        raise ConfigError(f"scenario: '{where}' names a node twice")
    return tuple(out)


def _fault(index: int, raw: Any, shape: Scenario, checks: ChecksSpec) -> FaultSpec:
    fleet = shape.fleet
    where = f"faults[{index}]"
    if not isinstance(raw, dict):
        raise ConfigError(f"scenario: {where} must be a mapping")
    kind = raw.get("kind")
    if kind not in FAULT_FIELDS:
        raise ConfigError(f"scenario: {where}: unknown fault kind {kind!r} (known: {', '.join(FAULT_FIELDS)})")
    required, optional = FAULT_FIELDS[kind]
    where = f"{where} ({kind})"
    unknown = set(raw) - {"kind", "job"} - set(required) - set(optional)
    if unknown:
        known = ", ".join((*required, *optional))
        raise ConfigError(f"scenario: {where}: unknown field '{sorted(unknown)[0]}' (known: {known})")
    missing = [k for k in required if k not in raw]
    if missing:
        raise ConfigError(f"scenario: {where}: missing field '{missing[0]}'")
    params = dict(optional)
    for key, value in raw.items():
        if key in ("kind", "job") or (value is None and key in optional):
            continue
        kind_of = int if key in _INT_FIELDS else float if key in _FLOAT_FIELDS else str
        params[key] = _typed(f"{where}.{key}", value, kind_of)
    node = params.get("node")
    if node is not None and node not in {fleet.node_name(i) for i in range(fleet.nodes)}:
        last = fleet.node_name(fleet.nodes - 1)
        raise ConfigError(f"scenario: {where}: node {node!r} is not in the fleet (n0000..{last})")
    rack = params.get("rack")
    if rack is not None and rack not in {fleet.rack_name(i) for i in range(fleet.racks)}:
        last = fleet.rack_name(fleet.racks - 1)
        raise ConfigError(f"scenario: {where}: rack {rack!r} is not in the fleet (r00..{last})")
    named = _typed(f"{where}.job", raw["job"], str) if "job" in raw else None
    job, steps, unit = _owner(where, kind, params, named, shape)
    gpu = params.get("gpu")
    if gpu is not None and gpu >= fleet.gpus_per_node:
        raise ConfigError(f"scenario: {where}: gpu {gpu} out of range (0..{fleet.gpus_per_node - 1})")
    diverge = params.get("diverge_step")
    if diverge is not None and not params["start_step"] < diverge:
        raise ConfigError(f"scenario: {where}: diverge_step must come after start_step")
    for key in ("start_step", "step", "fail_step", "diverge_step"):
        value = params.get(key)
        if value is not None and value >= steps:
            raise ConfigError(f"scenario: {where}: {key} {value} is past the {unit} ({steps - 1})")
    end = params.get("end_step")
    if end is not None and not params["start_step"] < end <= steps:
        raise ConfigError(f"scenario: {where}: end_step (exclusive) must be after start_step and at most "
                          f"{steps}, got {end}")
    if kind == "ecc_precursor" and params["fail_step"] <= params["start_step"]:
        raise ConfigError(f"scenario: {where}: fail_step must come after start_step")
    if kind in ("sdc_transient", "sdc_deterministic"):
        every = checks.selfcheck_every if kind == "sdc_transient" else checks.replay_every
        first = max(every, -(-params["start_step"] // every) * every)
        if first >= steps:
            what = "self-check" if kind == "sdc_transient" else "replay"
            raise ConfigError(f"scenario: {where}: no {what} runs at or after start_step {params['start_step']} "
                              f"(every {every} steps, job of {steps}): the fault could never be seen")
    return FaultSpec(kind=kind, params=params, job=job)


def _owner(where: str, kind: str, params: dict[str, Any], named: str | None,
           shape: Scenario) -> tuple[str | None, int, str]:
    """``(the fault's job, the steps its step fields count in, what they are)``."""
    if not shape.jobs:
        if named is not None and named != shape.job.id:
            raise ConfigError(f"scenario: {where}: job {named!r} is not the scenario's job {shape.job.id!r}")
        return named, shape.job.steps, "job's last step"
    node = params.get("node")
    if node is None:
        raise ConfigError(f"scenario: {where}: a {kind} fault spans jobs (a rack) and a scenario with 'jobs' "
                          f"cannot place it yet; use one 'job'")
    index = int(node[1:])
    owner = next((j for j in shape.jobs if index in j.nodes), None)
    if owner is None:
        if named is not None:
            raise ConfigError(f"scenario: {where}: node {node} is idle (in no job), not in job {named!r}")
        if kind not in IDLE_FAULTS:
            raise ConfigError(f"scenario: {where}: node {node} is idle (in no job): a {kind} fault needs a job; "
                              f"an idle node can have {', '.join(sorted(IDLE_FAULTS))}")
        return None, shape.idle_ticks, "idle nodes' last telemetry tick"
    if named is not None and named != owner.id:
        raise ConfigError(f"scenario: {where}: node {node} runs job {owner.id!r}, not {named!r}")
    return owner.id, owner.steps, f"last step of job {owner.id!r}"
