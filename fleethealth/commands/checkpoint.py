"""``fleethealth checkpoint validate``: whether a checkpoint can be resumed from (seed 000 §4, Failure 4)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from fleethealth.commands._settings import add_config_flags, add_setting, load_settings

if TYPE_CHECKING:
    from fleethealth.injob.ckptcheck.rules import Band, CheckpointRules

__all__ = ["add", "stored_band"]

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
                the band of the job's previous valid checkpoints: with --job and a store, the norms
                its checkpoint_validated records carry (the newest [checkpoint] history of them);
                when the store holds none, the --history checkpoints (each must be valid itself)

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
    v.add_argument("--job", metavar="ID", default=None,
                   help="the job whose stored checkpoint_validated records (with their norms) set the band; "
                        "--history is the fallback when the store holds none")
    add_setting(v, "--store", "store", metavar="DSN",
                help="the store to read the job's band from (else config key store or $FLEETHEALTH_STORE)")
    v.add_argument("--json", action="store_true", help="print one JSON object: path, valid, reasons, notes")
    add_config_flags(v)
    v.set_defaults(run=run)


def stored_band(dsn: str | None, job: str, rules: CheckpointRules) -> tuple[Band | None, str]:
    """The norm band of ``job``'s stored ``checkpoint_validated`` records (:meth:`Band.of_records`; a
    record that does not parse is left out and counted), and a note saying where the band came from;
    ``(None, note)`` when the store holds none (``--history`` then)."""
    from fleethealth.commands._common import open_store_at
    from fleethealth.errors import ConfigError, SchemaError
    from fleethealth.injob.ckptcheck.rules import Band
    from fleethealth.payloads.validation import CheckpointValidation
    from fleethealth.schema import EventKind

    if not dsn:
        raise ConfigError("--job needs a store: give --store DSN, config key store or FLEETHEALTH_STORE")
    with open_store_at(dsn) as store:
        events = store.events(kind=EventKind.CHECKPOINT_VALIDATED.value, job=job)
    records: list[CheckpointValidation] = []
    unreadable = 0
    for event in events:  # ordered by event time
        try:
            records.append(CheckpointValidation.from_event(event))
        except SchemaError:
            unreadable += 1
    band, steps = Band.of_records(records, rules.history)
    skipped = f"; {unreadable} unreadable record(s) left out" if unreadable else ""
    if band is None:
        return None, f"the store holds no valid checkpoint with norms for job {job}: band from --history{skipped}"
    return band, (f"band from the store: job {job}'s valid checkpoints at steps {', '.join(map(str, steps))}"
                  f"{skipped}")


def run(args: argparse.Namespace) -> int:
    import dataclasses
    import warnings

    import orjson

    from fleethealth.errors import SchemaError
    from fleethealth.injob.ckptcheck.files import validate
    from fleethealth.injob.ckptcheck.rules import CheckpointRules

    settings = load_settings(args)
    try:
        rules = CheckpointRules(**settings.section("checkpoint"))
    except SchemaError as exc:
        from fleethealth.errors import ConfigError

        raise ConfigError(str(exc)) from exc
    band, source = None, None
    if args.job is not None:
        band, source = stored_band(settings["store"], args.job, rules)
    # DCP warns that it loads in one process, which is the point here
    warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
    verdict = validate(args.path, history=[] if band is not None else args.history[-rules.history:], band=band,
                       rules=rules)
    if source is not None:
        verdict = dataclasses.replace(verdict, notes=(source, *verdict.notes))
    if args.json:
        sys.stdout.write(orjson.dumps({"path": args.path, **verdict.to_obj()}).decode() + "\n")
    else:
        print(f"{args.path}: {'valid' if verdict.valid else 'INVALID'}")
        for r in verdict.reasons:
            print(f"  invalid: {r}")
        for n in verdict.notes:
            print(f"  note: {n}")
    return 0 if verdict.valid else 1
