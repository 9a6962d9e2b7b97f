"""The pure core of checkpoint validation (seed 000 §4, Failure 4): what was read → valid or why not.

No I/O, no torch: :mod:`fleethealth.injob.ckptcheck.files` reads a checkpoint into :class:`Facts`
and :func:`judge` decides. Four checks, each naming what is wrong:

1. **inventory** — every shard file the checkpoint's own metadata (DCP ``.metadata``) names is present
   and at least as long as the last byte the metadata places in it;
2. **digests** — every file the manifest written at save time lists is present, of that size, with
   that SHA-256 (digests confirm the files are what was written);
3. **test load** — the tensors load on the CPU into the model's state dict: every tensor the model
   expects is there, with its shape and dtype;
4. **norms** — each floating tensor's L2 norm is finite and inside the band of the job's previous
   valid checkpoints: at most ``norm_factor`` × the largest norm the tensor had there, and at least
   the smallest / ``norm_factor`` (a norm that jumped 100× fails although every digest matches:
   digests cannot tell that what was written was sane).

The band needs history: the first checkpoint of a job is judged on the first three checks and on
finite norms only, and the verdict notes that the band was not checked.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self

from fleethealth.errors import SchemaError

if TYPE_CHECKING:
    from fleethealth.payloads.validation import CheckpointValidation

__all__ = ["Band", "CheckpointRules", "Facts", "FileDigest", "Manifest", "TensorSpec", "Verdict", "judge",
           "MANIFEST_VERSION", "MAX_MANIFEST_ENTRIES"]

MANIFEST_VERSION = 1
MAX_MANIFEST_ENTRIES = 1_000_000
"""Files plus tensors one manifest may list; a longer one is refused before it is built."""
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_FORMATS = ("dcp", "torch_save")


def plain_name(name: object) -> bool:
    """A file name inside the checkpoint: no directory part, not ``.`` or ``..`` (nothing outside it)."""
    return (isinstance(name, str) and 0 < len(name) <= 255 and "/" not in name and "\\" not in name
            and "\0" not in name and name not in (".", ".."))


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's name (dotted path in the state dict), shape and dtype (``float32``, no ``torch.``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def describe(self) -> str:
        return f"{list(self.shape)} {self.dtype}"


@dataclass(frozen=True)
class FileDigest:
    """One file of a checkpoint: its name inside the checkpoint, size in bytes and SHA-256 (hex)."""

    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """What was written at save time: the files with their digests and the model's tensors.

    Written by the in-job helper after each save (``fleethealth-manifest.json`` inside a DCP
    directory, ``FILE.fleethealth-manifest.json`` beside a ``torch.save`` file)."""

    format: str
    files: tuple[FileDigest, ...]
    tensors: tuple[TensorSpec, ...] = ()
    step: int | None = None

    def to_obj(self) -> dict[str, Any]:
        return {"fleethealth_manifest": MANIFEST_VERSION, "format": self.format, "step": self.step,
                "files": [{"name": f.name, "bytes": f.size, "sha256": f.sha256} for f in self.files],
                "tensors": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype} for t in self.tensors]}

    @classmethod
    def from_obj(cls, obj: Any) -> Self:
        """Read a manifest strictly; :class:`SchemaError` names the first field that is wrong."""
        if not isinstance(obj, Mapping) or obj.get("fleethealth_manifest") != MANIFEST_VERSION:
            raise SchemaError("fleethealth_manifest", f"not a version {MANIFEST_VERSION} manifest")
        fmt, step = obj.get("format"), obj.get("step")
        if fmt not in _FORMATS:
            raise SchemaError("format", f"expected one of {list(_FORMATS)}, got {fmt!r}")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise SchemaError("step", f"expected a non-negative integer or null, got {step!r}")
        files, tensors = obj.get("files"), obj.get("tensors", [])
        if not isinstance(files, list) or not isinstance(tensors, list):
            raise SchemaError("files", "expected lists of files and tensors")
        if len(files) + len(tensors) > MAX_MANIFEST_ENTRIES:
            raise SchemaError("files", f"{len(files) + len(tensors)} entries, at most {MAX_MANIFEST_ENTRIES}")
        out_files = []
        for f in files:
            if not isinstance(f, Mapping) or not plain_name(f.get("name")):
                raise SchemaError("files", f"a file entry must name a file inside the checkpoint, got {f!r}")
            size, digest = f.get("bytes"), f.get("sha256")
            if isinstance(size, bool) or not isinstance(size, int) or size < 0 or not (
                    isinstance(digest, str) and _HEX64.match(digest)):
                raise SchemaError("files", f"{f['name']}: expected bytes >= 0 and a hex sha256, got {size!r}, "
                                           f"{digest!r}")
            out_files.append(FileDigest(f["name"], size, digest))
        out_tensors = []
        for t in tensors:
            shape = t.get("shape") if isinstance(t, Mapping) else None
            if (not isinstance(t, Mapping) or not isinstance(t.get("name"), str) or not isinstance(t.get("dtype"), str)
                    or not isinstance(shape, list)
                    or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
                raise SchemaError("tensors", f"expected name, shape (non-negative integers) and dtype, got {t!r}")
            out_tensors.append(TensorSpec(t["name"], tuple(shape), t["dtype"]))
        return cls(format=fmt, files=tuple(out_files), tensors=tuple(out_tensors), step=step)


@dataclass(frozen=True, kw_only=True)
class CheckpointRules:
    """The settings of the norm check (config table ``[checkpoint]``).

    ``norm_factor``: how far a tensor's norm may move from the band of the previous valid checkpoints
    (above the largest × factor or below the smallest / factor fails). ``norm_floor``: norms at or
    below it count as zero (a band of zeros allows up to ``norm_floor`` × factor; a falling norm is
    only judged when the band's smallest is above it). ``history``: how many previous valid
    checkpoints make the band (seed 000 keeps five). ``norm_skip``: comma-separated first name segments
    whose tensors are kept out of the band (optimizer state — Adam's step count and second moments —
    grows by design; its norms are still checked for finiteness)."""

    norm_factor: float = 10.0
    norm_floor: float = 1e-6
    history: int = 5
    norm_skip: str = "optim,optimizer"

    def banded(self, name: str) -> bool:
        """Whether the tensor ``name`` is judged against the band (its first segment not in ``norm_skip``)."""
        return name.split(".", 1)[0] not in {s.strip() for s in self.norm_skip.split(",") if s.strip()}

    def __post_init__(self) -> None:
        if not (isinstance(self.norm_factor, int | float) and math.isfinite(self.norm_factor)
                and self.norm_factor > 1.0):
            raise SchemaError("checkpoint.norm_factor", f"must be a finite number > 1, got {self.norm_factor!r}")
        if not isinstance(self.norm_skip, str):
            raise SchemaError("checkpoint.norm_skip", f"must be a comma-separated string, got {self.norm_skip!r}")
        if not (isinstance(self.norm_floor, int | float) and math.isfinite(self.norm_floor) and self.norm_floor >= 0):
            raise SchemaError("checkpoint.norm_floor", f"must be a finite number >= 0, got {self.norm_floor!r}")
        if isinstance(self.history, bool) or not isinstance(self.history, int) or self.history < 1:
            raise SchemaError("checkpoint.history", f"must be an integer >= 1, got {self.history!r}")


@dataclass(frozen=True)
class Band:
    """Per tensor, the smallest and largest norm over ``count`` previous valid checkpoints."""

    lo: Mapping[str, float] = field(default_factory=dict)
    hi: Mapping[str, float] = field(default_factory=dict)
    count: int = 0

    @classmethod
    def of(cls, history: Sequence[Mapping[str, float]]) -> Self:
        """The band of the norms of previous valid checkpoints (each a tensor name → norm map)."""
        lo: dict[str, float] = {}
        hi: dict[str, float] = {}
        for norms in history:
            for name, value in norms.items():
                if math.isfinite(value):
                    lo[name] = min(lo.get(name, value), value)
                    hi[name] = max(hi.get(name, value), value)
        return cls(lo, hi, len(history))

    @classmethod
    def of_records(cls, records: Sequence[CheckpointValidation], history: int) -> tuple[Self | None, list[int]]:
        """The band of a job's stored validation records (in event-time order: the newest record of a
        step wins), from the last ``history`` valid ones that carry norms; and their steps. ``None``
        when there is none."""
        newest = {r.step: r for r in records}
        kept = [newest[s] for s in sorted(newest) if newest[s].valid and newest[s].norms][-history:]
        if not kept:
            return None, []
        return cls.of([r.norms for r in kept]), [r.step for r in kept]


@dataclass(frozen=True)
class Facts:
    """What the I/O shell read from a checkpoint; ``None`` where a step could not run, with the reason
    in ``problems`` (a problem found while reading, e.g. a load that raised)."""

    format: str
    manifest: Manifest | None = None
    on_disk: Mapping[str, FileDigest] = field(default_factory=dict)
    needed: Mapping[str, int] = field(default_factory=dict)
    stored: Mapping[str, TensorSpec] | None = None
    norms: Mapping[str, float] = field(default_factory=dict)
    problems: tuple[str, ...] = ()
    manifest_problem: str | None = None
    """Why there is no manifest (absent, too large, unreadable), when there is none."""


@dataclass(frozen=True)
class Verdict:
    """Valid, or the reasons naming what is wrong; ``notes`` say what could not be checked (not a
    failure); ``norms`` are the tensor norms read (a valid verdict's feed the next band)."""

    valid: bool
    reasons: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    norms: Mapping[str, float] = field(default_factory=dict)

    def to_obj(self) -> dict[str, Any]:
        return {"valid": self.valid, "reasons": list(self.reasons), "notes": list(self.notes)}


def _inventory(needed: Mapping[str, int], on_disk: Mapping[str, FileDigest]) -> list[str]:
    out = []
    for name, length in sorted(needed.items()):
        have = on_disk.get(name)
        if have is None:
            out.append(f"shard {name} is missing (the checkpoint's metadata places tensors in it)")
        elif have.size < length:
            out.append(f"shard {name} is truncated: {have.size} bytes, the metadata needs {length}")
    return out


def _digests(manifest: Manifest, on_disk: Mapping[str, FileDigest]) -> list[str]:
    out = []
    for want in manifest.files:
        have = on_disk.get(want.name)
        if have is None:
            out.append(f"file {want.name} listed in the manifest is missing")
        elif have.size != want.size:
            out.append(f"file {want.name} is {have.size} bytes, the manifest says {want.size} (truncated or "
                       "rewritten since the save)")
        elif have.sha256 != want.sha256:
            out.append(f"file {want.name}: its SHA-256 differs from the manifest's (changed since the save: "
                       f"{have.sha256[:12]}… against {want.sha256[:12]}…)")
    return out


def _specs(expected: Mapping[str, TensorSpec], stored: Mapping[str, TensorSpec]) -> list[str]:
    out = []
    for name, want in sorted(expected.items()):
        have = stored.get(name)
        if have is None:
            out.append(f"tensor {name} ({want.describe()}) is not in the checkpoint")
        elif have.shape != want.shape:
            out.append(f"tensor {name} has shape {list(have.shape)} in the checkpoint, the model's is "
                       f"{list(want.shape)}")
        elif have.dtype != want.dtype:
            out.append(f"tensor {name} is {have.dtype} in the checkpoint, the model's is {want.dtype}")
    return out


def _norms(norms: Mapping[str, float], band: Band, rules: CheckpointRules) -> list[str]:
    out = []
    k = rules.norm_factor
    for name, value in sorted(norms.items()):
        if not math.isfinite(value):
            out.append(f"tensor {name} has a non-finite norm ({value})")
            continue
        lo, hi = band.lo.get(name), band.hi.get(name)
        if hi is None or lo is None or not rules.banded(name):
            continue
        top = k * max(hi, rules.norm_floor)
        if value > top:
            times = value / hi if hi > rules.norm_floor else math.inf
            out.append(f"tensor {name} norm {value:.4g} is {times:.3g}x the largest of the last {band.count} valid "
                       f"checkpoints ({hi:.4g}); at most {k:g}x is allowed")
        elif lo > rules.norm_floor and value < lo / k:
            out.append(f"tensor {name} norm {value:.4g} fell below 1/{k:g} of the smallest of the last {band.count} "
                       f"valid checkpoints ({lo:.4g})")
    return out


def judge(facts: Facts, expected: Mapping[str, TensorSpec] | None, band: Band | None,
          rules: CheckpointRules | None = None) -> Verdict:
    """Valid when every check passes. ``expected``: the model's tensors (default: the manifest's);
    ``band``: from the job's previous valid checkpoints (``None`` or empty: not checked, noted)."""
    rules = rules or CheckpointRules()
    reasons: list[str] = []
    notes = []
    if facts.manifest is None:
        reasons.append(facts.manifest_problem or "no manifest: the digests written at save time are unknown")
    else:
        reasons += _digests(facts.manifest, facts.on_disk)
    reasons += facts.problems
    reasons += _inventory(facts.needed, facts.on_disk)
    if expected is None and facts.manifest is not None and facts.manifest.tensors:
        expected = {t.name: t for t in facts.manifest.tensors}
    if facts.stored is not None:
        if expected:
            reasons += _specs(expected, facts.stored)
        else:
            notes.append("no model state dict to test the load against (shapes and dtypes not compared)")
    if band is None or band.count == 0:
        notes.append("no previous valid checkpoint: norms checked for finiteness only, no band")
    reasons += _norms(facts.norms, band or Band(), rules)
    return Verdict(valid=not reasons, reasons=tuple(dict.fromkeys(reasons)), notes=tuple(notes), norms=facts.norms)
