"""``fleethealth checkpoint validate``: whether a checkpoint can be resumed from (seed 000 §4, Failure 4)."""

from __future__ import annotations

import argparse
import sys

from fleethealth.commands._settings import add_config_flags, load_settings

__all__ = ["add"]

_DESCRIPTION = """\
Validate a torch.distributed.checkpoint (DCP) directory or a torch.save file before resuming from it:

  1. inventory  every shard the checkpoint's .metadata names is present and long enough
  2. digests    every file's SHA-256 equals the manifest written at save time by the in-job
                validator (fleethealth.injob.ckptcheck: DIR/fleethealth-manifest.json, or
                FILE.fleethealth-manifest.json beside a file)
  3. test load  the tensors load on the CPU into the shapes and dtypes the manifest recorded from
                the model's state dict (nothing goes to a GPU; .metadata is read only when its
                digest matches the manifest, files with torch.load(weights_only=True))
  4. norms      each tensor's norm is finite and within [checkpoint] norm_factor (default 10x) of
                the band the --history checkpoints set (each must be valid itself)

exit status: 0 valid, 1 invalid (each reason printed), 2 unusable input (no such checkpoint, a
history checkpoint that is not valid, a bad setting)."""


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("checkpoint", help="validate a checkpoint before resuming from it",
                       description="Checkpoints validated before anyone resumes from them (seed 000 §4).")
    cs = p.add_subparsers(dest="checkpoint_command", metavar="SUBCOMMAND", required=True)
    v = cs.add_parser("validate", help="shards, digests, a CPU test load and norms; exit 0 valid, 1 invalid, "
                                       "2 unusable", description=_DESCRIPTION,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    v.add_argument("path", metavar="PATH", help="a DCP checkpoint directory or a torch.save file")
    v.add_argument("--history", metavar="PREVIOUS", nargs="+", default=[],
                   help="the job's previous valid checkpoints, which set the norm band (the newest "
                        "[checkpoint] history of them count); without them norms are checked for finiteness only")
    v.add_argument("--json", action="store_true", help="print one JSON object: path, valid, reasons, notes")
    add_config_flags(v)
    v.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import warnings

    import orjson

    from fleethealth.errors import SchemaError
    from fleethealth.injob.ckptcheck.files import validate
    from fleethealth.injob.ckptcheck.rules import CheckpointRules

    try:
        rules = CheckpointRules(**load_settings(args).section("checkpoint"))
    except SchemaError as exc:
        from fleethealth.errors import ConfigError

        raise ConfigError(str(exc)) from exc
    # DCP warns that it loads in one process, which is the point here
    warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
    verdict = validate(args.path, history=args.history[-rules.history:], rules=rules)
    if args.json:
        sys.stdout.write(orjson.dumps({"path": args.path, **verdict.to_obj()}).decode() + "\n")
    else:
        print(f"{args.path}: {'valid' if verdict.valid else 'INVALID'}")
        for r in verdict.reasons:
            print(f"  invalid: {r}")
        for n in verdict.notes:
            print(f"  note: {n}")
    return 0 if verdict.valid else 1
