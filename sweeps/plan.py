"""Which nodes a sweep tests, and in which order: the riskiest first.

A node is riskier when it is quarantined (it is waiting for a full self-test to return to the
pool), then the higher its failure-risk probability, then the more health findings (SDC, Xid,
ECC, thermal, link, hang, straggler) name it; ties go by name so the order is deterministic.
:func:`rank_nodes` is the pure rule; :func:`risk_from_store` reads findings and the quarantine
book from the store and applies it.

Node names reach ``srun -w`` and ``scontrol``: :func:`validate_node` admits only host-name
characters, so a name can never be read as an option or a shell word.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fleethealth.adapters.base import is_node_name
from fleethealth.errors import ConfigError
from fleethealth.schema import Finding, FindingKind

if TYPE_CHECKING:
    from fleethealth.store.protocol import StoreLike

__all__ = ["NodeRisk", "validate_node", "rank_nodes", "risk_from_store", "read_node_list"]

def validate_node(name: str) -> str:
    """Return ``name`` when it is a plain node name, else raise :class:`ConfigError`; the rule is the
    adapters' (:data:`fleethealth.adapters.base.NODE_PATTERN`), so a node a sweep accepts is one the
    scheduler adapters and the API accept too."""
    if not is_node_name(name):
        raise ConfigError(f"invalid node name {name!r} (letters, digits, '.', '_' and '-' only, at most 63, "
                          "beginning and ending with a letter or digit)")
    return name


def read_node_list(text: str) -> list[str]:
    """Node names from text: separated by commas, spaces or new lines; ``#`` starts a comment.
    Duplicates are dropped (first one kept); every name is validated."""
    names: list[str] = []
    for line in text.splitlines():
        line = line.split("#", 1)[0]
        for name in re.split(r"[,\s]+", line.strip()):
            if name and validate_node(name) not in names:
                names.append(name)
    return names


@dataclass(frozen=True)
class NodeRisk:
    """A node's place in the sweep order. ``probability`` is its highest failure-risk probability
    (0 when none); ``findings`` counts the other health findings naming it; ``reasons`` says why in
    words. Lower :attr:`order` sweeps sooner."""

    node: str
    quarantined: bool = False
    probability: float = 0.0
    findings: int = 0
    reasons: tuple[str, ...] = ()

    @property
    def order(self) -> tuple[int, float, int, str]:
        return (0 if self.quarantined else 1, -self.probability, -self.findings, self.node)


def rank_nodes(nodes: Sequence[str], findings: Iterable[Finding] = (),
               quarantined: Iterable[str] = ()) -> list[NodeRisk]:
    """Order ``nodes`` riskiest first (see the module docstring); only ``nodes`` are returned."""
    names = [validate_node(n) for n in nodes]
    held = set(quarantined)
    prob: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    kinds: dict[str, set[str]] = defaultdict(set)
    for f in findings:
        if f.kind is FindingKind.FAILURE_RISK:
            prob[f.node] = max(prob[f.node], float(f.probability or 0.0))
        else:
            count[f.node] += 1
        kinds[f.node].add(f.kind.value)
    risks = []
    for name in dict.fromkeys(names):
        reasons = []
        if name in held:
            reasons.append("quarantined")
        if prob[name] > 0:
            reasons.append(f"failure risk {prob[name]:.2f}")
        if count[name]:
            reasons.append(f"{count[name]} findings ({', '.join(sorted(kinds[name] - {'failure_risk'}))})")
        risks.append(NodeRisk(name, name in held, prob[name], count[name], tuple(reasons)))
    return sorted(risks, key=lambda r: r.order)


def risk_from_store(store: StoreLike, nodes: Sequence[str] | None = None, *,
                    since: float | None = None) -> list[NodeRisk]:
    """Rank ``nodes`` (default: every quarantined node and every node with a finding) from the
    store's findings (since ``since``) and quarantine book."""
    from fleethealth.policy import quarantine

    findings = store.findings(since=since)
    held = [rec.node for rec in quarantine.quarantined(store)]
    if nodes is None:
        nodes = list(dict.fromkeys([*held, *(f.node for f in findings)]))
    return rank_nodes(nodes, findings, held)
