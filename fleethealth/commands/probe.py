"""``fleethealth probe``: the node probe, GPU telemetry and rank step timings to Kafka."""

from __future__ import annotations

import argparse
import sys

from fleethealth.commands._common import require_bus, stop_on_signals
from fleethealth.commands._settings import add_config_flags, add_log_flags, add_setting, load_settings
from fleethealth.errors import ConfigError

__all__ = ["add"]


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("probe", help="run the node probe: GPU telemetry and rank step timings to Kafka",
                       description="Sample this node's GPUs every interval (one fh.telemetry message), "
                                   "aggregate the training ranks' step timings from the Unix socket "
                                   "(fh.steps), forward events (fh.events), spool to disk while Kafka is "
                                   "unreachable, and serve Prometheus /metrics.")
    add_setting(p, "--source", "probe.source", choices=("dcgm", "nvml", "sim", "none"),
                help="telemetry source: dcgm, nvml, sim (simulated GPUs, for trials: never on a real job), or "
                     "none (a CPU box: no telemetry at all; the probe relays the training processes' steps and "
                     "events from the socket)")
    add_setting(p, "--kafka", "kafka", metavar="DSN",
                help="bus, kafka://host:port[,host:port] (default $FLEETHEALTH_KAFKA)")
    add_setting(p, "--node", "node.name",
                help="node name (default $FLEETHEALTH_NODE, else the short hostname, or the FQDN with "
                     "node.naming = fqdn)")
    add_setting(p, "--rack", "node.rack", help="rack name (default $FLEETHEALTH_RACK, else unknown)")
    add_setting(p, "--interval", "probe.interval_s", type=float, metavar="S", help="seconds between samples")
    add_setting(p, "--socket", "probe.socket", metavar="PATH",
                help="Unix socket for the in-job step timer (default $FLEETHEALTH_SOCKET or "
                     "/run/fleethealth/probe.sock)")
    add_setting(p, "--no-socket", "probe.no_socket", store_true=True, help="do not listen for training processes")
    add_setting(p, "--socket-group", "probe.socket_group", metavar="GROUP",
                help="group of the socket (mode 0660): the training processes' group (default: the probe's)")
    add_setting(p, "--socket-uids", "probe.socket_uids", metavar="UIDS",
                help="uids whose datagrams are accepted, comma-separated (default, with --socket-gids empty: "
                     "root, the probe's uid and the socket's group; checked on every datagram)")
    add_setting(p, "--socket-gids", "probe.socket_gids", metavar="GIDS",
                help="gids whose datagrams are accepted, comma-separated")
    add_setting(p, "--spool-dir", "probe.spool_dir", metavar="DIR",
                help="on-disk queue used while Kafka is unreachable")
    add_setting(p, "--spool-max-mb", "probe.spool_max_mb", type=float, metavar="MB",
                help="spool bound; beyond it the oldest records are dropped and counted")
    add_setting(p, "--metrics-port", "probe.metrics_port", type=int, metavar="PORT", help="Prometheus port (0: off)")
    add_setting(p, "--scenario", "probe.scenario", metavar="FILE", help="scenario for --source sim")
    add_setting(p, "--dcgm-host", "probe.dcgm_host", metavar="HOST[:PORT]",
                help="nv-hostengine for --source dcgm (default $FLEETHEALTH_DCGM_HOST, else localhost; "
                     "GPU Operator's standalone host engine is nvidia-dcgm:5555)")
    add_setting(p, "--dcgm-exporter-compat", "probe.dcgm_exporter_compat", store_true=True,
                help="serve dcgm-exporter's DCGM_FI_* metric names and labels instead of fleethealth_gpu_* "
                     "(only where the probe replaces dcgm-exporter; default $FLEETHEALTH_DCGM_EXPORTER_COMPAT)")
    add_setting(p, "--sysfs-root", "probe.sysfs_root", metavar="DIR",
                help="root whose sys/class/infiniband and sys/class/net hold the NIC counters "
                     "(default $FLEETHEALTH_SYSFS_ROOT, else /)")
    add_setting(p, "--no-nic", "probe.no_nic", store_true=True, help="do not read NIC counters")
    add_log_flags(p)
    add_setting(p, "--stall-timeout", "probe.stall_timeout_s", type=float, metavar="S",
                help="a source call slower than this is reported as telemetry_stalled")
    add_setting(p, "--gpu-timeout", "probe.gpu_timeout_s", type=float, metavar="S",
                help="NVML: a GPU whose driver calls take longer is left out of the sample with a "
                     "telemetry_stalled event naming it, its siblings still reported (below --stall-timeout)")
    add_setting(p, "--step-timeout", "probe.step_timeout_s", type=float, metavar="S",
                help="how long a step batch waits for the node's slower ranks")
    add_setting(p, "--steps-per-message", "probe.steps_per_message", type=int, metavar="N",
                help="most steps of a job completed in one interval that one fh.steps message carries "
                     "(1: one message per step)")
    add_setting(p, "--ensure-topics", "probe.ensure_topics", store_true=True,
                help="create the fh.* topics on every (re)connect (a broker that forgets them on restart)")
    add_setting(p, "--duration", "probe.duration_s", type=float, metavar="S", help="stop after S seconds")
    add_config_flags(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import threading
    import time

    from fleethealth.nodename import UNKNOWN_RACK, node_name, rack_from_topology
    from fleethealth.probe.daemon import Probe, ProbeConfig, make_source
    from fleethealth.probe.logs import configure_logging

    s = load_settings(args)
    configure_logging(s["log.level"], s["log.format"])
    kafka = require_bus(s["kafka"], "--kafka DSN is required (or set FLEETHEALTH_KAFKA)")
    node = node_name(s["node.name"], naming=s["node.naming"])
    interval, source_name = s["probe.interval_s"], s["probe.source"]
    rack = s["node.rack"]
    if rack == UNKNOWN_RACK and s["node.topology"]:
        rack = rack_from_topology(s["node.topology"], node)
    if not 0 < s["probe.gpu_timeout_s"] < s["probe.stall_timeout_s"]:
        raise ConfigError(f"probe: --gpu-timeout ({s['probe.gpu_timeout_s']:g} s) must be > 0 and below "
                          f"--stall-timeout ({s['probe.stall_timeout_s']:g} s): a stalled GPU would stall the source")
    source = make_source(source_name, node=node, rack=rack, interval_s=interval,
                         scenario=s["probe.scenario"], dcgm_host=s["probe.dcgm_host"],
                         gpu_timeout_s=s["probe.gpu_timeout_s"])
    from fleethealth.probe.aggregator import SocketLimits
    from fleethealth.probe.listener import parse_ids

    kinds = frozenset(k.strip() for k in s["probe.socket_event_kinds"].split(",") if k.strip())
    limits = SocketLimits(events_per_s=s["probe.socket_events_per_s"], event_burst=s["probe.socket_event_burst"],
                          node_events_per_s=s["probe.socket_node_events_per_s"],
                          node_event_burst=s["probe.socket_node_event_burst"], max_ranks=s["probe.socket_max_ranks"],
                          event_kinds=kinds)
    config = ProbeConfig(node=node, rack=getattr(source, "rack", rack), interval_s=interval,
                         socket_path=None if s["probe.no_socket"] else s["probe.socket"],
                         spool_dir=s["probe.spool_dir"], spool_max_bytes=int(s["probe.spool_max_mb"] * (1 << 20)),
                         metrics_port=s["probe.metrics_port"] or None, stall_timeout_s=s["probe.stall_timeout_s"],
                         step_timeout_s=s["probe.step_timeout_s"], steps_per_message=s["probe.steps_per_message"],
                         nic_root=None if s["probe.no_nic"] else s["probe.sysfs_root"],
                         dcgm_exporter_compat=s["probe.dcgm_exporter_compat"],
                         socket_group=s["probe.socket_group"],
                         socket_uids=parse_ids(s["probe.socket_uids"], "--socket-uids"),
                         socket_gids=parse_ids(s["probe.socket_gids"], "--socket-gids", groups=True),
                         socket_max_bytes=s["probe.socket_max_bytes"], socket_limits=limits)
    on_connect = None
    if s["probe.ensure_topics"]:
        from fleethealth.bus import ensure_topics

        on_connect = ensure_topics
    with stop_on_signals() as stop:
        duration = s["probe.duration_s"]
        timer = threading.Timer(duration, stop.set) if duration is not None else None
        if timer is not None:
            timer.daemon = True
            timer.start()
        started = time.monotonic()
        relay = None
        if s["probe.rollback_relay"] and config.socket_path is not None:
            from pathlib import Path

            from fleethealth.probe.rollback import RollbackRelay

            relay = RollbackRelay(Path(config.socket_path).parent, node, dsn=kafka)
        from fleethealth.signing import load_signer

        signer = load_signer(s["signing.key_file"], s["signing.key_id"] or node)  # this node's key only
        with Probe(source, config, dsn=kafka, on_connect=on_connect, relay=relay, signer=signer) as probe:
            print(f"fleethealth probe: node {config.node}, source {source_name}, bus {kafka}, "
                  f"socket {config.socket_path or 'off'}, metrics {config.metrics_port or 'off'}", file=sys.stderr)
            ticks = probe.run(stop)
            health = probe.health()
        print(f"fleethealth probe: stopped after {ticks} samples in {time.monotonic() - started:.1f} s; "
              f"delivered {health.delivered_total}, spooled {health.spool_records}, "
              f"dropped {health.spool_dropped_total}", file=sys.stderr)
    return 0
