"""``fleethealth probe --source none`` on the real broker: a CPU box's relay, and the socket under floods.

The probe runs as a subprocess with no telemetry source; a trainer process sends 8 ranks' step
datagrams and one event through the in-job :class:`~fleethealth.injob.reporter.Reporter`. The
test reads ``fh.steps``, ``fh.events`` and ``fh.telemetry`` back: steps and the event arrive, and
no telemetry is invented. In the flood test, while the trainer runs, flooders of the probe's own
uid (the worst case: another uid is refused before its datagrams are queued) send rank datagrams
for a made-up job with a million ranks, 150 KB event datagrams, 60 KB events under made-up job
names and small events of one job, and a process of another uid floods too. The probe's peak
memory stays within a stated bound over its idle size, and the trainer's datagrams keep flowing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleethealth.broker import free_port
from fleethealth.bus import Consumer, ensure_topics
from fleethealth.schema import Event, EventKind, StepBatch, StepBlock, Telemetry

pytestmark = pytest.mark.slow

_TRAINER = """
import sys, time
from fleethealth.injob.reporter import Reporter
from fleethealth.schema import Event, EventKind
from fleethealth.wire import Sender
path, steps, pause = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
reporter = Reporter(job="cpu-job", rank=0, gpu=0, socket_path=path)
reporter.emit(Event(node="", ts=time.time(), kind=EventKind.SDC_CHECK, data={"check": "canary", "ok": True}))
sender = Sender(path)
for step in range(steps):
    for rank in range(8):
        sender.send({"t": "c", "job": "cpu-job", "rank": rank, "gpu": rank, "step": step, "s": 0.01,
                     "ts": time.time()})
    time.sleep(pause)
print(sender.sent_total, sender.dropped_total, reporter.sent_total)
"""

_FLOOD = """
import os, random, socket, sys, time
import orjson
path, kind, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
s.setblocking(False)
big = "x" * 150_000
mid = "y" * 60_000
end = time.monotonic() + seconds
n = 0
while time.monotonic() < end:
    n += 1
    if kind == "ranks":
        d = orjson.dumps({"t": "c", "job": "flood", "rank": random.randrange(1_000_000), "gpu": 0,
                          "step": n // 5000, "s": 0.01, "ts": 1.0})
    elif kind == "big":
        d = orjson.dumps({"t": "e", "event": {"kind": "sdc_check", "job": "flood", "message": big}})
    elif kind == "mid":
        d = orjson.dumps({"t": "e", "event": {"kind": "sdc_check", "job": f"made-up-{n}", "message": mid}})
    else:
        d = orjson.dumps({"t": "e", "event": {"kind": "sdc_check", "job": "flood-events", "message": "z"}})
    try:
        s.sendto(d, path)
    except OSError:
        pass
print(n)
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


def _rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of ``pid`` in KiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def _probe_counter(port: int, name: str) -> int:
    """One of the probe's own counters, read from its /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(f"fleethealth_probe_{name} "):
                return int(float(line.split()[1]))
    raise AssertionError(f"fleethealth_probe_{name} is not on the probe's /metrics")


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="fh-flood-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        for child in path.iterdir():
            child.unlink()
        path.rmdir()


def _start_probe(broker, sock: Path, tmp_path: Path, node: str, *extra: str) -> subprocess.Popen:
    probe = subprocess.Popen(
        [sys.executable, "-m", "fleethealth", "probe", "--source", "none", "--node", node, "--kafka", broker.dsn,
         "--socket", str(sock), "--spool-dir", str(tmp_path / "spool"), "--metrics-port", "0",
         "--interval", "0.2", "--step-timeout", "1.0", "--duration", "180", *extra],
        env=_env(), stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not sock.exists():
        if probe.poll() is not None or time.monotonic() > deadline:
            probe.kill()
            pytest.fail(f"the probe did not open its socket: {probe.communicate()[1]}")
        time.sleep(0.05)
    return probe


def _collect(broker, node: str, group: str, *, want: int, settle_s: float) -> tuple[dict, list, list]:
    """fh.steps ranks per step of cpu-job, the events and the telemetry of ``node``: read until
    ``want`` rank-steps arrived (then ``settle_s`` more, for anything extra), or 60 s passed."""
    ranks: dict[int, set[int]] = {}
    events: list[Event] = []
    telemetry: list[Telemetry] = []
    with Consumer(broker.dsn, ["fh.steps", "fh.events", "fh.telemetry"], group) as consumer:
        deadline = time.monotonic() + 60
        quiet_until = None
        while time.monotonic() < deadline:
            for rec in consumer.poll(timeout_s=0.5):
                msg = rec.msg
                if isinstance(msg, StepBatch | StepBlock) and msg.job == "cpu-job" and msg.node == node:
                    for batch in (msg.split() if isinstance(msg, StepBlock) else [msg]):
                        ranks.setdefault(batch.step, set()).update(batch.ranks.tolist())
                elif isinstance(msg, Event) and msg.node == node:
                    events.append(msg)
                elif isinstance(msg, Telemetry) and msg.node == node:
                    telemetry.append(msg)
            if quiet_until is None and sum(len(r) for r in ranks.values()) >= want:
                quiet_until = time.monotonic() + settle_s
            if quiet_until is not None and time.monotonic() > quiet_until:
                break
    return ranks, events, telemetry


def test_source_none_relays_steps_and_events_and_invents_no_telemetry(broker, tmp_path) -> None:
    ensure_topics(broker.dsn)
    sock = tmp_path / "run" / "probe.sock"
    port = free_port()
    probe = _start_probe(broker, sock, tmp_path, "cpu-0001", "--metrics-port", str(port))
    try:
        out = subprocess.run([sys.executable, "-c", _TRAINER, str(sock), "20", "0.02"], env=_env(),
                             capture_output=True, text=True, timeout=60, check=True)
        sent, dropped, events_sent = map(int, out.stdout.split())
        assert events_sent == 1 and sent + dropped == 160
        ranks, events, telemetry = _collect(broker, "cpu-0001", "none-relay", want=sent, settle_s=1.5)
        assert probe.poll() is None
        late = _probe_counter(port, "datagrams_late_total")
    finally:
        probe.terminate()
        _, err = probe.communicate(timeout=30)
    assert probe.returncode == 0, err
    # a loaded machine may deschedule the probe long enough for the kernel queue (10 here) to fill:
    # the trainer then keeps what waits and sends it later, or drops and counts; every datagram it did
    # send arrives, or came after its step went out at the timeout and is counted late
    assert sum(len(r) for r in ranks.values()) + late == sent and sent >= 80, (sent, dropped, late)
    assert [e.data.get("check") for e in events if e.kind is EventKind.SDC_CHECK] == ["canary"]
    assert events[0].job == "cpu-job"
    assert telemetry == []  # nothing invented: no fh.telemetry from a CPU box
    assert "source none" in err


def test_floods_stay_bounded_and_the_trainer_keeps_flowing(broker, shared_dir, tmp_path, send_as) -> None:

    ensure_topics(broker.dsn)
    sock = shared_dir / "probe.sock"
    # a job may have 16 ranks on this node here (the default, 256, takes longer to reach on a loaded machine)
    port = free_port()
    probe = _start_probe(broker, sock, tmp_path, "cpu-0002", "--set", "probe.socket_max_ranks=16",
                         "--metrics-port", str(port))
    try:
        time.sleep(1.0)  # the probe's idle size once its delivery and broker client are up
        idle_rss, _ = _rss_kib(probe.pid)
        seconds = 3.0
        flooders = [subprocess.Popen([sys.executable, "-c", _FLOOD, str(sock), kind, str(seconds)], env=_env(),
                                     stdout=subprocess.PIPE, text=True) for kind in ("ranks", "big", "mid", "small")]
        trainer = subprocess.Popen([sys.executable, "-c", _TRAINER, str(sock), "150", "0.02"], env=_env(),
                                   stdout=subprocess.PIPE, text=True)
        refused_at_send = sum(send_as(65534, 65534, sock) == "EACCES" for _ in range(20))
        flooded = [int(f.communicate(timeout=60)[0]) for f in flooders]
        sent, dropped, _ = map(int, trainer.communicate(timeout=120)[0].split())
        _, peak_rss = _rss_kib(probe.pid)
        ranks, events, _ = _collect(broker, "cpu-0002", "flood-relay", want=sent, settle_s=1.0)
        assert probe.poll() is None
        late = _probe_counter(port, "datagrams_late_total")
    finally:
        probe.terminate()
        _, err = probe.communicate(timeout=30)
    delivered = sum(len(r) for r in ranks.values())
    fraction = delivered / 1200
    growth_mib = (peak_rss - idle_rss) / 1024
    print(f"flood: {flooded} datagrams sent by the flooders; trainer sent {sent}, dropped {dropped}, "
          f"{late} datagrams late (the flood's made-up job's too), {delivered} of 1200 rank-steps delivered "
          f"({fraction:.3f}); probe idle {idle_rss / 1024:.0f} MiB, "
          f"peak {peak_rss / 1024:.0f} MiB (+{growth_mib:.0f} MiB)")
    assert refused_at_send == 20  # another uid never reaches the queue
    assert sum(flooded) > 10_000, flooded
    assert growth_mib < 64, f"the probe grew {growth_mib:.0f} MiB under the floods"
    # every datagram the trainer got into the kernel queue arrives, or is counted late: one that waited
    # in the trainer's backlog past the step timeout (1 s here) while the flood held the queue comes after
    # its step was emitted (3 of 380 in one run of the whole suite). How many it got in depends on how the
    # two cores are shared among four flooders, the trainer and the probe (0.87-0.97 of them with the
    # machine otherwise quiet, 0.30 in one run of the whole suite): the bound here says the flood never
    # starves it
    assert delivered <= sent and sent - delivered <= late, (delivered, sent, dropped, late)
    assert fraction >= 0.1, f"only {fraction:.3f} of the trainer's datagrams were delivered under the flood"
    limits = {e.data.get("limit") for e in events if e.kind is EventKind.PROBE_ERROR}
    assert {"events_per_s", "max_ranks"} <= limits, limits
    assert "further events are dropped" in err and "further ranks" in err  # logged, once each per job
    assert err.count("made-up") <= 1
