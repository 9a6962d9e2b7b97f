"""The idle-node sweep: run the self-test suite across nodes, riskiest first, and act on the results.

For each node, in the order of :mod:`fleethealth.sweeps.plan`: run the suite through a launcher
(:mod:`fleethealth.sweeps.launch`), publish every result to ``fh.events`` as a ``selftest`` event
(when a producer is given), write them to the store's ``events`` table (when a store is given,
after judging each against the fleet median of its device model),
and, for a quarantined node that passed the complete full suite, return it to the pool through
the quarantine book (:mod:`fleethealth.sweeps.release`). Up to ``parallel`` nodes run at once;
all bus and store I/O happens on the calling thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from fleethealth.errors import ConfigError
from fleethealth.kernels.baseline import BaselineBook
from fleethealth.schema import Event, EventKind
from fleethealth.signing import sign_record
from fleethealth.sweeps.launch import LocalLauncher, NodeRun, NodeStatus, SrunLauncher, run_node
from fleethealth.sweeps.plan import NodeRisk, rank_nodes, risk_from_store
from fleethealth.sweeps.release import ReleaseDecision, apply_release, release_decision

if TYPE_CHECKING:
    from fleethealth.store.protocol import StoreLike

__all__ = ["NodeOutcome", "SweepReport", "run_sweep"]

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class NodeOutcome:
    """One node's sweep: why it was swept when it was (``risk``), its run, and the return-to-pool
    decision (``None`` when no store holds a quarantine book) and whether the node was released."""

    risk: NodeRisk
    run: NodeRun
    decision: ReleaseDecision | None = None
    released: bool = False

    def to_obj(self) -> dict[str, Any]:
        return {"node": self.run.node, "status": self.run.status.value, "exit_code": self.run.exit_code,
                "suite": self.run.suite, "tests": len(self.run.results), "failing": list(self.run.failing),
                "error": self.run.error or None, "duration_s": round(self.run.duration_s, 3),
                "quarantined": self.risk.quarantined, "risk": list(self.risk.reasons),
                "released": self.released,
                "release_reason": None if self.decision is None else self.decision.reason}


@dataclass(frozen=True)
class SweepReport:
    """Every node's outcome, in sweep order."""

    outcomes: tuple[NodeOutcome, ...]

    @property
    def exit_code(self) -> int:
        """0 when every node passed, else 1."""
        return 0 if all(o.run.status is NodeStatus.PASS for o in self.outcomes) else 1

    def counts(self) -> dict[str, int]:
        return {s.value: sum(o.run.status is s for o in self.outcomes) for s in NodeStatus}

    def summary(self) -> str:
        counts = self.counts()
        released = [o.run.node for o in self.outcomes if o.released]
        text = f"{len(self.outcomes)} nodes: " + ", ".join(f"{n} {s}" for s, n in counts.items())
        return text + (f"; released {', '.join(released)}" if released else "")


def run_sweep(nodes: Sequence[str] | None, *, launcher: LocalLauncher | SrunLauncher, suite: str = "full",
              device: str = "all", only: Sequence[str] | None = None, store: StoreLike | None = None,
              producer: Any = None, release: bool = True, timeout_s: float = 1800.0, parallel: int = 1,
              progress: Progress | None = None,
              baselines: BaselineBook | None = None, run: Callable[..., Any] | None = None) -> SweepReport:
    """Sweep ``nodes`` (default with a store: its quarantined and at-risk nodes); see the module docstring.

    Every result is judged again against ``baselines`` (default: the fleet medians in the store),
    since a node's own run cannot see the fleet: a correct result too far below the fleet median of
    its device model becomes ``slow``. ``run`` replaces :func:`subprocess.run` for the command.
    """
    if parallel < 1:
        raise ConfigError(f"parallel must be >= 1, got {parallel}")
    if store is not None:
        risks = risk_from_store(store, nodes)
    elif nodes is None:
        raise ConfigError("no nodes to sweep: give node names, or a store to pick quarantined and at-risk nodes")
    else:
        risks = rank_nodes(nodes)
    if not risks:
        raise ConfigError("no nodes to sweep")
    if baselines is None and store is not None:
        baselines = BaselineBook.from_store(store)
    kwargs: dict[str, Any] = {"suite": suite, "device": device, "only": only, "timeout_s": timeout_s}
    if run is not None:
        kwargs["run"] = run
    outcomes: dict[str, NodeOutcome] = {}
    total = len(risks)
    if progress is not None:
        progress(f"sweeping {total} nodes", 0, total)
    with ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="fh-sweep") as pool:
        futures: list[tuple[NodeRisk, Future[NodeRun]]] = [
            (risk, pool.submit(run_node, launcher, risk.node, **kwargs)) for risk in risks]
        for done, (risk, future) in enumerate(futures, start=1):
            node_run = future.result()
            if baselines is not None:
                node_run = replace(node_run, results=tuple(baselines.judge(r) for r in node_run.results))
            outcomes[risk.node] = _record(risk, node_run, store, producer, release,
                                          getattr(launcher, "scheduler", None))
            if progress is not None:
                progress(f"{risk.node}: {node_run.status.value}", done, total)
    if producer is not None:
        producer.flush()
    return SweepReport(tuple(outcomes[r.node] for r in risks))


def _record(risk: NodeRisk, node_run: NodeRun, store: StoreLike | None, producer: Any, release: bool,
            scheduler: Any = None) -> NodeOutcome:
    events = [r.to_event(node_run.node) for r in node_run.results]
    signer = getattr(producer, "signer", None)
    if producer is not None:
        for event in events:
            producer.publish(event)
    decision = None
    released = False
    if store is not None:
        decision = release_decision(node_run, quarantined=risk.quarantined)
        if decision.evidence:  # the whole-suite record too: an operator can release by its event id
            data = dict(decision.evidence)
            if signer is not None and signer.kid == node_run.node:  # the node's own key: verifiable where stored
                data = sign_record(signer, node_run.node, decision.ts, EventKind.SELFTEST.value, data)
            events.append(Event(node=node_run.node, ts=decision.ts, kind=EventKind.SELFTEST,
                                message=decision.reason, data=data))
        if events:
            store.insert_events(events)
        if release and risk.quarantined:
            released = apply_release(store, decision, scheduler)
    return NodeOutcome(risk, node_run, decision, released)
