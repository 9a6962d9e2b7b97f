"""``fleethealth config``: the effective configuration of detect, serve, act and probe, and where
each value came from (default, file, environment or flag)."""

from __future__ import annotations

import argparse

from fleethealth.commands._settings import add_config_flags, load_settings, schema

__all__ = ["add"]


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="show the effective configuration (file < environment < flags)",
                       description="One configuration serves detect, serve, act and probe: a TOML (or YAML) file "
                                   "from --config or $FLEETHEALTH_CONFIG, then environment variables "
                                   "(FLEETHEALTH_ and the key in capitals, dots as underscores: "
                                   "FLEETHEALTH_POLICY_FLEET_NODES), then flags (--set KEY=VALUE or the "
                                   "command's own). Every detector and policy threshold is a key.",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="example file:\n"
                              "  kafka = \"kafka://broker:9092\"\n"
                              "  store = \"http://clickhouse:8123/fleethealth\"\n"
                              "  [policy]\n"
                              "  fleet_nodes = 2048\n"
                              "  [detect.straggler]\n"
                              "  clip = 5.0\n")
    cs = p.add_subparsers(dest="config_command", metavar="SUBCOMMAND", required=True)
    show = cs.add_parser("show", help="print every key, its effective value and its source")
    add_config_flags(show)
    show.add_argument("--json", action="store_true",
                      help="print one JSON object: key -> {value, source, env}")
    show.set_defaults(run=run)
    get = cs.add_parser("get", help="print one key's effective value (for scripts)")
    get.add_argument("key", help="a dotted key, e.g. node.name or policy.fleet_nodes")
    add_config_flags(get)
    get.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    settings = load_settings(args)
    if args.config_command == "get":
        key = schema().key(args.key, "config get")
        value = settings[key.name]
        if key.name == "node.name" and not value:
            from fleethealth.nodename import node_name

            value = node_name(None, naming=settings["node.naming"])
        print("" if value is None else ",".join(map(str, value)) if isinstance(value, tuple)
              else str(value).lower() if isinstance(value, bool) else value)
        return 0
    print(settings.render(as_json=args.json))
    return 0
