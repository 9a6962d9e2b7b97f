"""The one rule for this machine's node name: what the probe, the self-test, the sweep and the
Slurm health check put in the ``node`` field of every record.

A name given explicitly wins (``--node``, ``node.name`` in the config, ``$FLEETHEALTH_NODE``);
otherwise the host's name, either the short one (``gpu-017`` of ``gpu-017.cluster.example``,
the default: what Slurm's ``NodeName``, Kubernetes' node name and ``scontrol`` use on most
clusters) or the fully qualified one (``naming = "fqdn"``, for sites whose schedulers name nodes
by FQDN). The probe and the self-test of one node must agree, or the detectors see two nodes.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from fleethealth.errors import ConfigError

__all__ = ["NAMINGS", "DEFAULT_NAMING", "node_name", "UNKNOWN_RACK", "known_rack", "rack_from_topology"]

NAMINGS = ("short", "fqdn")
"""The two rules: the host name up to its first dot, or the fully qualified domain name."""
DEFAULT_NAMING = "short"
UNKNOWN_RACK = "unknown"
"""What a probe reports as its rack when none is configured (``node.rack``, ``$FLEETHEALTH_RACK``)."""


def known_rack(rack: object) -> str | None:
    """A node's rack as the node (or a topology file) reported it, or None when unknown: no value,
    an empty one or :data:`UNKNOWN_RACK`. A rack is never derived from a node's name."""
    if not isinstance(rack, str) or not rack or rack == UNKNOWN_RACK:
        return None
    return rack


def node_name(name: str | None = None, *, naming: str | None = None) -> str:
    """``name`` if given (non-empty), else ``$FLEETHEALTH_NODE``, else this host's name under
    ``naming`` (``short`` or ``fqdn``; default ``$FLEETHEALTH_NODE_NAMING``, else ``short``)."""
    if name:
        return name
    env = os.environ.get("FLEETHEALTH_NODE")
    if env:
        return env
    naming = naming or os.environ.get("FLEETHEALTH_NODE_NAMING") or DEFAULT_NAMING
    if naming not in NAMINGS:
        raise ConfigError(f"unknown node naming {naming!r} (known: {', '.join(NAMINGS)})")
    if naming == "fqdn":
        return socket.getfqdn() or socket.gethostname()
    return socket.gethostname().split(".")[0]


def rack_from_topology(path: str, node: str) -> str:
    """``node``'s rack in a fleet topology file, :data:`UNKNOWN_RACK` when the file does not list it.

    The file has one node a line, its name and its rack separated by white space (``gpu-017 row2-rack07``);
    ``#`` starts a comment. A line with other than two fields, or a node listed twice with different
    racks, is a :class:`~fleethealth.errors.ConfigError` naming the file and the line.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"topology file {path}: {exc.strerror or exc}") from exc
    found: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) != 2:
            raise ConfigError(f"topology file {path} line {number}: expected 'NODE RACK', got {line.strip()!r}")
        name, rack = fields
        if name == node:
            if found is not None and found != rack:
                raise ConfigError(f"topology file {path} line {number}: {node} listed in racks {found} and {rack}")
            found = rack
    return found if found is not None else UNKNOWN_RACK
