"""fleethealth.signing: HKDF keys per node, signatures in headers, and the consumer's verdicts per mode."""

from __future__ import annotations

import pytest

from fleethealth import schema
from fleethealth.errors import ConfigError
from fleethealth.schema import Event, EventKind
from fleethealth.signing import KeyRing, Signer, Verifier, hkdf_sha256, node_key

SECRET = b"s" * 32


def test_hkdf_matches_rfc5869_case_1():
    okm = hkdf_sha256(bytes([0x0B] * 22), bytes(range(0xF0, 0xFA)), salt=bytes(range(13)), length=42)
    assert okm.hex() == ("3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf"
                         "34007208d5b887185865")


def test_each_node_has_its_own_key():
    assert node_key(SECRET, "gpu-a01") != node_key(SECRET, "gpu-a02")
    assert node_key(SECRET, "gpu-a01") == node_key(SECRET, "gpu-a01")
    with pytest.raises(ConfigError):
        node_key(b"short", "gpu-a01")


def _signed(signer: Signer | None, msg: Event, topic: str = "fh.events") -> tuple:
    value, key = schema.encode(msg), msg.key.encode()
    return topic, key, value, (signer.headers(topic, key, value) if signer else None), msg


def test_verdicts_by_mode():
    ring = KeyRing(fleet_secret=SECRET)
    own = Event(node="gpu-a01", ts=1.0, kind=EventKind.XID, gpu=0, code=79)
    other = Event(node="gpu-a02", ts=1.0, kind=EventKind.XID, gpu=0, code=79)
    signer = Signer.for_node(SECRET, "gpu-a01")
    require, verify = Verifier("require", ring), Verifier("verify", ring)
    assert require.check(*_signed(signer, own)) is None
    assert "body names node 'gpu-a02'" in require.check(*_signed(signer, other))
    assert "unsigned" in require.check(*_signed(None, own))
    assert verify.check(*_signed(None, own)) is None and verify.unsigned_total == 1
    assert "body names node" in verify.check(*_signed(signer, other))  # a mismatch is refused in verify too
    topic, key, value, headers, msg = _signed(signer, own)
    assert "bad signature" in require.check(topic, key, value.replace(b"79", b"48"), headers, msg)
    assert "bad signature" in require.check("fh.telemetry", key, value, headers, msg)  # bound to its topic
    forged = Signer("gpu-a01", node_key(b"x" * 32, "gpu-a01"))  # the right name, another fleet's key
    assert "bad signature" in require.check(*_signed(forged, own))
    assert Verifier("off").check(*_signed(None, other)) is None
    assert require.check("fh.findings", b"k", b"{}", None, own) is None  # detectors' own topics: Kafka ACLs


def test_a_service_signs_only_service_kinds():
    ring = KeyRing(fleet_secret=SECRET)
    svc = Signer.for_service(SECRET, "detect")
    stop = Event(node="gpu-a09", ts=1.0, kind=EventKind.INTERRUPTION, job="j")
    xid = Event(node="gpu-a09", ts=1.0, kind=EventKind.XID, gpu=0, code=79)
    v = Verifier("require", ring)
    assert v.check(*_signed(svc, stop)) is None
    assert "may sign only" in v.check(*_signed(svc, xid))
    assert "may not sign" in v.check(*_signed(Signer.for_node(SECRET, "gpu-a09"), stop))


def test_a_key_directory_instead_of_the_secret(tmp_path):
    (tmp_path / "gpu-a01").write_text(node_key(SECRET, "gpu-a01").hex())
    v = Verifier("require", KeyRing(key_dir=tmp_path))
    own = Event(node="gpu-a01", ts=1.0, kind=EventKind.XID, gpu=0, code=79)
    assert v.check(*_signed(Signer.for_node(SECRET, "gpu-a01"), own)) is None
    stranger = Event(node="gpu-a02", ts=1.0, kind=EventKind.XID, gpu=0, code=79)
    assert "unknown signer 'gpu-a02'" in v.check(*_signed(Signer.for_node(SECRET, "gpu-a02"), stranger))
    with pytest.raises(ConfigError, match="needs signing"):
        Verifier("require")


def test_delivery_signs_every_record_it_hands_over(tmp_path):
    from fleethealth.probe.delivery import Delivery
    from fleethealth.probe.spool import Spool

    sent = []

    class _Producer:
        def publish_raw(self, topic, value, key=None, *, headers=None):
            sent.append((topic, key, value, headers))

        def flush(self, timeout_s=0.0):
            pass

    d = Delivery("kafka://x:1", Spool(tmp_path), producer_factory=lambda dsn: _Producer(), node="gpu-a01",
                 signer=Signer.for_node(SECRET, "gpu-a01"))
    ev = Event(node="gpu-a01", ts=1.0, kind=EventKind.XID, gpu=0, code=79)
    d.submit(ev)
    assert d.step(force=True) == 1
    ((topic, key, value, headers),) = sent
    assert Verifier("require", KeyRing(fleet_secret=SECRET)).check(topic, key, value, headers, ev) is None


def test_the_probe_hands_its_node_key_to_its_delivery(tmp_path):
    from fleethealth.probe.daemon import Probe, ProbeConfig, make_source

    signer = Signer.for_node(SECRET, "n0001")
    config = ProbeConfig(node="n0001", socket_path=None, spool_dir=str(tmp_path / "spool"), metrics_port=None)
    probe = Probe(make_source("sim", node="n0001", rack="r00", interval_s=1.0, scenario=None, dcgm_host="x"),
                  config, dsn="kafka://127.0.0.1:1", signer=signer)
    try:
        assert probe.delivery.signer is signer
    finally:
        probe.delivery.spool.close()
