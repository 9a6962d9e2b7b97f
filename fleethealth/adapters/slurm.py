"""Slurm adapter: drain, resume and reserve nodes with ``scontrol``, as argument lists, never a shell string.

``evict``, ``drain`` and ``quarantine`` all become one drain::

    scontrol update NodeName=n0013 State=DRAIN Reason=fleethealth: evict 4f1c...: thermal straggler ...

Slurm lets running jobs finish on a draining node and schedules nothing new on it, which is
what each of the three asks for (the job restarts without the node at its next checkpoint).
The other actions (``alert_facilities``, ``page``, ``rollback``) are not scheduler operations.

Ownership, as LBNL NHC keeps it: every reason fleethealth sets starts with ``fleethealth:``
(:data:`REASON_PREFIX`). A node that is drained, down or failed with any other reason belongs to
someone else (an admin, NHC, slurmctld itself): fleethealth never overwrites that reason and never
resumes that node (:class:`~fleethealth.adapters.base.LeftAlone`); :meth:`SlurmAdapter.resume`
resumes only nodes whose reason is fleethealth's.

Before draining, the adapter reads the node with ``sinfo``: an unknown name is
:class:`~fleethealth.adapters.base.UnknownNode` (``slurmctld`` itself refuses one with "Invalid node
name specified", which is translated the same way). A drained node runs no job steps, not even
fleethealth's: :meth:`SlurmAdapter.reserve` creates a maintenance reservation
(``Flags=MAINT,IGNORE_JOBS``) so the sweep can resume the node inside it and reach it with
``srun --reservation`` while no user job can land there (:mod:`fleethealth.sweeps.launch`).
Tools are found on ``PATH`` (or given); the cluster is chosen by the usual ``SLURM_CONF``
environment variable.
"""

from __future__ import annotations

import getpass
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fleethealth.adapters.base import LeftAlone, SchedulerError, UnknownNode, check_node_name, clean_reason
from fleethealth.schema import Action, Recommendation

__all__ = ["SlurmAdapter", "NodeInfo", "REASON_PREFIX", "drain_argv", "resume_argv", "reservation_name"]

_DRAIN_ACTIONS = frozenset({Action.EVICT, Action.DRAIN, Action.QUARANTINE})
REASON_PREFIX = "fleethealth:"
"""Every drain reason fleethealth sets starts with this; a reason without it is another owner's."""
_HELD = ("drain", "down", "fail")


@dataclass(frozen=True)
class NodeInfo:
    """One node as ``sinfo`` sees it: ``state`` (``idle``, ``drained``, ``maint`` ...; a trailing ``*``
    = not responding) and ``reason`` (``""`` when none)."""

    node: str
    state: str
    reason: str

    @property
    def held(self) -> bool:
        """True when the node is drained, draining, down or failed."""
        return any(word in self.state for word in _HELD)

    @property
    def ours(self) -> bool:
        """True when fleethealth set the node's reason."""
        return self.reason.startswith(REASON_PREFIX)


def reservation_name(node: str) -> str:
    """The maintenance reservation fleethealth uses for ``node``."""
    return f"fleethealth-{check_node_name(node)}"


def drain_argv(node: str, reason: str, *, scontrol: str = "scontrol") -> list[str]:
    """The ``scontrol`` argument list that drains ``node`` with ``reason`` (validated, cleaned, and
    starting with :data:`REASON_PREFIX`)."""
    text = reason if reason.startswith(REASON_PREFIX) else f"{REASON_PREFIX} {reason}"
    return [scontrol, "update", f"NodeName={check_node_name(node)}", "State=DRAIN",
            f"Reason={clean_reason(text)}"]


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
        """Drain ``node`` with ``reason`` (prefixed ``fleethealth:``); return the command run.

        Raises :class:`UnknownNode` for a node Slurm does not know and :class:`LeftAlone` for a node
        another owner already drained, took down or failed (its reason is kept)."""
        argv = drain_argv(node, reason, scontrol=self._tool("scontrol"))
        info = self.info(node)
        if info.held and info.reason and not info.ours:
            raise LeftAlone(f"slurm node {node!r} is {info.state} by another owner (reason {info.reason!r}): "
                            "fleethealth leaves it alone")
        self._run(argv)
        return _shown(argv)

    def resume(self, node: str) -> str | None:
        """Return ``node`` to service if fleethealth drained it; the command run, ``None`` if not held.

        Raises :class:`LeftAlone` when another owner drained it (only they resume it). Slurm refuses
        ``State=RESUME`` for a node in service, so resuming one is a no-op rather than an error.
        """
        argv = resume_argv(node, scontrol=self._tool("scontrol"))
        info = self.info(node)
        if not info.held:
            return None
        if not info.ours:
            raise LeftAlone(f"slurm node {node!r} is {info.state} by another owner (reason {info.reason!r}): "
                            "only they resume it")
        self._run(argv)
        return _shown(argv)

    def reserve(self, node: str, *, minutes: int = 120, user: str | None = None) -> str:
        """Create the maintenance reservation :func:`reservation_name` on ``node`` for ``user``
        (default: this process's user), ``Flags=MAINT,IGNORE_JOBS``, from now for ``minutes``;
        return its name. An existing reservation of that name is deleted first."""
        name = reservation_name(node)
        self.unreserve(node)
        self._run([self._tool("scontrol"), "create", "reservation", f"ReservationName={name}",
                   f"Nodes={check_node_name(node)}", "StartTime=now", f"Duration={int(minutes)}",
                   f"Users={user or getpass.getuser()}", "Flags=MAINT,IGNORE_JOBS"])
        return name

    def unreserve(self, node: str) -> bool:
        """Delete fleethealth's reservation on ``node``; ``False`` when there was none."""
        name = reservation_name(node)
        shown = self._run([self._tool("scontrol"), "show", "reservation", "--oneliner"], check=False)
        if f"ReservationName={name} " not in shown + " ":
            return False
        self._run([self._tool("scontrol"), "delete", f"ReservationName={name}"])
        return True

    def info(self, node: str) -> NodeInfo:
        """``sinfo``'s state and reason of ``node``; :class:`UnknownNode` when Slurm lists no such node."""
        argv = [self._tool("sinfo"), "--noheader", "--Node", f"--nodes={check_node_name(node)}", "--format=%N|%T|%E"]
        for line in self._run(argv).splitlines():
            name, _, rest = line.strip().partition("|")
            state, _, reason = rest.partition("|")
            if name == node:
                reason = reason.strip()
                return NodeInfo(node, state.strip(), "" if reason == "none" else reason)
        raise UnknownNode(f"slurm does not know node {node!r} (sinfo lists no node of that name)")

    def state(self, node: str) -> str:
        """Slurm's state of ``node`` (``idle``, ``drained``, ``mixed`` ...; ``*`` = not responding)."""
        return self.info(node).state

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
        return f"{REASON_PREFIX} {rec.action.value} {rec.id}: {rec.reason}"

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

    def _run(self, argv: list[str], *, check: bool = True) -> str:
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout_s,
                                  env=None if self.env is None else dict(self.env), check=False)
        except subprocess.TimeoutExpired as exc:
            raise SchedulerError(f"{_shown(argv)} did not answer within {self.timeout_s:g} s") from exc
        except OSError as exc:
            raise SchedulerError(f"{_shown(argv)} could not run: {exc}") from exc
        if done.returncode != 0 and check:
            err = (done.stderr or done.stdout).strip().replace("\n", " ")[:300]
            if "Invalid node name specified" in err:
                raise UnknownNode(f"slurm does not know the node: {_shown(argv)} failed: {err}")
            raise SchedulerError(f"{_shown(argv)} failed (exit {done.returncode}): {err}")
        return done.stdout
