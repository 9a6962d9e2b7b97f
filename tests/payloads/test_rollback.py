"""The rollback rule (seed 000 R6): the newest checkpoint at or before the last passing check."""

from __future__ import annotations

from fleethealth.payloads.checkpoint import CheckpointRecord
from fleethealth.payloads.rollback import rollback_target


def test_rollback_target_is_the_newest_checkpoint_at_or_before_the_last_pass() -> None:
    ckpts = [408, 816, 1224, 1632, 2040]
    assert rollback_target(ckpts, 1000) == 816
    assert rollback_target(ckpts, 1224) == 1224
    assert rollback_target(list(reversed(ckpts)), 2100) == 2040
    assert rollback_target(ckpts, 100) is None
    assert rollback_target(ckpts, None) is None
    records = [CheckpointRecord(s, f"ckpt://{s}", None) for s in ckpts]
    assert rollback_target(records, 1700).uri == "ckpt://1632"
