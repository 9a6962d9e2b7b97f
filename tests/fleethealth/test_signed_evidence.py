"""Issue 23 §3 through the real broker and ``fleethealth detect``: a compromised node's messages about
other nodes remove nobody and do not trip the breaker; genuine signed ones still act.

One timeline is published to a real broker: eight reporting nodes (``gpu-a00`` … ``gpu-a07``), each
signing its telemetry with its own key; a compromised node ``evil`` holding only its own key sends an
Xid 79 for a node that never reported, an unsigned Xid for a reporting node, a failed persistent
``sdc_check`` for another node, a 20-node Xid storm and a passing self-test for another node; then two
genuine faults: ``gpu-a05`` loses GPU 1 (Xid 79, the GPU reads NaN after it) and ``gpu-a06`` counts
uncorrectable ECC errors in two samples. ``fleethealth detect --until-caught-up`` reads it twice: with
``signing.mode = require`` (the forgeries are dead-lettered with the reason) and with signing off
(corroboration alone holds them for a human).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fleethealth.bus import Consumer, Producer, ensure_topics
from fleethealth.schema import Event, EventKind, Telemetry
from fleethealth.signing import Signer

SECRET = bytes(range(32))
GOOD = [f"gpu-a{i:02d}" for i in range(8)]
STORM = [f"gpu-b{i:02d}" for i in range(20)]


def _sample(node: str, ts: float, *, lost: int | None = None, dbe: float = 0.0) -> Telemetry:
    temp, power = np.full(4, 50.0), np.full(4, 300.0)
    if lost is not None:
        temp[lost] = power[lost] = np.nan
    # each node its own rack: two genuine drains in one rack would wait for a human (the same-rack rule)
    return Telemetry.from_columns(node, f"rack-{node}", ts, np.arange(4), temp_c=temp, power_w=power,
                                  ecc_dbe_volatile=np.array([0.0, dbe, 0.0, 0.0]))


def _xid(node: str, ts: float, gpu: int = 1) -> Event:
    return Event(node=node, ts=ts, kind=EventKind.XID, gpu=gpu, code=79, message="GPU has fallen off the bus")


def _publish(dsn: str) -> None:
    producers = {n: Producer(dsn, event_time_stamps=True, signer=Signer.for_node(SECRET, n)) for n in [*GOOD, "evil"]}
    unsigned = Producer(dsn, event_time_stamps=True)
    evil = producers["evil"]
    try:
        for k in range(120):
            ts = 1000.0 + k
            for node in GOOD:
                lost = 1 if node == "gpu-a05" and ts > 1080 else None
                dbe = 2.0 if node == "gpu-a06" and ts >= 1090 else 0.0
                producers[node].publish(_sample(node, ts, lost=lost, dbe=dbe))
            if k == 10:  # the compromised node's forgeries, all about other nodes
                evil.publish(_xid("gpu-ghost", ts + 0.5))
                unsigned.publish(_xid("gpu-a01", ts + 0.5))
                evil.publish(Event(node="gpu-a02", ts=ts + 0.5, kind=EventKind.SDC_CHECK, job="train-x", gpu=3,
                                   rank=19, step=400, data={"check": "replay", "passed": False,
                                                            "classification": "persistent", "culprit_rank": 19,
                                                            "digests": ["aa", "bb"]}))
                evil.publish(Event(node="gpu-a03", ts=ts + 0.5, kind=EventKind.SELFTEST,
                                   message="gemm on cuda:0: pass", data={"suite": "full", "verdict": "pass"}))
            if k == 20:
                for node in STORM:
                    evil.publish(_xid(node, ts + 0.5, gpu=0))
            if k == 80:  # genuine: gpu-a05's GPU 1 falls off the bus
                producers["gpu-a05"].publish(_xid("gpu-a05", ts + 0.5))
        for p in [*producers.values(), unsigned]:
            p.flush()
    finally:
        for p in [*producers.values(), unsigned]:
            p.close()


def _detect(dsn: str, store: str, group: str, secret_file: Path, mode: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "fleethealth", "detect", "--kafka", dsn, "--store", store, "--group", group,
            "--metrics-port", "0", "--until-caught-up", "--migrate", "--set", f"signing.mode={mode}",
            "--set", f"signing.fleet_secret_file={secret_file}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETHEALTH_")}
    return subprocess.run(argv, capture_output=True, text=True, timeout=240, env=env)


def _recommendations(store: str) -> list[tuple[str, str, str]]:
    from fleethealth.store import open_store

    with open_store(store) as s:
        rows = s.query("SELECT action, node, guard FROM recommendations FINAL ORDER BY ts, node").rows
        breaker = s.query("SELECT open FROM breaker FINAL").rows
    return [tuple(r) for r in rows], [r[0] for r in breaker]



@pytest.fixture
def broker():
    """A broker of this test's own: the session's holds other tests' records, which a group reading
    from the beginning would take as this test's (and, under signing.mode = require, dead-letter)."""
    from fleethealth.broker import EmbeddedBroker

    with EmbeddedBroker() as running:
        yield running


def _dead_letters(dsn: str, want: int) -> list[tuple[str, str]]:
    """(key, reason) of every dead letter, polled until ``want`` arrived (bounded)."""
    out: list[tuple[str, str]] = []
    with Consumer(dsn, ["fh.deadletter"], "t-deadletters", client_id="t-deadletters") as c:
        deadline = time.monotonic() + 30.0
        while len(out) < want and time.monotonic() < deadline:
            out += [(r.msg.key, r.msg.reason) for r in c.poll(timeout_s=1.0)]
    return out


@pytest.mark.slow
def test_forged_evidence_removes_nobody_and_genuine_signed_faults_act(broker, tmp_path: Path) -> None:
    ensure_topics(broker.dsn, partitions=4)
    _publish(broker.dsn)
    secret_file = tmp_path / "fleet-secret"
    secret_file.write_text(SECRET.hex())

    # signing required: every forgery is dead-lettered, naming why
    required = f"chdb://{tmp_path}/required"
    run = _detect(broker.dsn, required, "fh-require", secret_file, "require")
    assert run.returncode == 0, run.stderr
    letters = _dead_letters(broker.dsn, 24)
    reasons = {key: reason for key, reason in letters}
    assert len(letters) == 24, letters
    assert "signed by node 'evil'" in reasons["gpu-ghost"] and "body names node 'gpu-ghost'" in reasons["gpu-ghost"]
    assert "unsigned record" in reasons["gpu-a01"]
    assert "signed by node 'evil'" in reasons["train-x"] and "signed by node 'evil'" in reasons["gpu-a03"]
    assert all("signed by node 'evil'" in reasons[n] for n in STORM)
    recs, breaker = _recommendations(required)
    removing = [r for r in recs if r[0] in ("drain", "evict", "quarantine")]
    assert removing == [("drain", "gpu-a05", "allowed"), ("drain", "gpu-a06", "allowed")], recs
    assert not any(breaker)

    # signing off: corroboration alone holds every forgery for a human, and the breaker stays closed
    unsigned = f"chdb://{tmp_path}/unsigned"
    run = _detect(broker.dsn, unsigned, "fh-off", secret_file, "off")
    assert run.returncode == 0, run.stderr
    recs, breaker = _recommendations(unsigned)
    allowed = [r for r in recs if r[0] in ("drain", "evict", "quarantine") and r[2] == "allowed"]
    held = {(a, n) for a, n, g in recs if a in ("drain", "evict", "quarantine") and g == "needs_human"}
    assert allowed == [("drain", "gpu-a05", "allowed"), ("drain", "gpu-a06", "allowed")], recs
    assert held == {("drain", "gpu-ghost"), ("drain", "gpu-a01"), ("quarantine", "gpu-a02")} | {
        ("drain", n) for n in STORM}, recs
    assert not any(breaker) and not [r for r in recs if r[0] == "page"]
