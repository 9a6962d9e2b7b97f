"""``build_runner`` hands the config's detector and policy keys to the parts it wires, on a real
broker and a real chDB store; with no settings the runner is the one ``Runner`` builds itself."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from fleethealth.commands import build_parser
from fleethealth.commands._settings import load_settings
from fleethealth.commands.detect import build_runner
from fleethealth.detectors.runner import Runner


def _settings(*sets: str):
    argv = ["detect"]
    for item in sets:
        argv += ["--set", item]
    return load_settings(build_parser().parse_args(argv))


def test_settings_reach_the_detectors_the_policy_and_the_runner(broker, store) -> None:
    settings = _settings("policy.fleet_nodes=2048", "policy.breaker_share=0.05", "detect.straggler.clip=5",
                         "detect.hang.window=64", "detect.diagnosis.thermal_limit_c=80",
                         "detect.features.recent_s=600", "policy.paging.rate_factor=4", "detect.runner.lateness_s=2",
                         "detect.pipeline.diagnosis_wait_s=3", "detect.group=fh-test-config")
    with build_runner(broker.dsn, store, settings, registry=CollectorRegistry()) as runner:
        p, engine = runner.pipeline, runner.policy.engine
        assert engine.breaker_.fleet_nodes == 2048 and engine.breaker_.share == 0.05
        assert p.straggler().clip == 5.0 and p.hang.window == 64
        assert p.diagnoser.thresholds.thermal_limit_c == 80.0
        assert p.predictor.features.recent_s == 600.0 and runner.policy.pager.rate_factor == 4.0
        assert runner.lateness_s == 2.0 and p.diagnosis_wait_s == 3.0


def test_defaults_build_the_same_parts_as_the_runner_alone(broker, store) -> None:
    with build_runner(broker.dsn, store, _settings(), registry=CollectorRegistry()) as ours, \
            Runner(broker.dsn, store, registry=CollectorRegistry()) as plain:
        a, b = ours.pipeline, plain.pipeline
        pa, pb = ours.policy.engine, plain.policy.engine
        assert vars(a.straggler()) == vars(b.straggler()) and vars(a.hang) == vars(b.hang)
        assert a.diagnoser.thresholds == b.diagnoser.thresholds and vars(a.health) == vars(b.health)
        assert pa.breaker_.fleet_nodes == pb.breaker_.fleet_nodes == 0
        assert (pa.restart_s, pa.stale_after_s) == (pb.restart_s, pb.stale_after_s)
        assert (ours.lateness_s, ours.max_records) == (plain.lateness_s, plain.max_records)
