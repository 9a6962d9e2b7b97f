"""``fleethealth budget``: checkpoint-interval and reliability-budget arithmetic (seed 000 §6, seed 003)."""

from __future__ import annotations

import argparse
import sys

__all__ = ["add"]


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("budget", help="checkpoint-interval and reliability-budget arithmetic",
                       description="Young/Daly checkpoint interval and overhead terms (seed 000 §6), the "
                                   "automatic interval from measured MTBF, and a baseline-vs-candidate "
                                   "reliability budget in charged accelerator-hours (seed 003).")
    bs = p.add_subparsers(dest="budget_command", metavar="SUBCOMMAND", required=True)
    yd = bs.add_parser("young-daly", help="optimal interval and the three overhead terms")
    yd.add_argument("--checkpoint-s", type=float, required=True, metavar="C", help="checkpoint cost, seconds")
    yd.add_argument("--mtbf-h", type=float, required=True, metavar="M", help="job MTBF, hours")
    yd.add_argument("--restart-s", type=float, required=True, metavar="R", help="restart cost, seconds")
    yd.add_argument("--interval-s", type=float, default=None, metavar="T",
                    help="evaluate the terms at this interval (default: the optimum)")
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

    if args.budget_command == "young-daly":
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
