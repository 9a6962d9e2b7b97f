"""What the in-job library costs a DDP training step: off / timer / guard blocks interleaved in one
run (one JSON object).

Two gloo ranks on this machine's CPU train a small causal transformer (``--dim``, ``--layers``,
``--seq``, ``--batch``) under ``DistributedDataParallel``. Each rank runs rounds of three blocks of
``--block`` steps in a rotating order — no instrumentation, the existing ``StepTimer`` (compute
span around forward + backward and ``step_done``, datagrams to a socket a receiver thread of the
launcher drains, as the probe does), and ``SdcGuard`` at its default cadences (self-check every
100 steps, replay every 10,000: its start-up probe, calibration and step-0 replay run in a warm-up
block that is not counted) — so machine noise hits every mode alike. Per round each mode's mean
step time is compared with the same round's un-instrumented blocks, on each rank: wall time
(``timer_overhead``, ``guard_overhead``) and the rank process's CPU time (``*_cpu_overhead``, less
disturbed by other work on a loaded machine). The JSON gives the median fraction and its spread
(min, max, interquartile range) over both ranks' rounds, and whether the weights of the two ranks
stayed bitwise equal. ``guard_calls_cpu_fraction`` is the CPU time spent inside ``begin`` and
``after_backward`` per guard step (checks included) over the un-instrumented step's CPU time: the
guard's own work, without its hooks inside the backward.

    python bench/injob_overhead.py                 # ~2-4 min on 2 loaded cores
    python bench/injob_overhead.py --rounds 4      # quicker, wider spread

Target: ``guard_overhead`` <= 0.03 on CPU gloo.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

TARGET = 0.03
MODES = ("off", "timer", "guard")


def _model(vocab: int, seq: int, dim: int, layers: int):  # noqa: ANN202 - torch imported late
    import torch

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
            self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(),
                                           torch.nn.Linear(4 * dim, dim))

        def forward(self, x):  # noqa: ANN001, ANN202
            b, t, c = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, 4, c // 4).permute(2, 0, 3, 1, 4)
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
            return x + self.mlp(self.ln2(x))

    class GPT(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = torch.nn.Embedding(vocab, dim), torch.nn.Embedding(seq, dim)
            self.blocks = torch.nn.Sequential(*[Block() for _ in range(layers)])
            self.ln, self.head = torch.nn.LayerNorm(dim), torch.nn.Linear(dim, vocab)

        def forward(self, idx):  # noqa: ANN001, ANN202
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
            return self.head(self.ln(self.blocks(x)))

    return GPT()


def _worker(rank: int, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from fleethealth.injob.guard import SdcGuard
    from fleethealth.injob.reporter import Reporter
    from fleethealth.injob.timer import StepTimer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = _model(args.vocab, args.seq, args.dim, args.layers)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(rank)
    data = torch.randint(0, args.vocab, (64, args.batch, args.seq + 1), generator=gen)

    def loss_fn(module, batch):  # noqa: ANN001, ANN202
        x, y = batch
        logits = module(x)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, args.vocab), y.reshape(-1))

    # the guard's DDP hook and forward hook stay installed in every mode once it exists: build it
    # first (a job has it or not), so "off" means "no per-step calls", measured separately below
    sent: list[int] = []
    reporter = Reporter(job="bench", rank=rank, sink=lambda e: sent.append(1))
    guard = None
    timer = StepTimer("bench", rank, socket_path=args.socket, cuda=False)
    state = {"i": 0, "guard_step": 0, "inside": 0.0, "inside_steps": 0}

    def step(mode: str) -> None:
        i = state["i"]
        state["i"] += 1
        x = data[i % len(data)]
        batch = (x[:, :-1], x[:, 1:])
        if mode == "guard":
            g = state["guard_step"]
            state["guard_step"] += 1
            c0 = time.process_time()
            guard.begin(g)
            c1 = time.process_time()
            loss = loss_fn(ddp, batch)
            loss.backward()
            c2 = time.process_time()
            skip = guard.after_backward(g, batch, loss).skip_update
            state["inside"] += (c1 - c0) + (time.process_time() - c2)
            state["inside_steps"] += 1
            if not skip:
                opt.step()
        elif mode == "timer":
            with timer.compute(i):
                loss = loss_fn(ddp, batch)
                loss.backward()
            opt.step()
            timer.step_done(i)
        else:
            loss = loss_fn(ddp, batch)
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)

    def block(mode: str, n: int) -> tuple[float, float]:
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            step(mode)
        return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n

    for _ in range(args.warmup):
        step("off")
    guard = SdcGuard(ddp, loss_fn, reporter=reporter)  # default cadences
    step("guard")  # start-up probe, calibration, step 0's self-check and replay: once per job, not counted
    state["inside"], state["inside_steps"] = 0.0, 0
    rows = []
    for r in range(args.rounds):
        order = MODES[r % 3:] + MODES[:r % 3]
        rows.append({m: block(m, args.block) for m in order})
        print(f"rank {rank} round {r}: " + " ".join(f"{m} {rows[-1][m][0] * 1e3:.1f}/{rows[-1][m][1] * 1e3:.1f} ms"
                                                    for m in MODES), file=sys.stderr, flush=True)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    out = [None, None]
    dist.all_gather_object(out, {"rows": rows, "weights": digest, "checks": guard.checks_total,
                                 "guard_steps": state["guard_step"],
                                 "inside_ms": 1e3 * state["inside"] / max(1, state["inside_steps"]),
                                 "timer_drops": timer.stats.dropped_total})
    if rank == 0:
        Path(args.out).write_text(json.dumps(out))
    guard.close()
    dist.destroy_process_group()


def _drain(sock: socket.socket, stop: threading.Event, count: list[int]) -> None:
    sock.settimeout(0.2)
    while not stop.is_set():
        with contextlib.suppress(TimeoutError, OSError):
            sock.recv(65536)
            count[0] += 1


def _spread(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4),
            "max": round(max(values), 4), "iqr": round(q[2] - q[0], 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--block", type=int, default=25, help="steps per block")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--socket", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        _worker(args.worker, args)
        return
    tmp = Path(tempfile.mkdtemp(prefix="fh-injob-bench-"))
    sock_path = str(tmp / "probe.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    sock.bind(sock_path)
    stop, count = threading.Event(), [0]
    drain = threading.Thread(target=_drain, args=(sock, stop, count), daemon=True)
    drain.start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp / "out.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    passthrough = [f"--{k}={getattr(args, k)}" for k in ("rounds", "block", "warmup", "dim", "layers", "seq", "batch",
                                                         "vocab")]
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, __file__, f"--worker={r}", f"--port={port}", f"--socket={sock_path}",
                               f"--out={out}", *passthrough], env=env) for r in range(2)]
    codes = [p.wait() for p in procs]
    stop.set()
    drain.join()
    if any(codes):
        raise SystemExit(f"a rank failed: exit codes {codes}")
    ranks = json.loads(out.read_text())
    rows = [row for rank in ranks for row in rank["rows"]]  # both ranks' rounds
    fractions = {m: [row[m][0] / row["off"][0] - 1.0 for row in rows] for m in ("timer", "guard")}
    cpu = {m: [row[m][1] / row["off"][1] - 1.0 for row in rows] for m in ("timer", "guard")}
    base = [row["off"][0] for row in rows]
    print(json.dumps({
        "bench": "injob_overhead",
        "conditions": {"ranks": 2, "backend": "gloo", "device": "cpu", "threads_per_rank": 1,
                       "model": {k: getattr(args, k) for k in ("dim", "layers", "seq", "batch", "vocab")},
                       "params": None, "rounds": args.rounds, "block_steps": args.block,
                       "guard": "SdcGuard defaults (self-check every 100 steps, replay every 10,000; start-up and "
                                "step 0 not counted)",
                       "load_average": round(os.getloadavg()[0], 2)},
        "baseline_step_ms": _spread([b * 1e3 for b in base]),
        "baseline_cpu_ms": _spread([row["off"][1] * 1e3 for row in rows]),
        "timer_overhead": _spread(fractions["timer"]),
        "guard_overhead": _spread(fractions["guard"]),
        "timer_cpu_overhead": _spread(cpu["timer"]),
        "guard_cpu_overhead": _spread(cpu["guard"]),
        "guard_calls_cpu_ms": round(statistics.median(r["inside_ms"] for r in ranks), 3),
        "guard_calls_cpu_fraction": round(statistics.median(r["inside_ms"] for r in ranks)
                                          / statistics.median(row["off"][1] * 1e3 for row in rows), 4),
        "guard_checks_in_blocks": ranks[0]["checks"] - 2,
        "guard_steps": ranks[0]["guard_steps"],
        "timer_datagrams_received": count[0],
        "timer_drops": [r["timer_drops"] for r in ranks],
        "weights_equal_across_ranks": ranks[0]["weights"] == ranks[1]["weights"],
        "target_guard_overhead": TARGET,
        "meets_target": statistics.median(fractions["guard"]) <= TARGET,
        "wall_s": round(time.perf_counter() - t0, 1),
    }, indent=1))


if __name__ == "__main__":
    main()
