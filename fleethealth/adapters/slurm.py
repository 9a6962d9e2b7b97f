"""Slurm adapter: drain and resume nodes with ``scontrol``, as argument lists, never a shell string.

``evict``, ``drain`` and ``quarantine`` all become one drain::

    scontrol update NodeName=n0013 State=DRAIN Reason=fleethealth evict: thermal straggler ...

Slurm lets running jobs finish on a draining node and schedules nothing new on it, which is
what each of the three asks for (the job restarts without the node at its next checkpoint).
The other actions (``alert_facilities``, ``page``, ``rollback``) are not scheduler operations.

Before draining, the adapter checks with ``sinfo`` that Slurm knows the node by exactly that
name: ``slurmctld`` of a single-node cluster resolves *any* unknown name to its one node, so a
typo would otherwise drain the wrong machine. Tools are found on ``PATH`` (or given); the
cluster is chosen by the usual ``SLURM_CONF`` environment variable.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence

from fleethealth.adapters.base import SchedulerError, UnknownNode, check_node_name, clean_reason
from fleethealth.schema import Action, Recommendation

__all__ = ["SlurmAdapter", "drain_argv", "resume_argv"]

_DRAIN_ACTIONS = frozenset({Action.EVICT, Action.DRAIN, Action.QUARANTINE})


def drain_argv(node: str, reason: str, *, scontrol: str = "scontrol") -> list[str]:
    """The ``scontrol`` argument list that drains ``node`` with ``reason`` (validated, cleaned)."""
    return [scontrol, "update", f"NodeName={check_node_name(node)}", "State=DRAIN",
            f"Reason={clean_reason(reason)}"]


def resume_argv(node: str, *, scontrol: str = "scontrol") -> list[str]:
    """The ``scontrol`` argument list that returns a drained ``node`` to service."""
    return [scontrol, "update", f"NodeName={check_node_name(node)}", "State=RESUME"]


def _shown(argv: Sequence[str]) -> str:
    return " ".join(os.path.basename(argv[0]) if k == 0 else a for k, a in enumerate(argv))


class SlurmAdapter:
    """Drain (and resume) Slurm nodes through ``scontrol``.

    Parameters
    ----------
    scontrol, sinfo:
        Paths of the tools; default: found on ``PATH`` when first needed.
    env:
        Environment for the tools (e.g. with ``SLURM_CONF``); default: this process's.
    timeout_s:
        Seconds one tool call may take before it is treated as a failure.
    """

    name = "slurm"

    def __init__(self, *, scontrol: str | None = None, sinfo: str | None = None,
                 env: Mapping[str, str] | None = None, timeout_s: float = 15.0) -> None:
        self.scontrol = scontrol
        self.sinfo = sinfo
        self.env = env
        self.timeout_s = timeout_s

    # ------------------------------------------------------------ contract
    def supports(self, action: Action) -> bool:
        return action in _DRAIN_ACTIONS

    def plan(self, rec: Recommendation) -> tuple[str, ...]:
        return (_shown(drain_argv(rec.node, self._reason(rec), scontrol=self._tool("scontrol", dry=True))),)

    def apply(self, rec: Recommendation) -> tuple[str, ...]:
        if not self.supports(rec.action):
            raise SchedulerError(f"slurm has no operation for action {rec.action.value!r}")
        return (self.drain(rec.node, self._reason(rec)),)

    # ------------------------------------------------------------ operations
    def drain(self, node: str, reason: str) -> str:
        """Drain ``node`` with ``reason``; return the command run. Raises for unknown nodes."""
        argv = drain_argv(node, reason, scontrol=self._tool("scontrol"))
        self._require_node(node)
        self._run(argv)
        return _shown(argv)

    def resume(self, node: str) -> str | None:
        """Return a drained ``node`` to service; return the command run, ``None`` if not drained.

        Slurm refuses ``State=RESUME`` for a node that is not drained or down, so resuming a
        node in service is a no-op rather than an error.
        """
        argv = resume_argv(node, scontrol=self._tool("scontrol"))
        state = self.state(node)
        if not any(word in state for word in ("drain", "down", "fail")):
            return None
        self._run(argv)
        return _shown(argv)

    def state(self, node: str) -> str:
        """Slurm's state of ``node`` (``idle``, ``drained``, ``mixed`` ...; ``*`` = not responding)."""
        self._require_node(node)
        argv = [self._tool("sinfo"), "--noheader", "--Node", f"--nodes={check_node_name(node)}", "--format=%N %T"]
        for line in self._run(argv).splitlines():
            name, _, state = line.strip().partition(" ")
            if name == node:
                return state.strip()
        raise UnknownNode(f"slurm does not know node {node!r}")

    def nodes(self, node: str | None = None) -> list[str]:
        """Node names Slurm knows (only ``node`` itself when given and known)."""
        argv = [self._tool("sinfo"), "--noheader", "--Node", "--format=%N"]
        if node is not None:
            argv.append(f"--nodes={check_node_name(node)}")
        out = self._run(argv)
        return sorted({line.strip() for line in out.splitlines() if line.strip()})

    def drain_reasons(self) -> dict[str, str]:
        """``{node: reason}`` for every drained or down node, as ``sinfo -R`` reports them."""
        out = self._run([self._tool("sinfo"), "--list-reasons", "--noheader", "--Node", "--format=%N|%E"])
        reasons: dict[str, str] = {}
        for line in out.splitlines():
            name, sep, reason = line.partition("|")
            if sep:
                reasons[name.strip()] = reason.strip()
        return reasons

    # ------------------------------------------------------------ helpers
    @staticmethod
    def _reason(rec: Recommendation) -> str:
        return f"fleethealth {rec.action.value} {rec.id}: {rec.reason}"

    def _tool(self, which: str, *, dry: bool = False) -> str:
        given = self.scontrol if which == "scontrol" else self.sinfo
        if given:
            return given
        found = shutil.which(which)
        if found is None:
            if dry:
                return which
            raise SchedulerError(f"{which} not found on PATH; install Slurm's client tools or pass {which}=")
        return found

    def _require_node(self, node: str) -> None:
        if node not in self.nodes(node):
            raise UnknownNode(f"slurm does not know node {node!r} (sinfo lists no node of that name)")

    def _run(self, argv: list[str]) -> str:
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout_s,
                                  env=None if self.env is None else dict(self.env), check=False)
        except subprocess.TimeoutExpired as exc:
            raise SchedulerError(f"{_shown(argv)} did not answer within {self.timeout_s:g} s") from exc
        except OSError as exc:
            raise SchedulerError(f"{_shown(argv)} could not run: {exc}") from exc
        if done.returncode != 0:
            err = (done.stderr or done.stdout).strip().replace("\n", " ")[:300]
            raise SchedulerError(f"{_shown(argv)} failed (exit {done.returncode}): {err}")
        return done.stdout
