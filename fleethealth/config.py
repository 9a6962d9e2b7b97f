"""One configuration for ``detect``, ``serve``, ``act`` and ``probe``: a file, the environment,
then flags, each overriding the one before.

::

    defaults  <  file (--config FILE, else $FLEETHEALTH_CONFIG)  <  environment ($FLEETHEALTH_...)  <  flags

Every setting is a :class:`Key` with a dotted name (``detect.straggler.clip``, ``policy.fleet_nodes``,
``kafka``). In the file, the part before the last dot is a table::

    kafka = "kafka://broker:9092"

    [policy]
    fleet_nodes = 2048            # the circuit breaker's 10 % share needs the fleet's size

    [detect.straggler]
    clip = 5.0

The file is TOML (read with the standard library's ``tomllib``), or YAML when its name ends in
``.yaml`` / ``.yml``. Every key's environment variable is ``FLEETHEALTH_`` and its name in capitals
with dots as underscores (``FLEETHEALTH_DETECT_STRAGGLER_CLIP``, ``FLEETHEALTH_PROBE_DCGM_HOST``); a
few keys also answer to an older short alias (``node.name`` to ``$FLEETHEALTH_NODE``). Flags are the
commands' own plus ``--set KEY=VALUE``. A key the schema does not know, in the file, in ``--set`` or
as a ``FLEETHEALTH_*`` variable (other than :data:`ENV_NOT_KEYS`), is an error that names it and the
keys that are known; so is a value of the wrong type.

This module knows no detector or policy: the commands build the :class:`Schema` from the
parameters of the parts they wire (:func:`keys_from_signature`), so a new detector parameter is
settable without touching this file. :meth:`Settings.render` prints the effective configuration
with where each value came from (``fleethealth config show``); its TOML form is itself a valid file.

**Reloading a running process.** :data:`LIVE_KEYS` names the keys a running ``detect`` or ``serve``
takes from its file again without a restart (thresholds, bands, guard rates and windows the
detectors and the policy read each batch); every other key (DSNs, topics, the stage, listen
addresses, key files, the shapes of detector state) needs a restart. :class:`LiveSettings` holds
the settings in force: :meth:`LiveSettings.request` only sets a flag (safe in a signal handler),
:meth:`LiveSettings.reload` reads the same file with the same environment and flags, validates it
whole (types and unknown keys here, ranges by the ``validate`` the command passes) and keeps the
live changes pending; the process applies them at its next batch boundary
(:meth:`LiveSettings.take`). A changed restart-only key is logged as ignored until restart; an
invalid file is refused whole, the old values stay, and ``fleethealth_config_reload_failures_total``
counts it.
"""

from __future__ import annotations

import difflib
import hashlib
import inspect
import logging
import math
import os
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from fleethealth.errors import ConfigError

__all__ = ["Key", "Schema", "Settings", "keys_from_signature", "read_file", "COMMAND_KEYS", "CONFIG_ENV",
           "DEFAULT_SOURCE", "LIVE_KEYS", "is_live", "LiveSettings", "Reload", "shown_value"]

CONFIG_ENV = "FLEETHEALTH_CONFIG"
"""The environment variable naming the config file when no ``--config`` is given."""

ENV_NOT_KEYS: dict[str, str] = {
    CONFIG_ENV: "the config file when no --config is given",
    "FLEETHEALTH_API_TOKEN": "serve's bearer token for write endpoints (a secret: never a config key)",
    "FLEETHEALTH_READ_TOKEN": "serve's bearer token for reads; `query` and the in-job interval poll send it (a secret)",
    "FLEETHEALTH_JOB": "the training job's id, read by the in-job library",
    "FLEETHEALTH_API": "the API's base URL, read by the in-job library's recommended_checkpoint_interval",
}
"""``FLEETHEALTH_*`` variables that are not configuration keys, and what reads each."""
DEFAULT_SOURCE = "default"

_KINDS = {"bool": bool, "int": int, "float": float, "str": str, "floats": tuple}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class Key:
    """One setting: dotted ``name``, ``kind`` (``bool``, ``int``, ``float``, ``str`` or ``floats``,
    a list of numbers), ``default``, whether None is allowed (``optional``), allowed ``choices``,
    and its environment variable. Every key answers to ``FLEETHEALTH_`` and its name in capitals with
    dots as underscores; ``env`` names an older alias a key also answers to (``node.name`` is also
    ``$FLEETHEALTH_NODE``). Both set at once, with different values, is an error."""

    name: str
    kind: str
    default: Any
    help: str = ""
    optional: bool = False
    choices: tuple[str, ...] = ()
    env: str = ""

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"config key {self.name}: unknown kind {self.kind!r}")
        if not self.env:
            object.__setattr__(self, "env", self.canonical_env)

    @property
    def canonical_env(self) -> str:
        """``FLEETHEALTH_`` and the name in capitals, dots (and anything else) as underscores."""
        return "FLEETHEALTH_" + re.sub(r"[^A-Za-z0-9]", "_", self.name).upper()

    @property
    def envs(self) -> tuple[str, ...]:
        """Every environment variable this key answers to: the canonical name, then its alias."""
        return tuple(dict.fromkeys((self.canonical_env, self.env)))

    @property
    def section(self) -> str:
        return self.name.rpartition(".")[0]

    def coerce(self, value: Any, where: str) -> Any:
        """``value`` (from a file, as parsed) as this key's type; a :class:`ConfigError` naming
        the key and ``where`` it came from otherwise."""
        if value is None and self.optional:
            return None
        ok = True
        if self.kind == "bool":
            ok = isinstance(value, bool)
        elif self.kind == "int":
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif self.kind == "float":
            ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            value = float(value) if ok else value
        elif self.kind == "str":
            ok = isinstance(value, str)
        else:
            ok = isinstance(value, list | tuple) and all(
                isinstance(v, int | float) and not isinstance(v, bool) for v in value)
            value = tuple(float(v) for v in value) if ok else value
        if not ok:
            wanted = {"floats": "a list of numbers", "int": "an integer", "float": "a finite number",
                      "bool": "true or false", "str": "a string"}[self.kind]
            raise ConfigError(f"{self.name} ({where}) must be {wanted}{' or none' if self.optional else ''}, "
                              f"got {value!r}")
        if self.choices and value not in self.choices:
            raise ConfigError(f"{self.name} ({where}) must be one of {', '.join(self.choices)}, got {value!r}")
        return value

    def parse(self, text: str, where: str) -> Any:
        """A value written as text (an environment variable, ``--set``) as this key's type."""
        raw = text.strip()
        if self.optional and raw.lower() in {"", "none", "null"}:
            return None
        value: Any = raw
        try:
            if self.kind == "bool":
                if raw.lower() not in _TRUE | _FALSE:
                    raise ValueError(raw)
                value = raw.lower() in _TRUE
            elif self.kind == "int":
                value = int(raw)
            elif self.kind == "float":
                value = float(raw)
            elif self.kind == "floats":
                value = [float(v) for v in raw.strip("[]()").split(",") if v.strip()]
        except ValueError:
            pass  # coerce names the key and the expected type
        return self.coerce(value, where)


def keys_from_signature(section: str, target: Callable[..., Any], *, skip: Iterable[str] = (),
                        help: str = "") -> list[Key]:
    """One :class:`Key` per keyword parameter of ``target`` (a class or function) whose default is
    a plain value: ``section.<parameter>`` with the parameter's default and annotated type.
    Parameters in ``skip``, and those of other types (objects, callables), are left out."""
    keys = []
    skipped = set(skip)
    for p in inspect.signature(target).parameters.values():
        if p.name in skipped or p.name == "self" or p.default is inspect.Parameter.empty:
            continue
        note = str(p.annotation).replace(" ", "")
        parts = set(note.split("|"))
        optional = "None" in parts
        parts.discard("None")
        kind = {"float": "float", "int": "int", "bool": "bool", "str": "str",
                "tuple[float,...]": "floats"}.get(next(iter(parts), "") if len(parts) == 1 else "")
        if kind is None and len(parts) > 1 and "str" in parts:  # e.g. ``str | Path | Artifact``: a path
            kind = "str"
        if kind is None:
            continue
        default = p.default
        if kind == "floats" and default is not None:
            default = tuple(float(v) for v in default)
        keys.append(Key(f"{section}.{p.name}", kind, default, help=help, optional=optional))
    return keys


class Schema:
    """The keys a command knows, by name."""

    def __init__(self, keys: Iterable[Key]) -> None:
        self.keys: dict[str, Key] = {}
        for key in keys:
            if key.name in self.keys:
                raise ValueError(f"config key {key.name} defined twice")
            self.keys[key.name] = key

    def __contains__(self, name: object) -> bool:
        return name in self.keys

    def key(self, name: str, where: str) -> Key:
        """The key ``name``; an unknown one is a :class:`ConfigError` listing the known ones
        (those of the same table when the table exists, else the tables)."""
        if name in self.keys:
            return self.keys[name]
        section = name.rpartition(".")[0]
        siblings = sorted(k.name for k in self.keys.values() if k.section == section)
        if siblings:
            known = f"known in [{section}]: " + ", ".join(n.rpartition(".")[2] for n in siblings)
        else:
            tables = sorted({k.section for k in self.keys.values() if k.section})
            top = sorted(k.name for k in self.keys.values() if not k.section)
            known = "known: " + ", ".join(top + [f"[{t}]" for t in tables])
        raise ConfigError(f"unknown config key {name!r} ({where}); {known}")

    def check_environ(self, env: Mapping[str, str]) -> None:
        """A :class:`ConfigError` for a ``FLEETHEALTH_*`` variable that is neither a key's nor one
        of :data:`ENV_NOT_KEYS` (a mistyped variable would otherwise be ignored in silence)."""
        known = {var for key in self.keys.values() for var in key.envs} | set(ENV_NOT_KEYS)
        unknown = sorted(var for var in env if var.startswith("FLEETHEALTH_") and var not in known)
        if unknown:
            hints = []
            for var in unknown:
                close = difflib.get_close_matches(var, sorted(known), n=1)
                hints.append(f"{var} (did you mean {close[0]}?)" if close else var)
            raise ConfigError("unknown environment variable" + ("s " if len(unknown) > 1 else " ")
                              + ", ".join(hints) + "; `fleethealth config show` lists every key, and its "
                              "variable is FLEETHEALTH_ and the key in capitals with dots as underscores")

    def load(self, *, file: str | Path | None = None, environ: Mapping[str, str] | None = None,
             flags: Mapping[str, tuple[str, Any]] | None = None, sets: Iterable[str] = ()) -> Settings:
        """The effective settings: defaults, then ``file`` (else ``$FLEETHEALTH_CONFIG``), then the
        environment, then ``flags`` (key name → (the flag, its value typed by argparse; None = not given)),
        then ``sets`` (``KEY=VALUE`` strings, the ``--set`` flag)."""
        env = os.environ if environ is None else environ
        values = {name: key.default for name, key in self.keys.items()}
        sources = dict.fromkeys(self.keys, DEFAULT_SOURCE)
        path = file or env.get(CONFIG_ENV) or None
        if path is not None:
            where = f"file {path}"
            for name, value in _flatten(read_file(path)).items():
                values[name] = self.key(name, where).coerce(value, where)
                sources[name] = where
        self.check_environ(env)
        for name, key in self.keys.items():
            given = [var for var in key.envs if var in env]
            if len(given) > 1 and env[given[0]] != env[given[1]]:
                raise ConfigError(f"{name} is set twice with different values: {given[0]}={env[given[0]]!r} "
                                  f"and {given[1]}={env[given[1]]!r}; keep one")
            if given:
                where = f"env {given[0]}"
                values[name] = key.parse(env[given[0]], where)
                sources[name] = where
        for name, (flag, value) in (flags or {}).items():
            if value is None:
                continue
            where = f"flag {flag}"
            values[name] = self.key(name, where).coerce(value, where)
            sources[name] = where
        for item in sets:
            name, eq, text = item.partition("=")
            if not eq:
                raise ConfigError(f"--set wants KEY=VALUE, got {item!r}")
            key = self.key(name.strip(), "flag --set")
            values[key.name] = key.parse(text, "flag --set")
            sources[key.name] = "flag --set"
        return Settings(self, values, sources, path)


def read_file(path: str | Path) -> dict[str, Any]:
    """A config file's tables: TOML, or YAML for ``*.yaml`` / ``*.yml``."""
    p = Path(path)
    try:
        text = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
    if p.suffix.lower() in {".yaml", ".yml"}:
        import yaml

        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    else:
        import tomllib

        try:
            data = tomllib.loads(text.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold tables of keys, got {type(data).__name__}")
    return data


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, name + "."))
        else:
            out[name] = v
    return out


@dataclass(frozen=True)
class Settings:
    """The effective configuration: ``values`` and ``sources`` by key name (a source is ``default``,
    ``file PATH``, ``env NAME`` or ``flag --NAME``), and the file read (or None)."""

    schema: Schema
    values: dict[str, Any]
    sources: dict[str, str]
    file: str | Path | None = None

    def __getitem__(self, name: str) -> Any:
        return self.values[self.schema.key(name, "lookup").name]

    def section(self, prefix: str, *, changed_only: bool = False) -> dict[str, Any]:
        """The keys directly under ``prefix`` (``detect.hang`` → ``{"window": 512, ...}``); with
        ``changed_only``, only those not at their default (to pass as keyword arguments)."""
        return {name.rpartition(".")[2]: v for name, v in self.values.items()
                if self.schema.keys[name].section == prefix
                and not (changed_only and self.sources[name] == DEFAULT_SOURCE)}

    def to_obj(self) -> dict[str, dict[str, Any]]:
        return {name: {"value": list(v) if isinstance(v, tuple) else v, "source": self.sources[name],
                       "env": self.schema.keys[name].env} for name, v in sorted(self.values.items())}

    def render(self, *, as_json: bool = False) -> str:
        """The settings as JSON (``{key: {value, source, env}}``) or as a TOML file, each line
        commented with its source (and ``live`` for :data:`LIVE_KEYS`); keys whose value is none are
        commented out (TOML has no null)."""
        if as_json:
            return orjson.dumps(self.to_obj(), option=orjson.OPT_INDENT_2).decode()
        lines = [f"# effective configuration ({'file ' + str(self.file) if self.file else 'no file'}); "
                 "precedence: default < file < env < flag; live: a running detect or serve applies a change on SIGHUP"]
        by_section: dict[str, list[str]] = {}
        for name in self.values:
            by_section.setdefault(self.schema.keys[name].section, []).append(name)
        for section in sorted(by_section):
            if section:
                lines += ["", f"[{section}]"]
            names = sorted(by_section[section])
            texts = [f"{k} = {_toml_value(self.values[n])}" if self.values[n] is not None else f"# {k} = (none)"
                     for n, k in ((n, n.rpartition(".")[2]) for n in names)]
            width = max(map(len, texts))
            lines += [f"{text.ljust(width)}  # {self.sources[n]}{'; live' if is_live(n) else ''}"
                      for n, text in zip(names, texts, strict=True)]
        return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, str):
        return orjson.dumps(value).decode()
    if isinstance(value, float):
        return repr(value)
    return str(value)


COMMAND_KEYS: tuple[Key, ...] = (
    # shared by several commands
    Key("kafka", "str", None, "the bus, kafka://host:port[,host:port]; serve without it starts the embedded broker",
        optional=True),
    Key("store", "str", None, "the store, http(s)://clickhouse:8123/db or chdb:///path; serve without it uses "
                              "chdb://DATA/store", optional=True),
    Key("data", "str", "fleethealth-data", "serve's embedded store (DATA/store) and act's journal directory"),
    Key("node.name", "str", "", "this node's name (empty: from the host name under node.naming)",
        env="FLEETHEALTH_NODE"),
    Key("node.naming", "str", "short", "host name rule when node.name is empty: short or fqdn",
        choices=("short", "fqdn")),
    Key("node.rack", "str", "unknown", "this node's rack (the probe)", env="FLEETHEALTH_RACK"),
    Key("log.level", "str", "info", "log level of every long-running command (probe, detect, serve, act)",
        choices=("debug", "info", "warning", "error")),
    Key("log.format", "str", "text", "log lines as text or one JSON object each", choices=("text", "json")),
    Key("node.topology", "str", "", "a fleet topology file (one 'NODE RACK' a line): this node's rack when "
                                    "node.rack is unknown"),
    # signatures binding a record to its node (fleethealth/signing.py; deploy/README.md "Signed messages")
    Key("signing.mode", "str", "off", "detectors: off, verify (check signed records) or require (dead-letter "
        "unsigned or mismatched ones too)", choices=("off", "verify", "require")),
    Key("signing.fleet_secret_file", "str", None, "detectors: the fleet secret every node key is derived from",
        optional=True),
    Key("signing.key_dir", "str", None, "detectors: a directory of per-node key files (instead of the fleet secret)",
        optional=True),
    Key("signing.key_file", "str", None, "probe, sweep, selftest, act: this node's (or service's) own key",
        optional=True, env="FLEETHEALTH_SIGNING_KEY_FILE"),
    Key("signing.key_id", "str", "", "the signer's key id (empty: this node's name; a service: svc:NAME)"),
    # migrations (fleethealth migrate; deploy/README.md "Upgrading")
    Key("migrate.on_start", "bool", False, "serve, detect and act apply pending migrations at start (--migrate); "
        "without it they refuse to start while any is pending, naming them"),
    Key("migrate.lock_ttl_s", "float", 3600.0, "how long a migrator's claim on the store's migration lock lasts "
        "unless extended (before every step): longer than the longest step, the copy of the largest table"),
    # detect
    Key("detect.group", "str", "fh-detect", "consumer group of the detector runners (a stage's: GROUP-STAGE)"),
    Key("detect.stage", "str", "all", "which part of the detector tier a runner runs: all, node, job or policy"),
    Key("detect.metrics_port", "int", 9403, "Prometheus /metrics port of detect, 0 to disable"),
    Key("detect.fail_over_after_s", "float", 10.0, "with several brokers in the DSN, a detector's consumer whose "
        "client has reached no broker for this long reconnects from all of them (a rebalance); 0: never"),
    Key("detect.hole_skip_after_s", "float", 600.0, "a detector's consumer whose position in a partition has "
        "stood still this long (in time spent polling) with the high watermark beyond it reads on from the high "
        "watermark: a hole a broker left at the log's end, counted and dead-lettered. Shorter frees a drain "
        "sooner; it must stay longer than a broker can stall between its watermark and batch writes (a frozen "
        "broker), else that batch is skipped when it lands; 0: never"),
    # serve
    Key("serve.host", "str", "127.0.0.1", "listen address"),
    Key("serve.port", "int", 8080, "listen port"),
    Key("serve.token_file", "str", None, "file holding the bearer token for write endpoints", optional=True),
    Key("serve.read_token_file", "str", None, "file holding the bearer token for reads", optional=True),
    Key("serve.open_reads", "bool", False, "serve reads without a token (logged as a warning)"),
    Key("serve.no_detect", "bool", False, "serve the API only; run no detector runner (the store's schema is "
        "checked, not migrated)"),
    Key("serve.query_store", "str", None, "store DSN analyst SQL runs on (server mode: the read-only user of "
        "deploy/clickhouse/access/); none: the store's", optional=True),
    # act
    Key("act.scheduler", "str", None, "slurm or kubernetes", optional=True, choices=("slurm", "kubernetes")),
    Key("act.dry_run", "bool", False, "record what would be done; change nothing"),
    Key("act.group", "str", None, "consumer group (none: fh-act-SCHEDULER)", optional=True),
    Key("act.max_actions", "int", 5, "the adapter's own rate limit: actions per act.window_s"),
    Key("act.window_s", "float", 3600.0, "the rate-limit window, seconds"),
    # adapters.act.DEFAULT_MAX_AGE_S: twice the policy engine's 900 s staleness bound
    Key("act.max_age_s", "float", 1800.0, "record but do not act on recommendations older than this; 0 = no bound"),
    Key("act.kubeconfig", "str", None, "kubeconfig file (none: ~/.kube/config)", optional=True),
    Key("act.in_cluster", "bool", False, "use the pod's service account"),
    Key("act.drain_force", "bool", False, "a Kubernetes drain also evicts pods no controller manages "
        "(kubectl drain --force); without it such a pod makes the drain refuse"),
    Key("act.drain_delete_emptydir_data", "bool", False, "a Kubernetes drain also evicts pods with emptyDir "
        "volumes (kubectl drain --delete-emptydir-data); without it such a pod makes the drain refuse"),
    Key("act.drain_skip_namespaces", "str", "kube-system", "comma-separated namespaces whose pods a "
        "Kubernetes drain leaves running"),
    Key("act.metrics_port", "int", 9404, "act's /metrics and /healthz port, 0 to disable"),
    Key("act.idle_exit", "float", None, "exit after this many seconds without a new recommendation", optional=True),
    # probe
    Key("probe.source", "str", "nvml", "telemetry source (none: relay the socket only, no GPU telemetry)",
        choices=("dcgm", "nvml", "sim", "none")),
    Key("probe.interval_s", "float", 1.0, "seconds between samples"),
    Key("probe.socket", "str", "/run/fleethealth/probe.sock", "Unix socket for the in-job step timer",
        env="FLEETHEALTH_SOCKET"),
    Key("probe.no_socket", "bool", False, "do not listen for training processes"),
    Key("probe.socket_group", "str", None, "group (name or gid) of the socket, mode 0660: the training processes' "
        "group (none: the probe's own)", optional=True, env="FLEETHEALTH_SOCKET_GROUP"),
    Key("probe.socket_uids", "str", "", "uids (numbers or names, comma-separated) whose datagrams are accepted; "
        "with probe.socket_gids empty too: root, the probe's uid and the socket's group"),
    Key("probe.socket_gids", "str", "", "gids (numbers or names, comma-separated) whose datagrams are accepted"),
    Key("probe.socket_max_bytes", "int", 65536, "longest datagram read; longer ones are dropped and counted"),
    Key("probe.socket_events_per_s", "float", 5.0, "event datagrams one job may send per second, sustained"),
    Key("probe.socket_event_burst", "int", 50, "event datagrams one job may send at once"),
    Key("probe.socket_node_events_per_s", "float", 20.0, "event datagrams all jobs together may send per second"),
    Key("probe.socket_node_event_burst", "int", 200, "event datagrams all jobs together may send at once"),
    Key("probe.socket_max_ranks", "int", 256, "ranks one step of a job may carry on this node; more are dropped"),
    Key("probe.socket_event_kinds", "str",
        "sdc_check,hang_report,checkpoint,checkpoint_validated,checkpoint_cost,job_start,job_exit",
        "event kinds a training process may send on the socket (node kinds such as xid come from the probe's "
        "own sources)"),
    Key("probe.rollback_relay", "bool", True, "write the policy's newest rollback for each job on this node to "
        "DIR/rollback/JOB.json, DIR the socket's directory (fleethealth.injob.inbox reads it)"),
    Key("probe.spool_dir", "str", "/var/lib/fleethealth/spool", "on-disk queue used while Kafka is unreachable"),
    Key("probe.spool_max_mb", "float", 512.0, "spool bound; beyond it the oldest records are dropped and counted"),
    Key("probe.metrics_port", "int", 9402, "Prometheus port of the probe, 0 to disable"),
    Key("probe.scenario", "str", None, "scenario file for probe.source = sim", optional=True),
    Key("probe.dcgm_host", "str", "localhost", "nv-hostengine for probe.source = dcgm, host[:port] "
        "(GPU Operator's standalone host engine: nvidia-dcgm:5555)", env="FLEETHEALTH_DCGM_HOST"),
    Key("probe.dcgm_exporter_compat", "bool", False, "serve dcgm-exporter's DCGM_FI_* names and labels instead of "
        "fleethealth_gpu_* (only where the probe replaces dcgm-exporter)", env="FLEETHEALTH_DCGM_EXPORTER_COMPAT"),
    Key("probe.sysfs_root", "str", "/", "root whose sys/class/infiniband and sys/class/net hold the NIC counters",
        env="FLEETHEALTH_SYSFS_ROOT"),
    Key("probe.no_nic", "bool", False, "do not read NIC counters"),
    Key("probe.stall_timeout_s", "float", 5.0, "a source call slower than this is reported as telemetry_stalled"),
    Key("probe.gpu_timeout_s", "float", 0.5, "NVML: one sample's reads of all GPUs wait at most this long; a GPU "
        "still inside a driver call is left out with a telemetry_stalled event naming it (below "
        "probe.stall_timeout_s)"),
    Key("probe.step_timeout_s", "float", 5.0, "how long a step batch waits for the node's slower ranks"),
    Key("probe.steps_per_message", "int", 100, "most steps of one job completed in an interval that one fh.steps "
        "message carries (1: one message per step)"),
    Key("probe.ensure_topics", "bool", False, "create the fh.* topics on every (re)connect"),
    Key("probe.duration_s", "float", None, "stop after this many seconds", optional=True),
)
"""The commands' own settings (the bus, the store, the node, and each command's flags). The
detector and policy thresholds are added by the commands from the parameters of those parts."""


LIVE_KEYS: frozenset[str] = frozenset(
    [f"detect.straggler.{p}" for p in (
        "false_rate", "shares", "thresholds", "clip", "clip_margin", "sigma_prior_steps", "min_group",
        "min_scale", "min_effect", "min_peer_effect", "baseline_steps", "freeze_at", "persistent_min",
        "persistent_threshold")]
    + [f"detect.health.{p}" for p in (
        "clear_after_s", "pcie_busy_util_pct", "min_xid_severity", "nvlink_errors_per_min", "nvlink_clear_per_min",
        "nvlink_critical_per_min", "nvlink_window_s", "corroborate_window_s", "silence_s", "stall_count",
        "stall_window_s")]
    + [f"policy.{p}" for p in (
        "restart_s", "payback_margin", "default_remaining_s", "facilities_episode_s", "failure_risk_threshold",
        "power_fault_share", "power_fault_min_slowdown", "corroborate", "require_validated", "dry_run")]
    + [f"policy.paging.{p}" for p in (
        "recent_s", "rate_window_s", "rate_factor", "rate_min_count", "baseline_per_h", "baseline_min_count",
        "goodput_floor", "repage_after_s")])
"""Keys a running ``detect`` or ``serve`` applies from a reloaded file at its next batch boundary,
keeping every detector's state. Every other key needs a restart: the bus and store DSNs, the stage
and group, listen addresses and ports, key and token files, and the parameters that shape detector
state (``detect.straggler.drifts`` — the number of CUSUM arms —, ``init_steps``, the hang window)
or live inside stateful parts (the circuit breaker's share and window, the posterior's prior)."""


def is_live(name: str) -> bool:
    """Whether key ``name`` can change in a running process (:data:`LIVE_KEYS`)."""
    return name in LIVE_KEYS


_DSN_KEYS = frozenset({"kafka", "store", "serve.query_store"})
_USERINFO = re.compile(r"(?<=://)[^/@]*@")
_SECRET_QUERY = re.compile(r"(?i)((?:password|passwd|secret|token|key)[^=&]*=)[^&]*")


def shown_value(name: str, value: Any) -> Any:
    """``value`` of key ``name`` as it may be shown (``GET /v1/config``, logs): a DSN loses its user
    information and any password, secret, token or key query parameter (``***``); a key file is shown
    by its path, never its contents (no key holds a secret itself: tokens come from files or the
    environment only)."""
    if isinstance(value, tuple):
        return list(value)
    if name in _DSN_KEYS and isinstance(value, str):
        return _SECRET_QUERY.sub(r"\1***", _USERINFO.sub("***@", value))
    return value


@dataclass(frozen=True)
class Reload:
    """One accepted reload: the ``settings`` in force once applied, the live keys it changes
    (``applied``: name → (old, new)) and the restart-only keys that differ but stay as they are
    until a restart (``ignored``), and the digest of the file it read."""

    settings: Settings
    applied: dict[str, tuple[Any, Any]]
    ignored: dict[str, tuple[Any, Any]]
    digest: str

    def sections(self) -> set[str]:
        """The tables whose live keys changed (``detect.straggler``, ``policy``…)."""
        return {name.rpartition(".")[0] for name in self.applied}


def _digest(path: str | Path | None) -> str:
    if path is None:
        return ""
    try:
        return "sha256:" + hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from exc


class LiveSettings:
    """The settings in force in a running process, and their reload from the same file.

    ``settings`` are those the process started with; ``environ``, ``flags`` and ``sets`` are what it
    loaded them from (the environment and flags keep their precedence over the file on every reload).
    ``validate(settings)`` raises :class:`ConfigError` for a value out of its range (the command
    passes one that builds the parts the live keys reach). Thread-safe: a signal handler calls
    :meth:`request`, an API thread :meth:`reload`, the detector loop :meth:`take`.
    """

    def __init__(self, settings: Settings, *, environ: Mapping[str, str] | None = None,
                 flags: Mapping[str, tuple[str, Any]] | None = None, sets: Iterable[str] = (),
                 validate: Callable[[Settings], None] | None = None,
                 logger: logging.Logger | None = None) -> None:
        self._settings = settings
        self._environ = dict(os.environ if environ is None else environ)
        self._flags = dict(flags or {})
        self._sets = tuple(sets)
        self._validate = validate
        self._log = logger if logger is not None else logging.getLogger("fleethealth.config")
        self._lock = threading.Lock()
        self._requested = False
        self._pending: Reload | None = None
        self.digest = _digest(settings.file)
        self.reloads_total = 0
        self.failures_total = 0
        self.last_error: str | None = None
        self._counters: Any = None

    @property
    def current(self) -> Settings:
        """The settings in force (a pending reload's values once :meth:`take` returned it)."""
        with self._lock:
            return self._settings

    @property
    def pending(self) -> bool:
        with self._lock:
            return self._pending is not None or self._requested

    def request(self) -> None:
        """Ask for a reload at the next batch boundary. Only sets a flag: safe in a signal handler."""
        self._requested = True

    def reload(self) -> Reload:
        """Read the file again and keep its live changes pending for :meth:`take`; a
        :class:`ConfigError` (the file unreadable or unparsable, an unknown key, a value of the wrong
        type or out of range) is logged, counted and raised, and nothing changes."""
        with self._lock:
            old = self._settings
        try:
            if old.file is None:
                raise ConfigError("no config file to reload: the process was started without --config or "
                                  "$FLEETHEALTH_CONFIG")
            digest = _digest(old.file)
            fresh = old.schema.load(file=old.file, environ=self._environ, flags=self._flags, sets=self._sets)
            applied = {n: (old.values[n], v) for n, v in fresh.values.items() if v != old.values[n] and is_live(n)}
            ignored = {n: (old.values[n], v) for n, v in fresh.values.items()
                       if v != old.values[n] and not is_live(n)}
            values = {**fresh.values, **{n: old.values[n] for n in ignored}}
            sources = {**fresh.sources, **{n: old.sources[n] for n in ignored}}
            settings = Settings(old.schema, values, sources, old.file)
            if self._validate is not None:
                self._validate(settings)
        except ConfigError as exc:
            self.failed(str(exc))
            raise
        plan = Reload(settings, applied, ignored, digest)
        for name, (was, now) in sorted(applied.items()):
            self._log.warning("config reload: %s %s -> %s", name, shown_value(name, was), shown_value(name, now))
        for name, (was, now) in sorted(ignored.items()):
            self._log.warning("config reload: %s changed (%s -> %s) but needs a restart: ignored until restart",
                              name, shown_value(name, was), shown_value(name, now))
        if not applied and not ignored:
            self._log.warning("config reload: %s read, nothing changed", old.file)
        with self._lock:
            self._pending = plan
            self.last_error = None
        return plan

    def take(self) -> Reload | None:
        """At a batch boundary: the reload to apply now (reading the file first if one was requested),
        or None. The returned settings are in force from here on."""
        if self._requested:
            self._requested = False
            try:
                self.reload()
            except ConfigError:
                pass  # logged and counted; the old values stay
        with self._lock:
            plan, self._pending = self._pending, None
            if plan is None:
                return None
            self._settings = plan.settings
            self.digest = plan.digest
            self.reloads_total += 1
        if self._counters is not None:
            self._counters[0].inc()
            self._set_gauges(plan.settings)
        return plan

    def failed(self, why: str) -> None:
        """Count and log a reload that was refused (the old values stay)."""
        with self._lock:
            self.failures_total += 1
            self.last_error = why
        if self._counters is not None:
            self._counters[1].inc()
        self._log.error("config reload refused, the old values stay: %s", why)

    def register(self, registry: Any) -> None:
        """``fleethealth_config_reloads_total``, ``fleethealth_config_reload_failures_total`` and
        ``fleethealth_config_value{key}`` (each numeric or boolean live key in force) in ``registry``."""
        from prometheus_client import Counter, Gauge

        self._counters = (
            Counter("fleethealth_config_reloads_total", "configuration reloads applied", registry=registry),
            Counter("fleethealth_config_reload_failures_total", "configuration reloads refused (the old values "
                    "stayed): an unreadable or unparsable file, an unknown key, a value out of range",
                    registry=registry),
            Gauge("fleethealth_config_value", "each live configuration key in force (numbers and booleans)",
                  ["key"], registry=registry))
        self._set_gauges(self.current)

    def _set_gauges(self, settings: Settings) -> None:
        gauge = self._counters[2]
        for name in sorted(LIVE_KEYS & settings.values.keys()):
            value = settings.values[name]
            if isinstance(value, bool | int | float):
                gauge.labels(name).set(float(value))

    def to_obj(self) -> dict[str, Any]:
        """What ``GET /v1/config`` shows: the file, its digest, the reloads, and every key's value in
        force (:func:`shown_value`), source and whether it is live."""
        settings = self.current
        return {"file": None if settings.file is None else str(settings.file), "digest": self.digest,
                "reloads_total": self.reloads_total, "reload_failures_total": self.failures_total,
                "last_error": self.last_error, "pending": self.pending,
                "keys": {name: {"value": shown_value(name, v), "source": settings.sources[name], "live": is_live(name)}
                         for name, v in sorted(settings.values.items())}}
