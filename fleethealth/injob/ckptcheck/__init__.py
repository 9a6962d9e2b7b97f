"""Checkpoints validated before anyone resumes from them (seed 000 §4, Failure 4).

- :mod:`~fleethealth.injob.ckptcheck.rules` — the pure core: :class:`Facts` read from a checkpoint →
  :func:`judge` → :class:`Verdict` (valid, or reasons naming what is wrong); the norm band's settings
  :class:`CheckpointRules` (config table ``[checkpoint]``); the digest :class:`Manifest`. Torch-free.
- :mod:`~fleethealth.injob.ckptcheck.files` — the I/O shell (torch): :func:`read_facts`,
  :func:`write_manifest`, :func:`validate` for DCP directories and ``torch.save`` files, on the CPU.
- :mod:`~fleethealth.injob.ckptcheck.background` — :class:`CheckpointValidator`: the in-job call after
  each save, validating in a background thread and reporting ``checkpoint_validated`` events.

``fleethealth checkpoint validate PATH`` runs the same validation from the command line.
"""

from __future__ import annotations

from fleethealth.lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "Band": "rules",
    "CheckpointRules": "rules",
    "Facts": "rules",
    "FileDigest": "rules",
    "Manifest": "rules",
    "TensorSpec": "rules",
    "Verdict": "rules",
    "judge": "rules",
    "CheckpointUnusable": "files",
    "MANIFEST_NAME": "files",
    "manifest_path": "files",
    "read_facts": "files",
    "spec_of": "spec",
    "validate": "files",
    "write_manifest": "files",
    "CheckpointValidator": "background",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
