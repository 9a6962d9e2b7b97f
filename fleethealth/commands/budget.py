"""``fleethealth budget``: checkpoint-interval and reliability-budget arithmetic (seed 000 §6, seed 003)."""

from __future__ import annotations

import argparse
import sys

from fleethealth.commands._settings import add_config_flags, load_settings

__all__ = ["add"]


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("budget", help="checkpoint-interval and reliability-budget arithmetic",
                       description="Young/Daly checkpoint interval and overhead terms (seed 000 §6), the "
                                   "automatic interval from measured MTBF, and a baseline-vs-candidate "
                                   "reliability budget in charged accelerator-hours (seed 003).")
    bs = p.add_subparsers(dest="budget_command", metavar="SUBCOMMAND", required=True)
    yd = bs.add_parser("young-daly", help="optimal interval and the three overhead terms",
                       description="Give C, M and R, or --job ID to read them as measured from the store: the "
                                   "job's MTBF (pooled with the fleet's failure rate for its size), the mean time "
                                   "its saves blocked training and its measured restarts (policy.interval.* keys "
                                   "set the window and the estimator).")
    yd.add_argument("--checkpoint-s", type=float, default=None, metavar="C", help="checkpoint cost, seconds")
    yd.add_argument("--mtbf-h", type=float, default=None, metavar="M", help="job MTBF, hours")
    yd.add_argument("--restart-s", type=float, default=None, metavar="R", help="restart cost, seconds")
    yd.add_argument("--interval-s", type=float, default=None, metavar="T",
                    help="evaluate the terms at this interval (default: with --job the job's interval now, "
                         "else the optimum)")
    yd.add_argument("--job", default=None, metavar="ID", help="read C, M and R of this job from the store")
    yd.add_argument("--data", default="fleethealth-data", metavar="DIR",
                    help="with --job: the data directory of a demo or `fleethealth detect` (DIR/store; "
                         "default: %(default)s)")
    yd.add_argument("--store", default=None, metavar="DSN", help="with --job: a store DSN instead of DIR/store")
    yd.add_argument("--at", type=float, default=None, metavar="TS",
                    help="with --job: as it stood at this event time, epoch seconds (default: the job's newest step)")
    add_config_flags(yd)
    yd.add_argument("--json", action="store_true", help="print one JSON object")
    yd.set_defaults(run=run)
    iv = bs.add_parser("interval", help="automatic checkpoint interval from measured MTBF and checkpoint cost")
    iv.add_argument("--checkpoint-s", type=float, required=True, metavar="C", help="checkpoint cost, seconds")
    iv.add_argument("--mtbf-h", type=float, default=None, help="measured MTBF, hours")
    iv.add_argument("--interruptions", type=int, default=None, help="interruptions seen in the window")
    iv.add_argument("--window-h", type=float, default=None, help="length of that window, hours")
    iv.add_argument("--measured-gpus", type=int, default=None, help="GPU count the MTBF was measured at")
    iv.add_argument("--gpus", type=int, default=None, help="GPU count to plan for (MTBF scales as 1/GPUs)")
    iv.add_argument("--method", choices=("young", "daly"), default="young")
    iv.add_argument("--min-s", type=float, default=60.0, help="shortest interval allowed (default 60)")
    iv.add_argument("--max-s", type=float, default=6 * 3600.0, help="longest interval allowed (default 21600)")
    iv.add_argument("--json", action="store_true", help="print one JSON object")
    iv.set_defaults(run=run)
    cp = bs.add_parser("compare", help="price a baseline and a candidate design (seed 003 ledger)")
    cp.add_argument("file", help="budget YAML/JSON, e.g. fleethealth/scenarios/budget_seed003.yaml")
    cp.add_argument("--json", action="store_true", help="print one JSON object")
    cp.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import orjson

    from fleethealth.errors import ConfigError
    from fleethealth.policy import budget

    if args.budget_command == "young-daly" and args.job is not None:
        return _measured(args)
    if args.budget_command == "young-daly" and args.at is not None:
        raise ConfigError("--at goes with --job")
    if args.budget_command == "young-daly":
        missing = [f for f, v in (("--checkpoint-s", args.checkpoint_s), ("--mtbf-h", args.mtbf_h),
                                  ("--restart-s", args.restart_s)) if v is None]
        if missing:
            raise ConfigError(f"give {', '.join(missing)}, or --job ID to read the measured values from the store")
        result = budget.young_daly(args.checkpoint_s, args.mtbf_h * 3600.0, args.restart_s, args.interval_s)
    elif args.budget_command == "interval":
        mtbf_s = None if args.mtbf_h is None else args.mtbf_h * 3600.0
        window_s = None if args.window_h is None else args.window_h * 3600.0
        if (args.gpus is None) != (args.measured_gpus is None):
            raise ConfigError("give both --measured-gpus and --gpus to scale the MTBF, or neither")
        if args.gpus is not None:
            if mtbf_s is None:
                if args.interruptions is None or window_s is None:
                    raise ConfigError("give --mtbf-h, or --interruptions with --window-h")
                mtbf_s, _ = budget.measured_mtbf_s(args.interruptions, window_s)
            mtbf_s = budget.scale_mtbf(mtbf_s, args.measured_gpus, args.gpus)
        result = budget.auto_interval(args.checkpoint_s, mtbf_s=mtbf_s, interruptions=args.interruptions,
                                      window_s=window_s, method=args.method, min_s=args.min_s, max_s=args.max_s)
    else:
        result = budget.load_comparison(args.file)
    if args.json:
        sys.stdout.write(orjson.dumps(result.to_obj(), option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print(result.to_text())
    return 0


def _measured(args: argparse.Namespace) -> int:
    """``young-daly --job ID``: C, M and R as the store measured them (:mod:`fleethealth.policy.interval`)."""
    import orjson

    from fleethealth.commands._common import open_store_at, store_dsn
    from fleethealth.errors import ConfigError
    from fleethealth.policy import budget
    from fleethealth.policy.interval import IntervalEstimator, advise

    given = [f for f, v in (("--checkpoint-s", args.checkpoint_s), ("--mtbf-h", args.mtbf_h),
                            ("--restart-s", args.restart_s)) if v is not None]
    if given:
        raise ConfigError(f"--job reads C, M and R from the store; leave out {', '.join(given)}")
    estimator = IntervalEstimator(**load_settings(args).section("policy.interval", changed_only=True))
    with open_store_at(store_dsn(args.store, args.data), migrate=False) as store:
        advice = advise(store, args.job, estimator=estimator, at=args.at)
    if advice is None:
        raise ConfigError(f"the store holds no record of job {args.job!r}")
    result = budget.young_daly(max(advice.c_s, 1e-3), advice.mtbf_s, advice.r_s,
                               args.interval_s if args.interval_s is not None else advice.interval_s_now)
    if args.json:
        obj = {"job": args.job, **result.to_obj(), "checkpoint": advice.to_obj()}
        sys.stdout.write(orjson.dumps(obj, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print(advice.to_text())
        print(result.to_text())
    return 0
