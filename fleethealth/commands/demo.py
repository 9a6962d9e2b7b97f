"""``fleethealth demo``: a fault scenario through the embedded broker, the detectors and the store,
and the one-screen summary (human or JSON) it prints."""

from __future__ import annotations

import argparse
from collections import Counter
from typing import TYPE_CHECKING

import orjson

from fleethealth.commands._common import progress

if TYPE_CHECKING:
    from fleethealth.demo import DemoResult

__all__ = ["add", "summary"]


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo", help="run a fault scenario through broker, detectors and store; write findings",
        description="Start the embedded Kafka-protocol broker and a chDB store, run a simulated GPU fleet "
                    "with injected faults through Kafka -> detectors -> ClickHouse, and export "
                    "OUT/findings.jsonl and OUT/recommendations.jsonl from the store.",
    )
    p.add_argument("--scenario", metavar="FILE",
                   help="scenario YAML/JSON (default: the shipped one, every fault kind)")
    p.add_argument("--out", metavar="DIR", default="fleethealth-out",
                   help="where the JSONL files go (default: %(default)s)")
    p.add_argument("--data", metavar="DIR", default="fleethealth-data",
                   help="the demo's store (DIR/store, recreated empty) and broker log (default: %(default)s); "
                        "query it afterwards with 'fleethealth query --data DIR'")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of a table")
    p.add_argument("--closed-loop", action="store_true",
                   help="also weigh acting on the recommendations: the job replayed under fleethealth's policy, "
                        "the seed rule alone and no detection (goodput, ETTR, correct work per accelerator-hour)")
    p.add_argument("--no-report", dest="report", action="store_false",
                   help="write no OUT/report.html (its plots take a few seconds)")
    p.add_argument("--replicas", metavar="N", type=int,
                   help="run the detector tier as its stages: N replicas of the node stage and of the job stage "
                        "(each a consumer group splitting the partitions) and one policy stage; without it, one "
                        "runner of the whole tier. The findings are the same either way")
    p.add_argument("--injob", action="store_true",
                   help="instead of the simulator: a real 4-rank CPU torch job with the in-job SDC defence, a "
                        "fault, detection through probe, broker, detectors and store, rollback, bitwise check")
    p.add_argument("--fault", metavar="KIND", default="none",
                   help="with --injob: transient, deterministic or none (default: %(default)s)")
    p.add_argument("--world", metavar="N", type=int, default=4, help="with --injob: ranks (default: %(default)s)")
    p.add_argument("--ckpt-dir", metavar="DIR",
                   help="with --injob: where checkpoints go (default: a temporary directory, removed after)")
    p.add_argument("--corrupt-checkpoint", metavar="STEP", type=int, default=None,
                   help="with --injob --fault deterministic: validate every checkpoint in the background and write "
                        "the one of STEP corrupt (a weight 100x); the rollback must refuse it and land on an "
                        "older validated one")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import contextlib
    from pathlib import Path

    from fleethealth.demo import run_demo
    from fleethealth.detectors.runner import tune_gc
    from fleethealth.sim import Scenario

    if not args.injob and (args.fault != "none" or args.world != 4 or args.ckpt_dir is not None
                           or args.corrupt_checkpoint is not None):
        from fleethealth.errors import ConfigError

        raise ConfigError("--fault, --world, --ckpt-dir and --corrupt-checkpoint apply to --injob only")
    if args.injob:
        from fleethealth.demo_injob import run_injob_main

        return run_injob_main(args.fault, world=args.world, ckpt_dir=args.ckpt_dir, as_json=args.json,
                              corrupt_step=args.corrupt_checkpoint)
    scenario = Scenario.load(args.scenario) if args.scenario else Scenario.default()
    tune_gc()
    with (contextlib.nullcontext(None) if args.json else progress("demo", lines=True)) as show:
        result = run_demo(scenario, Path(args.out), Path(args.data), progress=show,
                          closed_loop=getattr(args, "closed_loop", False), replicas=args.replicas,
                          report=args.report)
    print(summary(result, as_json=args.json))
    return 0


def summary(result: DemoResult, *, as_json: bool = False) -> str:
    """One screen: messages and rates, then every finding and recommendation, one line each."""
    if as_json:
        return orjson.dumps({
            "scenario": result.scenario, "messages": result.messages, "dead_letters": result.dead_letters,
            **({"stages": result.stages} if result.stages else {}),
            "wall_s": round(result.wall_s, 2), "publish_s": round(result.publish_s, 2),
            "detect_s": round(result.detect_s, 2), "messages_per_s": round(result.messages_per_s, 1),
            "findings": len(result.findings), "recommendations": len(result.recommendations),
            "findings_by_kind": dict(Counter(f.kind.value for f in result.findings)),
            "recommendations_by_action": dict(Counter(r.action.value for r in result.recommendations)),
            "out_dir": str(result.out_dir), "store_dir": str(result.store_dir),
            "scorecard": None if result.scorecard is None else result.scorecard.to_obj(),
            "report": None if result.report is None else str(result.report),
            **({"closed_loop": [r.to_obj() for r in result.closed_loop]} if result.closed_loop else {}),
        }).decode()
    lines = [
        f"scenario {result.scenario}: {result.messages} messages through Kafka -> detectors -> ClickHouse "
        f"in {result.wall_s:.1f} s ({result.messages_per_s:,.0f} messages/s; {result.dead_letters} dead-lettered)",
        "",
        f"findings ({len(result.findings)}):",
    ]
    for f in result.findings:
        where = f.node + ("" if f.gpu is None else f" gpu {f.gpu}") + ("" if f.rank is None else f" rank {f.rank}")
        extra = []
        if f.diagnosis is not None:
            extra.append(f.diagnosis.value)
        if f.slowdown is not None:
            extra.append(f"{100 * f.slowdown:+.1f}% slower")
        if f.probability is not None:
            extra.append(f"p={f.probability:.2f}")
        if f.step is not None:
            extra.append(f"step {f.step}")
        lines.append(f"  {f.kind.value:12s} {where:28s} {'  '.join(extra)}")
    acted = [r for r in result.recommendations if r.action.value != "none"]
    lines += ["", f"recommendations ({len(acted)}, plus {len(result.recommendations) - len(acted)} recorded as "
                  "'none': already decided, stale or not worth acting on):"]
    for r in acted:
        lines.append(f"  {r.action.value:16s} {r.node:8s} [{r.guard.value}] {r.reason}")
    if result.scorecard is not None:
        lines += ["", *result.scorecard.lines()]
    if result.closed_loop:
        lines += ["", f"closed loop ({'policy':12s}  goodput  ETTR   correct steps/accel-h  evictions):"]
        for r in result.closed_loop:
            lines.append(f"  {r.policy:24s} {r.goodput:7.3f} {r.ettr:6.3f} {r.correct_per_accel_hour:14.2f} "
                         f"{r.evictions:10d}")
    lines += ["", f"wrote {result.out_dir}/findings.jsonl, {result.out_dir}/recommendations.jsonl and "
                  f"{result.out_dir}/scorecard.json; "
                  f"query the store: fleethealth query \"SELECT kind, node, count() FROM findings GROUP BY ALL\" "
                  f"--data {result.store_dir.parent}"]
    if result.report is not None:
        lines.append(f"report: {result.report} ({result.report_s:.1f} s to render)")
    elif result.report_note:
        lines.append(f"no report.html: {result.report_note}")
    return "\n".join(lines)
