"""An ``sdc`` finding's evidence: what the SDC detector writes, byte for byte, and reads back typed."""

from __future__ import annotations

import pytest

from fleethealth.detectors.sdc import SdcDetector
from fleethealth.errors import SchemaError
from fleethealth.payloads.checkpoint import CheckpointRecord, checkpoint_event
from fleethealth.payloads.sdc_check import CheckKind, Classification, SdcCheck, sdc_check_event
from fleethealth.payloads.sdc_evidence import SdcEvidence
from fleethealth.schema import encode


def _finding_from_the_detector():
    ck = checkpoint_event(ts=5.0, step=400, uri="ckpt://train-1/400", last_verified_step=350, node="n0000",
                          job="train-1")
    ok = sdc_check_event(ts=6.0, check="selfcheck", passed=True, digests=["ab", "ab"], node="n0001", job="train-1",
                         rank=8, gpu=0, step=350)
    bad = sdc_check_event(ts=7.0, check="replay", passed=False, classification="persistent",
                          digests=["0a1b", "ffee"], duration_s=0.4, peer_ranks=[3, 5], culprit_rank=1,
                          tolerance=1e-6, node="n0000", job="train-1", rank=1, gpu=1, step=500)
    (finding,) = SdcDetector().check([ck, ok, bad])
    return finding


def test_the_detector_writes_the_evidence_on_the_wire() -> None:
    assert encode(_finding_from_the_detector()) == (
        b'{"v":1,"id":"03d5d8a98fc83922c6cbfbfb","kind":"sdc","job":"train-1","node":"n0000","gpu":1,"rank":1,'
        b'"step":500,"ts":7.0,"diagnosis":null,"z":null,"slowdown":null,"probability":null,"detector":"sdc.replay",'
        b'"evidence":{"check":"replay","classification":"persistent","digests":["0a1b","ffee"],"duration_s":0.4,'
        b'"peer_ranks":[3,5],"culprit_rank":1,"tolerance":1e-6,"reporting_rank":1,"hardware":true,'
        b'"last_verified_step":350,"last_replay_step":null,"checkpoints":[{"step":400,"uri":"ckpt://train-1/400",'
        b'"last_verified_step":350,"last_replay_step":null}],"corroboration":{"by":[],"missing":"a single failing '
        b'check, and job train-1\'s step stream does not place rank 1 on n0000; a second failing check of the GPU '
        b'would support it","telemetry_age_s":null}},"episode_ts":7.0}')


def test_evidence_reads_back_typed() -> None:
    ev = SdcEvidence.from_evidence(_finding_from_the_detector().evidence)
    assert ev == SdcEvidence(
        record=SdcCheck(check=CheckKind.REPLAY, passed=False, classification=Classification.PERSISTENT,
                        digests=("0a1b", "ffee"), duration_s=0.4, peer_ranks=(3, 5), culprit_rank=1, tolerance=1e-6),
        reporting_rank=1, last_verified_step=350, checkpoints=(CheckpointRecord(400, "ckpt://train-1/400", 350),))
    assert ev.hardware
    assert SdcEvidence.from_evidence(ev.to_evidence()) == ev
    code = SdcEvidence(record=SdcCheck(check=CheckKind.REPLAY, passed=False,
                                       classification=Classification.DATA_OR_CODE),
                       reporting_rank=None, last_verified_step=None)
    assert not code.hardware and code.to_evidence()["hardware"] is False


@pytest.mark.parametrize(("change", "field"), [
    ({"check": "bisect"}, "check"),
    ({"reporting_rank": "1"}, "reporting_rank"),
    ({"last_verified_step": 3.5}, "last_verified_step"),
    ({"checkpoints": {"step": 1}}, "checkpoints"),
    ({"checkpoints": [{"uri": "u"}]}, "step"),
])
def test_bad_evidence_raises_naming_the_key(change: dict, field: str) -> None:
    evidence = {**_finding_from_the_detector().evidence, **change}
    with pytest.raises(SchemaError) as err:
        SdcEvidence.from_evidence(evidence)
    assert err.value.field == field
