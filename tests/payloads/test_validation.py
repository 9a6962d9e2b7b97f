"""The checkpoint_validated payload and the rollback rule's admissible checkpoints."""

from __future__ import annotations

import pytest

from fleethealth.errors import SchemaError
from fleethealth.payloads.rollback import Marks, admissible, choose
from fleethealth.payloads.validation import (
    MAX_REASONS,
    CheckpointValidation,
    ValidationResult,
    checkpoint_validated_event,
)
from fleethealth.schema import Event, EventKind, decode, encode, is_job_event


def test_the_event_round_trips_and_is_keyed_by_job():
    ev = checkpoint_validated_event(ts=1.0, step=40, uri="/ck/40", result="invalid",
                                    reasons=["shard __1_0.distcp is missing"], job="j", duration_s=0.5,
                                    node="gpu-a17")
    back = decode(Event, encode(ev))
    assert back.kind is EventKind.CHECKPOINT_VALIDATED and is_job_event(back)
    rec = CheckpointValidation.from_event(back)
    assert rec == CheckpointValidation(40, "/ck/40", ValidationResult.INVALID, ("shard __1_0.distcp is missing",), 0.5)
    assert not rec.valid and "shard __1_0.distcp is missing" in back.message


@pytest.mark.parametrize(("result", "reasons", "field"), [
    ("valid", ["but why"], "reasons"), ("invalid", [], "reasons"), ("fine", [], "result")])
def test_a_result_and_its_reasons_must_agree(result, reasons, field):
    with pytest.raises(SchemaError) as err:
        checkpoint_validated_event(ts=1.0, step=1, uri="u", result=result, reasons=reasons)
    assert err.value.field == field


def test_reasons_are_bounded_for_one_datagram():
    ev = checkpoint_validated_event(ts=1.0, step=1, uri="u", result="invalid", reasons=["x" * 1000] * 50)
    reasons = ev.data["reasons"]
    assert len(reasons) == MAX_REASONS and reasons[-1] == f"and {50 - MAX_REASONS + 1} more problems"
    assert all(len(r) <= 300 for r in reasons)


def test_from_data_names_the_bad_field():
    with pytest.raises(SchemaError) as err:
        CheckpointValidation.from_data({"step": -1, "result": "valid"})
    assert err.value.field == "step"


def test_admissible_only_validated_once_a_job_validates():
    book = [100, 200, 300]
    assert admissible(book, None) == ([100, 200, 300], [])
    assert admissible(book, {}) == ([100, 200, 300], [])
    assert admissible(book, {100: True, 300: False}) == ([100], [200, 300])
    assert admissible(book, {}, require_validation=True) == ([], [100, 200, 300])


def test_choose_skips_an_invalid_checkpoint_but_keeps_its_marks():
    marks = [Marks(transient=300, deterministic=300)]
    assert choose([100, 200, 300], marks, "transient", 400)[2] == 300
    merged, bound, target = choose([100, 200, 300], marks, "transient", 400, validity={100: True, 200: True,
                                                                                        300: False})
    assert (merged.transient, bound, target) == (300, 300, 200)
