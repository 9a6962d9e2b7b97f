"""The commands' side of :mod:`fleethealth.config`: the full schema (the commands' own keys plus
every detector and policy parameter, read from the signatures of the parts the runner builds),
flags that record whether they were given, and loading the effective settings for a command.

A flag added with :func:`add_setting` keeps its usual default on the namespace (so ``--help`` and
``args.NAME`` read as before) and marks itself as given when it appears on the command line; only
given flags override the file and the environment.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

from fleethealth.config import COMMAND_KEYS, Key, LiveSettings, Schema, Settings, keys_from_signature

__all__ = ["schema", "add_setting", "add_migrate_flag", "add_config_flags", "load_settings", "load_live",
           "DETECTION_SECTIONS"]

DETECTION_SECTIONS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    # (table, module, class, parameters that are objects or wiring, not settings)
    ("detect.straggler", "fleethealth.detectors.straggler", "StragglerDetector", ()),
    ("detect.hang", "fleethealth.detectors.hang", "HangDetector", ()),
    ("detect.diagnosis", "fleethealth.detectors.diagnosis", "DiagnosisThresholds", ()),
    ("detect.rack_episodes", "fleethealth.detectors.diagnosis", "RackEpisodes", ()),
    ("detect.health", "fleethealth.detectors.health", "HealthRules", ()),
    ("detect.sdc", "fleethealth.detectors.sdc", "SdcDetector", ()),
    ("detect.lifecycle", "fleethealth.detectors.lifecycle", "LifecycleTracker", ()),
    ("detect.predict", "fleethealth.detectors.predict", "FailurePredictor", ("features",)),
    ("detect.features", "fleethealth.detectors.predict", "GpuFeatures", ()),
    ("detect.assembly", "fleethealth.detectors.assembly", "StepAssembler", ()),
    ("detect.pipeline", "fleethealth.detectors.pipeline", "Pipeline", ()),
    ("detect.runner", "fleethealth.detectors.runner", "Runner", ("bus_dsn", "store", "group", "registry", "stage")),
    ("detect.snapshot", "fleethealth.detectors.snapshot", "Snapshots", ()),
    ("policy", "fleethealth.policy.engine", "PolicyEngine", ()),
    ("policy.paging", "fleethealth.policy.paging", "Pager", ()),
    ("checkpoint", "fleethealth.injob.ckptcheck.rules", "CheckpointRules", ()),
    ("policy.interval", "fleethealth.policy.interval", "IntervalEstimator", ()),
)
"""Where each detector and policy table's keys come from: the keyword parameters of that class."""


def _part(module: str, name: str) -> Any:
    import importlib

    return getattr(importlib.import_module(module), name)


@functools.cache
def schema() -> Schema:
    """Every key any configured command knows (one file serves detect, serve, act and probe)."""
    keys: list[Key] = list(COMMAND_KEYS)
    for table, module, name, skip in DETECTION_SECTIONS:
        keys += keys_from_signature(table, _part(module, name), skip=skip, help=f"{name} parameter")
    return Schema(keys)


class _Given(argparse.Action):
    """Marks ``dest`` as given on the command line (in ``namespace._given``), then stores as the
    wrapped action does."""

    def __init__(self, *args: Any, flag_kind: str = "store", **kwargs: Any) -> None:
        self.flag_kind = flag_kind
        if flag_kind == "store_true":
            kwargs.update(nargs=0, const=True)
        super().__init__(*args, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, self.const if self.flag_kind == "store_true" else values)
        namespace._given = {*getattr(namespace, "_given", ()), self.dest}


def add_setting(p: argparse.ArgumentParser, flag: str, key: str, *, store_true: bool = False, **kwargs: Any) -> None:
    """Add ``flag`` for config ``key``: its default is the key's, and given, it wins over the file and
    the environment. ``kwargs`` go to ``add_argument`` (``type``, ``metavar``, ``help``, ``choices``)."""
    k = schema().keys[key]
    dest = flag.lstrip("-").replace("-", "_")
    p.add_argument(flag, dest=dest, default=k.default, action=_Given, flag_kind="store_true" if store_true else "store",
                   **kwargs)
    table = dict(p.get_default("settings_flags") or {})
    table[key] = (flag, dest)
    p.set_defaults(settings_flags=table)


def add_log_flags(p: argparse.ArgumentParser) -> None:
    """``--log-level`` and ``--log-format`` (config keys ``log.level``, ``log.format``), for every
    long-running command; its ``run`` calls :func:`fleethealth.probe.logs.configure_logging`."""
    add_setting(p, "--log-level", "log.level", choices=("debug", "info", "warning", "error"),
                help="log level (default $FLEETHEALTH_LOG_LEVEL, else info)")
    add_setting(p, "--log-format", "log.format", choices=("text", "json"),
                help="log lines as text or one JSON object each (default $FLEETHEALTH_LOG_FORMAT, else text)")


def add_migrate_flag(p: argparse.ArgumentParser) -> None:
    """``--migrate`` (config key ``migrate.on_start``) for the commands that write the store."""
    add_setting(p, "--migrate", "migrate.on_start", store_true=True,
                help="apply the store's pending migrations before starting (under the store's migration lock); "
                     "without it the command refuses to start while any is pending, naming them (run "
                     "`fleethealth migrate up` as a step of its own: deploy/README.md, \"Upgrading\")")


def add_config_flags(p: argparse.ArgumentParser) -> None:
    """``--config FILE`` and ``--set KEY=VALUE`` (repeatable)."""
    p.add_argument("--config", metavar="FILE", default=None,
                   help="settings file, TOML (or YAML: *.yaml) (default $FLEETHEALTH_CONFIG); "
                        "precedence: file < environment ($FLEETHEALTH_...) < flags; see `fleethealth config show`")
    p.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                   help="set any config key, e.g. --set policy.fleet_nodes=2048 --set detect.straggler.clip=5")


def _flags(args: argparse.Namespace) -> dict[str, tuple[str, Any]]:
    given = getattr(args, "_given", set())
    return {key: (flag, getattr(args, dest)) for key, (flag, dest) in (getattr(args, "settings_flags", None)
                                                                      or {}).items() if dest in given}


def load_settings(args: argparse.Namespace) -> Settings:
    """The effective settings for a parsed command: file, environment, then the flags given."""
    return schema().load(file=getattr(args, "config", None), flags=_flags(args), sets=getattr(args, "set", ()) or ())


def load_live(args: argparse.Namespace, validate: Any = None) -> LiveSettings:
    """:func:`load_settings` held for reloading from the same file, with the same environment and flags
    (which keep their precedence over the file); ``validate`` checks a reloaded file's ranges."""
    import os

    sets = getattr(args, "set", ()) or ()
    settings = schema().load(file=getattr(args, "config", None), flags=_flags(args), sets=sets)
    return LiveSettings(settings, environ=os.environ, flags=_flags(args), sets=sets, validate=validate)
