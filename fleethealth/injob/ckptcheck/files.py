"""The I/O shell of checkpoint validation: reads a checkpoint into :class:`~.rules.Facts`, writes the
digest manifest. Everything is read on the CPU; nothing is loaded onto a GPU.

Two formats:

* a ``torch.distributed.checkpoint`` (DCP) **directory**: ``.metadata`` and the shard files it names.
  ``.metadata`` is read with DCP's own reader, which unpickles it, so it is read only when the
  manifest vouches for it (its SHA-256 matches); the test load goes through ``dcp.load`` into CPU
  tensors of the model's shapes with a planner that refuses non-tensor items (DCP's default planner
  unpickles those with ``weights_only=False``);
* a plain ``torch.save`` **file**, loaded with ``torch.load(..., weights_only=True, map_location="cpu")``.

Tensor names are dotted paths into the saved object (``model.0.weight``, ``optim.state.0.exp_avg``),
as DCP flattens them, so both formats and the model's state dict meet on the same names.

The manifest (:class:`~.rules.Manifest`) is JSON: ``fleethealth-manifest.json`` inside a DCP
directory, ``FILE.fleethealth-manifest.json`` beside a file. :func:`write_manifest` writes it from the
files as they are on disk right after the save (and the model's tensor shapes and dtypes), atomically.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner

from fleethealth.errors import ConfigError, SchemaError
from fleethealth.injob.ckptcheck.rules import (
    Band,
    CheckpointRules,
    Facts,
    FileDigest,
    Manifest,
    TensorSpec,
    Verdict,
    judge,
    plain_name,
)
from fleethealth.injob.ckptcheck.spec import dtype_name, flat_tensors, spec_of

__all__ = ["CheckpointUnusable", "MANIFEST_NAME", "manifest_path", "read_facts", "spec_of", "validate",
           "write_manifest", "norms_of"]

MANIFEST_NAME = "fleethealth-manifest.json"
MAX_MANIFEST_BYTES = 64 << 20
_METADATA = ".metadata"
_CHUNK = 1 << 20


class CheckpointUnusable(ConfigError):
    """The path is no checkpoint at all (absent, neither a DCP directory nor a file): nothing to judge."""


def kind_of(path: Path) -> str:
    """``dcp`` or ``torch_save``; :class:`CheckpointUnusable` when the path is neither."""
    if path.is_dir():
        if (path / _METADATA).exists() or (path / MANIFEST_NAME).exists():
            return "dcp"
        raise CheckpointUnusable(f"{path} is a directory with neither a DCP .metadata nor a {MANIFEST_NAME}: "
                                 "not a checkpoint")
    if path.is_file():
        return "torch_save"
    raise CheckpointUnusable(f"{path} does not exist or is not a file or directory")


def manifest_path(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    return p / MANIFEST_NAME if p.is_dir() else p.with_name(p.name + "." + MANIFEST_NAME)


def _sha256(path: Path) -> FileDigest:
    h = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return FileDigest(path.name, size, h.hexdigest())


def _files(path: Path, fmt: str) -> dict[str, FileDigest]:
    if fmt == "torch_save":
        return {path.name: _sha256(path)}
    return {p.name: _sha256(p) for p in sorted(path.iterdir()) if p.is_file() and p.name != MANIFEST_NAME}


def _only(on_disk: Mapping[str, FileDigest]) -> tuple[int, str]:
    (digest,) = on_disk.values()
    return digest.size, digest.sha256


def write_manifest(path: str | os.PathLike[str], expected: Mapping[str, TensorSpec] | None = None, *,
                   step: int | None = None) -> Manifest:
    """Digest the checkpoint's files as they are now and write the manifest (temporary file, then rename).
    ``expected``: the model's tensors (:func:`spec_of` of the state that was saved)."""
    p = Path(path)
    fmt = kind_of(p)
    manifest = Manifest(format=fmt, files=tuple(_files(p, fmt).values()),
                        tensors=tuple((expected or {}).values()), step=step)
    target = manifest_path(p)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(manifest.to_obj()))
    os.replace(tmp, target)
    return manifest


def _read_manifest(path: Path) -> tuple[Manifest | None, str | None]:
    mp = manifest_path(path)
    if not mp.is_file():
        return None, f"no manifest ({mp.name}): the digests written at save time are unknown"
    if mp.stat().st_size > MAX_MANIFEST_BYTES:
        return None, f"manifest {mp.name} is over {MAX_MANIFEST_BYTES} bytes: refused"
    try:
        return Manifest.from_obj(json.loads(mp.read_bytes())), None
    except (ValueError, SchemaError) as exc:
        return None, f"manifest {mp.name} is unreadable: {exc}"


class _TensorsOnly(DefaultLoadPlanner):
    """DCP's default planner, refusing the non-tensor items it would unpickle."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        raise SchemaError("checkpoint", f"{read_item.dest_index.fqn} is not a tensor: not loaded")


def _norm(t: torch.Tensor) -> float | None:
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return None
    return float(torch.linalg.vector_norm(t.detach().to("cpu", torch.float64 if t.is_floating_point()
                                                         else torch.complex128)))


def _dcp_facts(path: Path, manifest: Manifest | None, on_disk: Mapping[str, FileDigest],
               expected: Mapping[str, TensorSpec] | None, load: bool) -> Facts:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    problems: list[str] = []
    meta = on_disk.get(_METADATA)
    vouched = manifest is not None and any(f.name == _METADATA and meta is not None and f.sha256 == meta.sha256
                                           for f in manifest.files)
    if meta is None:
        return Facts("dcp", manifest, on_disk, problems=("the DCP .metadata file is missing",))
    if not vouched:
        why = "no manifest vouches for it" if manifest is None else "its digest does not match the manifest's"
        return Facts("dcp", manifest, on_disk, problems=(f".metadata not read: {why} (DCP's reader unpickles it)",))
    try:
        md = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # a file the manifest vouched for and DCP still cannot read
        return Facts("dcp", manifest, on_disk, problems=(f".metadata unreadable by DCP: {exc}",))
    needed: dict[str, int] = {}
    for info in md.storage_data.values():
        if not plain_name(info.relative_path):
            problems.append(f".metadata names a shard outside the checkpoint: {info.relative_path!r}")
            continue
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), int(info.offset) + int(info.length))
    stored = {name: TensorSpec(name, tuple(int(d) for d in m.size), dtype_name(m.properties.dtype))
              for name, m in md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    facts = Facts("dcp", manifest, on_disk, needed, stored, problems=tuple(problems))
    missing = [n for n, length in needed.items() if n not in on_disk or on_disk[n].size < length]
    if not load or missing or problems:
        return facts
    want = expected if expected else stored
    target = {n: torch.empty(s.shape, dtype=getattr(torch, s.dtype)) for n, s in want.items()
              if n in stored and stored[n].shape == s.shape and stored[n].dtype == s.dtype}
    try:
        dcp.load(target, checkpoint_id=str(path), planner=_TensorsOnly(), no_dist=True)
    except Exception as exc:  # DCP raises many kinds on a damaged shard; each is a failed test load
        return Facts("dcp", manifest, on_disk, needed, stored,
                     problems=(f"test load failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}",))
    norms = {n: v for n, t in target.items() if (v := _norm(t)) is not None}
    return Facts("dcp", manifest, on_disk, needed, stored, norms)


def _file_facts(path: Path, manifest: Manifest | None, on_disk: Mapping[str, FileDigest], load: bool) -> Facts:
    if not load:
        return Facts("torch_save", manifest, on_disk)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many kinds on a truncated or garbled file
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        return Facts("torch_save", manifest, on_disk,
                     problems=(f"test load failed: {type(exc).__name__}: {first}",))
    tensors = dict(flat_tensors(obj))
    stored = {n: TensorSpec(n, tuple(int(d) for d in t.shape), dtype_name(t.dtype)) for n, t in tensors.items()}
    norms = {n: v for n, t in tensors.items() if (v := _norm(t)) is not None}
    return Facts("torch_save", manifest, on_disk, stored=stored, norms=norms)


def read_facts(path: str | os.PathLike[str], expected: Mapping[str, TensorSpec] | None = None, *,
               load: bool = True) -> Facts:
    """Read a checkpoint: its manifest, its files' digests, its metadata and (``load``) a test load on
    the CPU with each floating tensor's norm. Raises :class:`CheckpointUnusable` only when the path is
    no checkpoint; every other problem is a fact for :func:`~.rules.judge`."""
    p = Path(path)
    fmt = kind_of(p)
    manifest, problem = _read_manifest(p)
    on_disk = _files(p, fmt)
    if fmt == "torch_save" and manifest is not None and len(manifest.files) == 1:
        # one file: the manifest beside it speaks for it under whatever name it was copied to
        on_disk = {manifest.files[0].name: FileDigest(manifest.files[0].name, *_only(on_disk))}
    if not expected and manifest is not None:
        expected = {t.name: t for t in manifest.tensors}
    facts = (_dcp_facts(p, manifest, on_disk, expected, load) if fmt == "dcp"
             else _file_facts(p, manifest, on_disk, load))
    problems = facts.problems
    if manifest is not None and manifest.format != fmt:
        problems = (*problems, f"the manifest describes a {manifest.format} checkpoint, this is {fmt}")
    return dataclasses.replace(facts, problems=problems, manifest_problem=problem)


def norms_of(path: str | os.PathLike[str], rules: CheckpointRules | None = None) -> dict[str, float]:
    """The tensor norms of a previous checkpoint that sets the band; :class:`CheckpointUnusable` when it
    is not valid itself (a band from a bad checkpoint would pass bad ones)."""
    verdict = judge(read_facts(path), None, None, rules)
    if not verdict.valid:
        raise CheckpointUnusable(f"history checkpoint {path} is not valid: {'; '.join(verdict.reasons)}")
    return dict(verdict.norms)


def validate(path: str | os.PathLike[str], *, expected: Mapping[str, TensorSpec] | None = None,
             history: Sequence[str | os.PathLike[str]] = (), band: Band | None = None,
             rules: CheckpointRules | None = None) -> Verdict:
    """Validate one checkpoint. ``expected``: the model's tensors (default: the manifest's); the norm
    band from ``band``, else from the ``history`` checkpoints (each validated first)."""
    if band is None and history:
        band = Band.of([norms_of(h, rules) for h in history])
    return judge(read_facts(path, expected), expected, band, rules)
