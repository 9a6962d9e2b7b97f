"""The bus DSN: ``kafka://host:port[,host:port][?security options]``, and the registry of backends by scheme.

A registry maps a DSN scheme to a backend factory (``kafka://`` today); the factory imports its
client library lazily, and an unknown scheme raises :class:`ConfigError` listing the known ones.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

from fleethealth.bus.kafka_client import _KafkaBackend
from fleethealth.errors import ConfigError


def parse_dsn(dsn: str) -> tuple[str, tuple[str, ...]]:
    """Split ``scheme://host:port[,host:port]`` into the scheme and the ``host:port`` list."""
    if not isinstance(dsn, str) or "://" not in dsn:
        raise ConfigError(f"bus DSN {dsn!r} is not of the form scheme://host:port (known: {known_schemes()})")
    scheme, rest = dsn.split("://", 1)
    hosts = tuple(h.strip() for h in rest.split("?", 1)[0].split("/", 1)[0].split(",") if h.strip())
    if not hosts:
        raise ConfigError(f"bus DSN {dsn!r} names no host:port")
    for host in hosts:
        name, _, port = host.rpartition(":")
        if not name or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"bus DSN {dsn!r}: {host!r} is not host:port")
    return scheme.lower(), hosts


_SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
_SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
_DSN_OPTIONS = ("security_protocol", "sasl_mechanism", "username", "password_file", "ssl_cafile", "ssl_certfile",
                "ssl_keyfile", "ssl_check_hostname")


def dsn_options(dsn: str) -> dict[str, Any]:
    """kafka-python security settings from a DSN's query string (empty for a plain ``kafka://`` DSN).

    ``kafka://host:9093?security_protocol=SASL_SSL&sasl_mechanism=SCRAM-SHA-512&username=node-n0001&
    password_file=/etc/fleethealth/kafka-password&ssl_cafile=/etc/fleethealth/ca.pem`` — one identity per
    node, the password read from a file (never written in the DSN), TLS verified against the CA. Mutual
    TLS takes ``ssl_certfile`` and ``ssl_keyfile`` instead of a password. Unknown options, a SASL
    mechanism without a username, or an unreadable password file are a :class:`ConfigError`.
    """
    import urllib.parse

    query = dsn.split("?", 1)[1] if "?" in dsn else ""
    pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=False)
    given: dict[str, str] = {}
    for name, value in pairs:
        if name not in _DSN_OPTIONS:
            raise ConfigError(f"bus DSN option {name!r} is unknown (known: {', '.join(_DSN_OPTIONS)})")
        given[name] = value
    if not given:
        return {}
    protocol = given.get("security_protocol", "SASL_SSL" if "username" in given else "SSL").upper()
    if protocol not in _SECURITY_PROTOCOLS:
        raise ConfigError(f"security_protocol {protocol!r} is not one of {', '.join(_SECURITY_PROTOCOLS)}")
    out: dict[str, Any] = {"security_protocol": protocol}
    if protocol.startswith("SASL"):
        mechanism = given.get("sasl_mechanism", "SCRAM-SHA-512").upper()
        if mechanism not in _SASL_MECHANISMS:
            raise ConfigError(f"sasl_mechanism {mechanism!r} is not one of {', '.join(_SASL_MECHANISMS)}")
        if not given.get("username") or not given.get("password_file"):
            raise ConfigError(f"security_protocol {protocol} needs username= and password_file= in the bus DSN")
        try:
            password = pathlib.Path(given["password_file"]).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read the bus password_file {given['password_file']}: {exc}") from exc
        out.update(sasl_mechanism=mechanism, sasl_plain_username=given["username"], sasl_plain_password=password)
    for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
        if name in given:
            out[name] = given[name]
    if "ssl_check_hostname" in given:
        out["ssl_check_hostname"] = given["ssl_check_hostname"].lower() not in {"0", "false", "no"}
    return out


_BACKENDS: dict[str, Callable[..., _KafkaBackend]] = {"kafka": _KafkaBackend}


def register_backend(scheme: str, factory: Callable[..., Any]) -> None:
    """Map a DSN scheme to a factory taking the ``host:port`` list and the :func:`dsn_options`."""
    _BACKENDS[scheme.lower()] = factory


def known_schemes() -> str:
    return ", ".join(f"{s}://" for s in sorted(_BACKENDS))


def _backend(dsn: str) -> _KafkaBackend:
    scheme, hosts = parse_dsn(dsn)
    factory = _BACKENDS.get(scheme)
    if factory is None:
        raise ConfigError(f"unknown bus scheme {scheme + '://'!r} in {dsn!r} (known: {known_schemes()})")
    options = dsn_options(dsn)
    return factory(hosts, options) if options else factory(hosts)
