"""The ``sdc_check`` record: the builder validates, and it survives the schema codec unchanged."""

from __future__ import annotations

import pytest

from fleethealth.errors import SchemaError
from fleethealth.payloads.checkpoint import checkpoint_event
from fleethealth.payloads.sdc_check import CheckKind, Classification, SdcCheck, classify, sdc_check_event
from fleethealth.schema import Event, EventKind, decode, encode


def _replay_failure() -> Event:
    return sdc_check_event(ts=12.5, check="replay", passed=False, classification="persistent",
                           digests=["0a1b", "ffee"], duration_s=0.4, peer_ranks=[3, 5], culprit_rank=1,
                           tolerance=1e-6, job="train-1", rank=1, gpu=1, step=10_000)


def test_sdc_check_event_has_the_contract_keys_and_round_trips() -> None:
    e = _replay_failure()
    assert e.kind is EventKind.SDC_CHECK and e.rank == 1 and e.step == 10_000
    assert set(e.data) == {"check", "passed", "classification", "digests", "duration_s", "peer_ranks",
                           "culprit_rank", "tolerance"}
    assert "culprit rank 1" in e.message and "persistent" in e.message
    filled = Event(**{**e.__dict__, "node": "n0007"})
    back = decode(Event, encode(filled))
    rec = SdcCheck.from_event(back)
    assert rec == SdcCheck(check=CheckKind.REPLAY, passed=False, classification=Classification.PERSISTENT,
                           digests=("0a1b", "ffee"), duration_s=0.4, peer_ranks=(3, 5), culprit_rank=1,
                           tolerance=1e-6)


def test_the_wire_form_is_unchanged() -> None:
    """The bytes on the bus, as stored data and older readers hold them."""
    e = Event(**{**_replay_failure().__dict__, "node": "n0007"})
    assert encode(e) == (
        b'{"v":1,"node":"n0007","ts":12.5,"kind":"sdc_check","job":"train-1","gpu":1,"rank":1,"step":10000,'
        b'"code":null,"message":"replay FAILED (persistent), culprit rank 1","data":{"check":"replay",'
        b'"passed":false,"classification":"persistent","digests":["0a1b","ffee"],"duration_s":0.4,'
        b'"peer_ranks":[3,5],"culprit_rank":1,"tolerance":1e-6}}')


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"check": "bisect"}, "check"),
    ({"passed": "yes"}, "passed"),
    ({"classification": "cosmic"}, "classification"),
    ({"digests": ["xyz"]}, "digests"),
    ({"digests": "abcd"}, "digests"),
    ({"peer_ranks": [-1]}, "peer_ranks"),
    ({"culprit_rank": True}, "culprit_rank"),
    ({"tolerance": float("nan")}, "tolerance"),
    ({"duration_s": -1.0}, "duration_s"),
])
def test_bad_record_values_raise_naming_the_key(kwargs: dict, field: str) -> None:
    base = {"ts": 1.0, "check": "selfcheck", "passed": True}
    with pytest.raises(SchemaError) as err:
        sdc_check_event(**{**base, **kwargs})
    assert err.value.field == field


def test_reading_the_wrong_kind_is_an_error() -> None:
    with pytest.raises(SchemaError):
        SdcCheck.from_event(checkpoint_event(ts=1.0, step=600, uri="s3://ckpt/600", last_verified_step=500))


def test_classification_follows_the_rerun_logic() -> None:
    assert classify(False, None) is Classification.TRANSIENT
    assert classify(False, True) is Classification.TRANSIENT
    assert classify(True, False) is Classification.PERSISTENT
    assert classify(True, True) is Classification.DATA_OR_CODE
    assert classify(True, None) is None
