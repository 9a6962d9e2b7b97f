"""Shaped training loops on four CPU ranks (gloo), one rank slowed 30 % from a known step.

One launcher (``_shape_worker.py``) runs every shape — plain, DDP, FSDP2, gradient accumulation with
``no_sync``, DDP under bfloat16 autocast — in one process group; each step is reported twice, by
:func:`fleethealth.injob.instrument` and by a ``StepTimer`` span around forward + backward (the old
placement). The ranks send to a real probe socket read by the probe's own listener and step
aggregator, as ``fleethealth probe`` does. The work is a known sleep in each rank's forward and
backward (rank 1's forward sleeps 12 ms more from step ``ONSET``: 40 ms of compute becomes 52 ms),
so the spans do not depend on how loaded this machine is; the statistics are per-rank lower
20th percentiles over the steps after the onset, which scheduling delays (they only add time) barely move.

- The instrumented spans show rank 1, and only rank 1, in every shape.
- Forward + backward under DDP and FSDP does not separate the ranks: every rank's span includes the
  wait for the slowest (it does in the plain loop, whose all-reduce is outside the span).
- End to end, the probe's step batches go through the embedded broker to ``fleethealth detect`` and
  chDB: the straggler is found on rank 1 and no other rank is flagged; under the old placement
  nothing is found. ``detect.straggler.min_group`` (8 by default, a job of fewer comparable ranks
  is not scored) is set to 4 here so a 4-rank job is scored.
"""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from fleethealth.wire import parse

sys.path.insert(0, str(Path(__file__).parent))
import _shape_worker as W  # noqa: E402

from fleethealth.broker import free_port

WORKER = Path(__file__).with_name("_shape_worker.py")
WORLD, STEPS, PREFIX, NODE = 4, 32, "shape-", "node-a"
SHAPES = ("plain", "ddp", "fsdp", "accum", "amp")
SLOW, OTHERS = W.SLOW_RANK, [r for r in range(WORLD) if r != W.SLOW_RANK]
QUANTILE = 0.2
"""Scheduling delays only ever add time: a low quantile of a rank's spans is its compute."""
APART, ALIKE = 1.15, 1.10
"""Rank 1 is 30 % slower: it must be more than APART times the slowest other rank; healthy ranks
within ALIKE of each other (at load average 28 on two cores, a healthy rank's span moves by up to ~8 %)."""


class _Probe:
    """The node probe's receiving half: its datagram listener and step aggregator, on a thread."""

    def __init__(self, path: str) -> None:
        from fleethealth.probe.aggregator import StepAggregator
        from fleethealth.probe.daemon import DatagramListener

        self.listener = DatagramListener(path)
        self.aggregator = StepAggregator(NODE)
        self.datagrams: list[bytes] = []
        self.batches: list[object] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shape-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self.listener, selectors.EVENT_READ)
            while not self._stop.is_set():
                sel.select(timeout=0.1)
                now = time.monotonic()
                for datagram in self.listener.receive():
                    self.datagrams.append(datagram)
                    self.aggregator.feed(datagram, now, time.time())
                self.batches.extend(self.aggregator.drain(now).batches)

    def settle(self, timeout_s: float) -> None:
        """Until the aggregator has emitted every step (early steps wait for its learning timeout)."""
        deadline = time.monotonic() + timeout_s
        while self.aggregator.stats.open_steps:
            if time.monotonic() > deadline:
                raise AssertionError(f"the probe still holds {self.aggregator.stats.open_steps} steps after "
                                     f"{timeout_s:.0f} s")
            time.sleep(0.05)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self.listener.close()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    sock = str(tmp_path_factory.mktemp("probe") / "probe.sock")
    probe = _Probe(sock)
    try:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("FLEETHEALTH_SOCKET", None)
        done = subprocess.run([sys.executable, str(WORKER), str(WORLD), str(free_port()), sock, PREFIX,
                               ",".join(SHAPES), str(STEPS)], capture_output=True, text=True, timeout=240, env=env)
        assert done.returncode == 0, done.stderr[-4000:]
        probe.settle(30.0)
    finally:
        probe.close()
    spans: dict[str, np.ndarray] = {}
    by_job: dict[str, dict[tuple[int, int], float]] = {}
    for datagram in probe.datagrams:
        msg = parse(datagram)
        if msg.kind == "c":
            by_job.setdefault(msg.job, {})[(msg.rank, msg.step)] = msg.value
    for job, values in by_job.items():
        got = np.full((WORLD, STEPS), np.nan)
        for (rank, step), s in values.items():
            got[rank, step] = s
        if np.isnan(got).mean() > 0.1:  # the kernel queues 10 datagrams a socket here; a stalled reader drops
            raise AssertionError(f"{job}: {int(np.isnan(got).sum())} of {got.size} spans missing")
        spans[job] = got
    return spans, probe.batches


def _after(spans: np.ndarray) -> np.ndarray:
    """Each rank's 20th-percentile span over the steps from two after the onset."""
    return np.nanquantile(spans[:, W.ONSET + 2:], QUANTILE, axis=1)


def _before(spans: np.ndarray) -> np.ndarray:
    return np.nanquantile(spans[:, 2:W.ONSET], QUANTILE, axis=1)


@pytest.mark.parametrize("shape", SHAPES)
def test_instrumented_spans_show_the_slowed_rank_and_only_it(run, shape: str) -> None:
    spans = run[0][PREFIX + shape]
    after, before = _after(spans), _before(spans)
    ms = np.round(after * 1000, 1).tolist()
    assert after[SLOW] / after[OTHERS].max() > APART, f"{shape}: rank {SLOW} not separated, spans (ms) {ms}"
    assert after[OTHERS].max() / after[OTHERS].min() < ALIKE, f"{shape}: healthy ranks apart, spans (ms) {ms}"
    assert before.max() / before.min() < ALIKE, f"{shape}: apart before the onset: {np.round(before * 1e3, 1).tolist()}"


@pytest.mark.parametrize("shape", ["ddp", "fsdp", "accum", "amp"])
def test_forward_backward_spans_do_not_separate_the_ranks_under_ddp_and_fsdp(run, shape: str) -> None:
    """The old placement: the collective inside backward (and FSDP's all-gathers inside forward) puts
    the wait for rank 1 into every rank's span, so rank 1 does not stand out."""
    after = _after(run[0][PREFIX + shape + "-fwdbwd"])
    ms = np.round(after * 1000, 1).tolist()
    assert after[SLOW] / after[OTHERS].max() < 1.05, f"{shape}: rank {SLOW} stands out, spans (ms) {ms}"


def test_forward_backward_spans_are_right_in_a_plain_loop(run) -> None:
    """The placement was right only where the all-reduce runs after the span (a hand-rolled loop)."""
    after = _after(run[0][PREFIX + "plain-fwdbwd"])
    assert after[SLOW] / after[OTHERS].max() > APART


def test_end_to_end_the_detectors_find_the_straggler_and_no_other_rank(run, broker, tmp_path) -> None:
    """The probe's batches of the DDP and FSDP jobs, both placements, through the embedded broker to
    ``fleethealth detect`` and chDB (``detect.straggler.min_group=4`` so a 4-rank job is scored)."""
    from fleethealth.bus import Producer, ensure_topics
    from fleethealth.store import open_store

    jobs = [PREFIX + s + suffix for s in ("ddp", "fsdp") for suffix in ("", "-fwdbwd")]
    batches = [b for b in run[1] if b.job in jobs]
    for job in jobs:
        assert len({b.step for b in batches if b.job == job}) >= 0.9 * STEPS, f"{job}: steps missing"
    rows = sum(b.ranks.size for b in batches)
    ensure_topics(broker.dsn)
    with Producer(broker.dsn, event_time_stamps=True) as producer:
        for batch in sorted(batches, key=lambda b: b.ts):
            producer.publish(batch)
        producer.flush()
    store = f"chdb://{tmp_path}/store"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETHEALTH_")}
    detect = subprocess.run([sys.executable, "-m", "fleethealth", "detect", "--kafka", broker.dsn, "--store", store,
                             "--group", "fh-shapes", "--metrics-port", "0", "--until-caught-up", "--migrate",
                             "--set", "detect.straggler.min_group=4"],
                            capture_output=True, text=True, timeout=180, env=env)
    assert detect.returncode == 0, detect.stderr[-4000:]
    with open_store(store) as s:
        assert s.query(f"SELECT count() FROM rank_steps FINAL WHERE job LIKE '{PREFIX}%'").rows[0][0] == rows
        found = {j: [(f.rank, f.step) for f in s.findings(kind="straggler", job=j)] for j in jobs}
    for shape in ("ddp", "fsdp"):
        hits = found[PREFIX + shape]
        assert hits and {r for r, _ in hits} == {SLOW}, f"{shape}: straggler findings {hits}"
        assert all(step >= W.ONSET for _, step in hits), f"{shape}: found before the onset: {hits}"
        assert not found[PREFIX + shape + "-fwdbwd"], f"{shape}, forward+backward: {found[PREFIX + shape + '-fwdbwd']}"
