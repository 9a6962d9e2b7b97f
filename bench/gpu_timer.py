"""The CUDA path of ``fleethealth.injob.instrument`` on a real GPU (called by bench/gpu_check.sh; prints one JSON).

Checks, each a field of the output:

- ``clock``: ``cuda_events`` on a GPU (``perf_counter`` with ``--device cpu``);
- ``host_syncs``: calls to ``torch.cuda.synchronize``, ``Event.synchronize`` and
  ``Stream.synchronize`` made while the training loop ran with the timer — must be 0 (the bench
  itself synchronises only after the loop, to flush);
- ``plain``: a model whose forward runs ``--work`` extra matmuls on every third step: the spans of
  those steps against the others (``slow_ratio``, expected near the work ratio measured with host
  synchronisation in the same run, ``expected_ratio``), and each span against the synchronised
  host time of the same forward + backward (``agree``: median ratio within 25 %);
- ``accumulation``: three micro-steps per step give three times one micro-step's span (within 25 %);
- ``ddp``: the same model under ``DistributedDataParallel`` in a one-rank NCCL group (gloo on the
  CPU): ``method`` is ``ddp`` and the spans agree with the plain ones within 25 %.

Exits 2 with one line on stderr when no CUDA device is present. ``--device cpu`` runs the same
script on a CPU to exercise it without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time

import numpy as np
import torch

from fleethealth.injob.instrument import instrument
from fleethealth.wire import parse

WIDTH = 2048


class _Model(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width
        self.a = torch.nn.Linear(width, width)
        self.b = torch.nn.Linear(width, width)
        self.extra = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        for _ in range(self.extra):
            h = torch.tanh(self.b(h))
        return self.b(h)


class _Syncs:
    """Count host synchronisations while active."""

    def __init__(self) -> None:
        self.count = 0
        self._saved: list[tuple[object, str, object]] = []

    def __enter__(self) -> _Syncs:
        if not torch.cuda.is_available():
            return self
        for owner, name in ((torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"),
                            (torch.cuda.Stream, "synchronize")):
            original = getattr(owner, name)
            self._saved.append((owner, name, original))

            def counted(*a: object, _original: object = original, **k: object) -> object:
                self.count += 1
                return _original(*a, **k)  # type: ignore[operator]

            setattr(owner, name, counted)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in self._saved:
            setattr(owner, name, original)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _receive(sock: socket.socket, out: dict[int, float] | None = None) -> dict[int, float]:
    out = {} if out is None else out
    while True:
        try:
            msg = parse(sock.recv(65536))
        except BlockingIOError:
            return out
        if msg.kind == "c":
            out[msg.step] = msg.value


def _run(model: torch.nn.Module, inner: _Model, device: torch.device, path: str, sock: socket.socket,
         steps: int, work: int, micro: int = 1) -> tuple[dict[int, float], str, str, int]:
    x = torch.randn(256, inner.width, device=device)
    timed = instrument(model, job="gpu-timer", rank=0, gpu=0, socket_path=path, log=False)
    got: dict[int, float] = {}
    with _Syncs() as syncs:
        for step in range(steps):
            inner.extra = work if step % 3 == 2 else 0
            for _ in range(micro):
                model(x).square().mean().backward()
            timed.step_done(step)
            _receive(sock, got)  # the probe's side, read as it goes
    _sync(device)
    timed.flush()
    timed.close()
    return _receive(sock, got), timed.method, timed.clock, syncs.count


def _host_time(model: torch.nn.Module, inner: _Model, device: torch.device, extra: int, reps: int = 10) -> float:
    x = torch.randn(256, inner.width, device=device)
    inner.extra = extra
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--work", type=int, default=8, help="extra matmuls on every third step")
    ap.add_argument("--width", type=int, default=WIDTH, help="layer width (a CPU run wants a smaller one)")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_timer: no CUDA device (torch.cuda.is_available() is False); nothing to check", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    tmp = tempfile.mkdtemp(prefix="fh-gpu-timer-")
    path = os.path.join(tmp, "probe.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.setblocking(False)
    model = _Model(args.width).to(device)
    result: dict = {"bench": "gpu_timer", "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                    else "cpu", "torch": torch.__version__}
    fast, slow = _host_time(model, model, device, 0), _host_time(model, model, device, args.work)
    spans, method, clock, syncs = _run(model, model, device, path, sock, args.steps, args.work)
    steps = sorted(s for s in spans if s >= 3)
    heavy = [spans[s] for s in steps if s % 3 == 2]
    light = [spans[s] for s in steps if s % 3 != 2]
    plain = {"method": method, "spans": len(spans), "steps": args.steps,
             "slow_ratio": float(np.median(heavy) / np.median(light)), "expected_ratio": slow / fast,
             "host_fast_s": fast, "host_slow_s": slow, "span_fast_s": float(np.median(light))}
    plain["agree"] = bool(abs(plain["span_fast_s"] / fast - 1.0) < 0.25
                          and abs(plain["slow_ratio"] / plain["expected_ratio"] - 1.0) < 0.25)
    result.update(clock=clock, host_syncs=syncs, plain=plain)
    acc, _, _, acc_syncs = _run(model, model, device, path, sock, 12, 0, micro=3)
    acc_span = float(np.median([acc[s] for s in acc if s >= 3 and s % 3 != 2]))
    result["accumulation"] = {"span_s": acc_span, "ratio_to_one": acc_span / plain["span_fast_s"],
                              "ok": abs(acc_span / (3 * plain["span_fast_s"]) - 1.0) < 0.25}
    result["host_syncs"] += acc_syncs
    import torch.distributed as dist

    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{tmp}/pg", rank=0,
                            world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        dspans, dmethod, _, dsyncs = _run(ddp, model, device, path, sock, 30, args.work)
    finally:
        dist.destroy_process_group()
    d_fast = float(np.median([dspans[s] for s in dspans if s >= 3 and s % 3 != 2]))
    result["ddp"] = {"method": dmethod, "span_fast_s": d_fast, "ok": dmethod == "ddp"
                     and abs(d_fast / plain["span_fast_s"] - 1.0) < 0.25}
    result["host_syncs"] += dsyncs
    result["ok"] = bool(result["host_syncs"] == 0 and plain["agree"] and len(spans) == args.steps
                        and result["accumulation"]["ok"] and result["ddp"]["ok"]
                        and (device.type != "cuda" or clock == "cuda_events"))
    sock.close()
    print(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
