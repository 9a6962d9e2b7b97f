"""Per-node message signatures: a record on the bus is bound to the node that sent it.

Probes share Kafka principals, and the broker does not tell a consumer who produced a record, so
nothing but a signature ties a record's ``node`` to its producer. Each node holds a key of its own,
derived from one fleet secret by HKDF-SHA256 (RFC 5869) with the node's name as ``info``::

    node_key(fleet_secret, "gpu-a17") = HKDF-SHA256(ikm=fleet_secret, salt=SALT, info=b"gpu-a17", 32 bytes)

and signs what it publishes with HMAC-SHA256 over the topic, the record key and the value (the JSON
body, unchanged). The signature and the key id travel as Kafka record headers::

    fh-kid   the signer: the node's name, or ``svc:NAME`` for a service (the detectors' derived
             interruptions, the actor's scheduler actions)
    fh-sig   HMAC-SHA256(key, b"fleethealth-sig-v1\\n" + topic + b"\\n" + len(key) + key + value), 32 bytes

Who holds what: a node holds only its own key (provisioned at bootstrap or by a per-node Secret),
so it can sign only records that name itself; the detectors hold the fleet secret (or a directory
of per-node keys) and verify. A service key is derived with ``info = b"service:" + NAME`` and may
sign only :data:`SERVICE_KINDS` events, whatever node they name.

:class:`Verifier` is the pure check the consumer calls on each decoded record of the topics
probes may write (:data:`SIGNED_TOPICS`); it returns ``None`` to accept, else the reason to
dead-letter. Modes (config key ``signing.mode``):

=========  ========================================================================================
off        nothing is checked (the default, and what a fleet runs before its probes sign)
verify     a signed record is checked: a bad signature, an unknown signer, or a signer that is not
           the node the body names is dead-lettered; an unsigned record is accepted and counted
require    as ``verify``, and an unsigned record is dead-lettered too
=========  ========================================================================================

A record that outlives the bus — the sweep's whole-suite self-test result, which the API's release
route reads back from the store — carries its signature inside its ``data`` as well
(:func:`sign_record`, key :data:`RECORD_SIGNATURE`), over the node, the time in milliseconds, the
kind and the rest of ``data`` in canonical JSON, so whoever holds the keys can verify it where it is
stored (:func:`verify_record`).

Standard library only: this module is a contract (floor 1) that the probe, the sweeps, the bus and
the detectors share.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import struct
from collections.abc import Iterable, Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any

from fleethealth.errors import ConfigError

__all__ = [
    "SigningMode",
    "KID_HEADER",
    "SIG_HEADER",
    "SALT",
    "SIGNED_TOPICS",
    "SERVICE_KINDS",
    "hkdf_sha256",
    "node_key",
    "service_key",
    "signature",
    "Signer",
    "KeyRing",
    "Verifier",
    "read_key_file",
    "load_signer",
    "load_verifier",
    "service_signer",
    "RECORD_SIGNATURE",
    "sign_record",
    "verify_record",
]

KID_HEADER = "fh-kid"
SIG_HEADER = "fh-sig"
SALT = b"fleethealth node key v1"
"""HKDF salt: fixed, so a key can be derived again anywhere the fleet secret is held."""
_DOMAIN = b"fleethealth-sig-v1\n"
_SERVICE_PREFIX = "svc:"
SIGNED_TOPICS = frozenset({"fh.telemetry", "fh.steps", "fh.events"})
"""The topics a probe (or a sweep on a node) may write: the ones whose records are checked."""
SERVICE_KINDS = frozenset({"interruption", "scheduler_action"})
"""Event kinds written by services, not nodes (the detectors' derived interruptions, the actor's
scheduler actions): signed by a service key, which may name any node, and by nothing else."""
_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")
_MIN_SECRET_BYTES = 16


class SigningMode(StrEnum):
    """What the consumer does with signatures: see the module docstring."""

    OFF = "off"
    VERIFY = "verify"
    REQUIRE = "require"


def hkdf_sha256(secret: bytes, info: bytes, *, salt: bytes = SALT, length: int = 32) -> bytes:
    """HKDF-SHA256 (RFC 5869): extract with ``salt``, expand with ``info`` to ``length`` bytes."""
    if length < 1 or length > 255 * 32:
        raise ConfigError(f"HKDF length must be 1..{255 * 32} bytes, got {length}")
    prk = hmac.new(salt, secret, hashlib.sha256).digest()
    out, block = b"", b""
    for i in range(1, -(-length // 32) + 1):
        block = hmac.new(prk, block + info + bytes([i]), hashlib.sha256).digest()
        out += block
    return out[:length]


def _check_secret(secret: bytes) -> bytes:
    if not isinstance(secret, bytes | bytearray) or len(secret) < _MIN_SECRET_BYTES:
        raise ConfigError(f"a signing secret must be at least {_MIN_SECRET_BYTES} bytes")
    return bytes(secret)


def _check_node(node: str) -> str:
    if not isinstance(node, str) or not _NODE_NAME.fullmatch(node):
        raise ConfigError(f"cannot key node name {node!r}: expected a host name")
    return node


def node_key(fleet_secret: bytes, node: str) -> bytes:
    """The 32-byte key of ``node``: HKDF-SHA256 of the fleet secret with ``info`` = the node's name."""
    return hkdf_sha256(_check_secret(fleet_secret), _check_node(node).encode())


def service_key(fleet_secret: bytes, name: str) -> bytes:
    """The 32-byte key of service ``name`` (``info`` = ``service:NAME``); its key id is ``svc:NAME``."""
    return hkdf_sha256(_check_secret(fleet_secret), b"service:" + _check_node(name).encode())


def signature(key: bytes, topic: str, record_key: bytes | None, value: bytes) -> bytes:
    """HMAC-SHA256 over the topic, the record key (length-prefixed; none is length 0xFFFFFFFF) and the value."""
    k = b"" if record_key is None else bytes(record_key)
    klen = struct.pack(">I", 0xFFFFFFFF if record_key is None else len(k))
    return hmac.new(key, _DOMAIN + topic.encode() + b"\n" + klen + k + bytes(value), hashlib.sha256).digest()


def read_key_file(path: str | Path) -> bytes:
    """A key or secret from a file: 64 hex characters or more (whitespace ignored), else the raw bytes."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read signing key file {path}: {exc.strerror or exc}") from exc
    text = raw.strip()
    try:
        if len(text) >= 2 * _MIN_SECRET_BYTES and len(text) % 2 == 0:
            return _check_secret(bytes.fromhex(text.decode("ascii")))
    except (ValueError, UnicodeDecodeError):
        pass
    return _check_secret(raw)


class Signer:
    """Signs records as ``kid`` with ``key``: ``headers(topic, key, value)`` gives the two Kafka headers.

    ``Signer.for_node(fleet_secret, node)`` derives a node's key (tests, bootstrap tools);
    a probe reads its own key from a file (``Signer(node, read_key_file(path))``), never the secret."""

    def __init__(self, kid: str, key: bytes) -> None:
        if not isinstance(kid, str) or not kid:
            raise ConfigError("a signer needs a key id (the node's name, or svc:NAME)")
        self.kid = kid
        self._key = _check_secret(key)
        self.signed_total = 0

    @classmethod
    def for_node(cls, fleet_secret: bytes, node: str) -> Signer:
        return cls(node, node_key(fleet_secret, node))

    @classmethod
    def for_service(cls, fleet_secret: bytes, name: str) -> Signer:
        return cls(_SERVICE_PREFIX + name, service_key(fleet_secret, name))

    def headers(self, topic: str, record_key: bytes | None, value: bytes) -> list[tuple[str, bytes]]:
        self.signed_total += 1
        return [(KID_HEADER, self.kid.encode()), (SIG_HEADER, signature(self._key, topic, record_key, value))]


class KeyRing:
    """The verifying side's keys: derived from the fleet secret on demand, or read from a directory
    holding one file per node (named as the node, the key inside as for :func:`read_key_file`) and
    ``svc:NAME`` keys as files ``svc_NAME``. A signer with no key is unknown (``key`` returns None)."""

    def __init__(self, *, fleet_secret: bytes | None = None, key_dir: str | Path | None = None,
                 keys: Mapping[str, bytes] | None = None) -> None:
        if fleet_secret is None and key_dir is None and not keys:
            raise ConfigError("a key ring needs the fleet secret, a key directory or keys")
        self._secret = None if fleet_secret is None else _check_secret(fleet_secret)
        self._dir = None if key_dir is None else Path(key_dir)
        if self._dir is not None and not self._dir.is_dir():
            raise ConfigError(f"signing key directory {key_dir} is not a directory")
        self._keys: dict[str, bytes] = {k: _check_secret(v) for k, v in (keys or {}).items()}

    def key(self, kid: str) -> bytes | None:
        known = self._keys.get(kid)
        if known is not None:
            return known
        service = kid.startswith(_SERVICE_PREFIX)
        name = kid[len(_SERVICE_PREFIX):] if service else kid
        if not _NODE_NAME.fullmatch(name):
            return None
        key: bytes | None = None
        if self._dir is not None:
            path = self._dir / (f"svc_{name}" if service else name)
            if path.is_file():
                key = read_key_file(path)
        if key is None and self._secret is not None:
            key = service_key(self._secret, name) if service else node_key(self._secret, name)
        if key is not None and len(self._keys) < 200_000:  # bounded: a fleet's nodes and services
            self._keys[kid] = key
        return key


def _header(headers: Iterable[tuple[str, bytes]] | None, name: str) -> bytes | None:
    found = None
    for k, v in headers or ():
        if k == name:
            if found is not None:
                return b""  # a header given twice is not trusted
            found = bytes(v) if v is not None else b""
    return found


class Verifier:
    """The consumer's check of one decoded record (pure; see the module docstring).

    ``check(topic, record_key, value, headers, msg)`` returns None to accept, else the reason to
    dead-letter (it starts with ``signature:``). Counters: ``verified_total`` (a good signature),
    ``unsigned_total`` (accepted without one, mode ``verify``), ``rejected_total``."""

    def __init__(self, mode: SigningMode | str, ring: KeyRing | None = None) -> None:
        try:
            self.mode = SigningMode(mode)
        except ValueError:
            raise ConfigError(f"signing.mode must be one of {', '.join(m.value for m in SigningMode)}, "
                              f"got {mode!r}") from None
        if self.mode is not SigningMode.OFF and ring is None:
            raise ConfigError(f"signing.mode = {self.mode.value} needs signing.fleet_secret_file or signing.key_dir")
        self.ring = ring
        self.verified_total = 0
        self.unsigned_total = 0
        self.rejected_total = 0

    def _reject(self, why: str) -> str:
        self.rejected_total += 1
        return f"signature: {why}"

    def check(self, topic: str, record_key: bytes | None, value: bytes | None,
              headers: Iterable[tuple[str, bytes]] | None, msg: Any) -> str | None:
        if self.mode is SigningMode.OFF or topic not in SIGNED_TOPICS or value is None:
            return None
        kid_raw, sig = _header(headers, KID_HEADER), _header(headers, SIG_HEADER)
        if kid_raw is None and sig is None:
            if self.mode is SigningMode.REQUIRE:
                return self._reject(f"unsigned record on {topic} (signing.mode = require)")
            self.unsigned_total += 1
            return None
        if not kid_raw or not sig:
            return self._reject(f"{KID_HEADER} and {SIG_HEADER} must both be given, once each")
        try:
            kid = kid_raw.decode("ascii")
        except UnicodeDecodeError:
            return self._reject(f"{KID_HEADER} is not ASCII")
        key = self.ring.key(kid) if self.ring is not None else None
        if key is None:
            return self._reject(f"unknown signer {kid!r}")
        if not hmac.compare_digest(signature(key, topic, record_key, value), sig):
            return self._reject(f"bad signature for signer {kid!r}")
        body_node = getattr(msg, "node", None)
        kind = getattr(getattr(msg, "kind", None), "value", None)
        if kid.startswith(_SERVICE_PREFIX):
            if topic != "fh.events" or kind not in SERVICE_KINDS:
                return self._reject(f"service signer {kid!r} may sign only {', '.join(sorted(SERVICE_KINDS))} "
                                    f"events, not {kind or topic}")
        elif body_node != kid:
            return self._reject(f"body names node {body_node!r} but the record is signed by node {kid!r}")
        elif kind in SERVICE_KINDS:
            return self._reject(f"node {kid!r} may not sign a {kind} event (a service's)")
        self.verified_total += 1
        return None


def load_signer(key_file: str | None, kid: str) -> Signer | None:
    """This process's signer from its key file (a probe's node key, a service's key), or None without one."""
    if not key_file:
        return None
    return Signer(kid, read_key_file(key_file))


def load_verifier(mode: str, *, fleet_secret_file: str | None = None, key_dir: str | None = None) -> Verifier | None:
    """The detectors' verifier for ``signing.mode`` (None when ``off``): the fleet secret or a key directory."""
    if mode == SigningMode.OFF.value:
        return None
    ring = None
    if fleet_secret_file or key_dir:
        ring = KeyRing(fleet_secret=read_key_file(fleet_secret_file) if fleet_secret_file else None,
                       key_dir=key_dir or None)
    return Verifier(mode, ring)


def service_signer(fleet_secret_file: str | None, name: str) -> Signer | None:
    """A service's signer derived from the fleet secret (the detectors sign the interruptions they publish)."""
    if not fleet_secret_file:
        return None
    return Signer.for_service(read_key_file(fleet_secret_file), name)


RECORD_SIGNATURE = "signature"
"""The key in an event's ``data`` that holds its embedded signature: ``{"kid": ..., "hmac": hex}``."""
_RECORD_DOMAIN = b"fleethealth-record-v1\n"


def _record_bytes(node: str, ts: float, kind: str, data: Mapping[str, Any]) -> bytes:
    import json

    body = {k: v for k, v in data.items() if k != RECORD_SIGNATURE}
    canonical = json.dumps({"node": node, "ts_ms": int(round(float(ts) * 1000.0)), "kind": kind, "data": body},
                           sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return _RECORD_DOMAIN + canonical.encode()


def sign_record(signer: Signer, node: str, ts: float, kind: str, data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` with its embedded signature by ``signer`` (whose key id must be ``node``)."""
    if signer.kid != node:
        raise ConfigError(f"signer {signer.kid!r} cannot sign a record of node {node!r}")
    mac = hmac.new(signer._key, _record_bytes(node, ts, kind, data), hashlib.sha256).hexdigest()
    return {**{k: v for k, v in data.items() if k != RECORD_SIGNATURE}, RECORD_SIGNATURE: {"kid": node, "hmac": mac}}


def verify_record(ring: KeyRing, node: str, ts: float, kind: str, data: Mapping[str, Any]) -> str | None:
    """None when ``data`` carries a valid signature by ``node`` itself, else why not."""
    sig = data.get(RECORD_SIGNATURE)
    if not isinstance(sig, Mapping) or not isinstance(sig.get("kid"), str) or not isinstance(sig.get("hmac"), str):
        return "the record carries no signature"
    if sig["kid"] != node:
        return f"the record of {node!r} is signed by {sig['kid']!r}"
    key = ring.key(node)
    if key is None:
        return f"no key for node {node!r}"
    try:
        want = hmac.new(key, _record_bytes(node, ts, kind, data), hashlib.sha256).hexdigest()
    except (TypeError, ValueError) as exc:
        return f"the record cannot be put in canonical form: {exc}"
    if not hmac.compare_digest(want, sig["hmac"]):
        return f"bad signature for node {node!r}"
    return None
