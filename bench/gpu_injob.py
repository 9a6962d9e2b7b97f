"""The CUDA path of the in-job SDC defence, on a real GPU (called by bench/gpu_check.sh; prints one JSON).

Checks, each a field of the output:

- ``digest_cross_device``: the digest of the same bits computed on the GPU equals the CPU's (the sums
  are exact modular integers, so this must hold for every dtype);
- ``bitflip_detected``: every bit position of float32 / bfloat16 / float16 elements, flipped on the
  GPU, changes the digest;
- ``selfcheck``: an SdcGuard on the GPU (dropout model, check every step) over ``--steps`` healthy
  steps: false alarms must be 0; one bit flipped in a training-pass gradient must be caught at
  its step, naming the parameter;
- ``nondeterminism``: a model with bilinear upsampling (no deterministic CUDA backward): the start-up
  probe should name the op torch reports and fall back to a tolerance, with a loud warning;
- ``cost``: digest-and-compare over one backward pass, and the step-time overhead of checks every
  100 steps, from bench/selfcheck_cost.py.

Exits 2 with one line on stderr when no CUDA device is present. ``--device cpu`` runs the same
script on a CPU (the cross-device check is then trivial) to exercise it without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA initialises cuBLAS

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import selfcheck_cost  # noqa: E402

from fleethealth.injob.digest import bit_digest  # noqa: E402
from fleethealth.injob.guard import NondeterminismWarning, SdcGuard  # noqa: E402
from fleethealth.injob.reporter import Reporter  # noqa: E402

_INT = {2: torch.int16, 4: torch.int32}


def _flip(t: torch.Tensor, index: int, bit: int) -> torch.Tensor:
    out = t.clone()
    bits = out.reshape(-1).view(_INT[out.element_size()])
    bits[index] ^= torch.iinfo(bits.dtype).min if bit == out.element_size() * 8 - 1 else 1 << bit
    return out


def digest_checks(device: torch.device) -> dict:
    gen = torch.Generator().manual_seed(0)
    cross = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        cpu = [torch.randn(3_000_017, generator=gen).to(dtype), torch.randn(129, 7, generator=gen).to(dtype)]
        cross[str(dtype)] = bit_digest(cpu) == bit_digest([t.to(device) for t in cpu])
    flips, missed = 0, []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = torch.randn(1_000_003, generator=gen).to(dtype).to(device)
        base = bit_digest([t])
        for bit in range(t.element_size() * 8):
            for index in (0, 517_331, t.numel() - 1):
                flips += 1
                if bit_digest([_flip(t, index, bit)]) == base:
                    missed.append((str(dtype), bit, index))
    return {"digest_cross_device": cross, "bitflip_trials": flips, "bitflip_missed": missed,
            "bitflip_detected": not missed}


def _loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def selfcheck_run(device: torch.device, steps: int, flip_step: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(1024, 256), torch.nn.LayerNorm(256),
                                torch.nn.Linear(256, 10)).to(device)
    events = []
    guard = SdcGuard(model, _loss, every=1, reporter=Reporter(job="gpu-check", rank=0, gpu=0, sink=events.append))
    state = {"step": -1, "training": False}

    def flip_hook(grad: torch.Tensor) -> torch.Tensor:
        if state["training"] and state["step"] == flip_step:
            return _flip(grad, 12_345, 3)
        return grad

    model[0].weight.register_hook(flip_hook)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator(device=device).manual_seed(1)
    t0 = time.perf_counter()
    for step in range(steps):
        batch = (torch.randn(512, 256, device=device, generator=gen),
                 torch.randint(0, 10, (512,), device=device, generator=gen))
        state["step"], state["training"] = step, True
        guard.begin(step)
        loss = _loss(model, batch)
        loss.backward()
        state["training"] = False
        if not guard.after_backward(step, batch, loss).skip_update:
            opt.step()
        opt.zero_grad()
    elapsed = time.perf_counter() - t0
    guard.close()
    failed = [(e.step, e.message) for e in events if not e.data["passed"]]
    return {"steps": steps, "checks": guard.checks_total, "deterministic": guard.startup_report.deterministic,
            "failed": failed, "false_alarms": len([f for f in failed if f[0] != flip_step]),
            "flip_caught": any(s == flip_step and "0.weight" in m for s, m in failed), "wall_s": elapsed}


class _UpsampleModel(torch.nn.Module):
    """Bilinear upsampling: its CUDA backward has no deterministic kernel (torch alerts and names it)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)
        self.out = torch.nn.Linear(256, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x).reshape(-1, 1, 8, 8)
        up = torch.nn.functional.interpolate(h, scale_factor=2, mode="bilinear", align_corners=False)
        return self.out(up.reshape(x.shape[0], -1))


def nondeterminism_probe(device: torch.device) -> dict:
    torch.manual_seed(0)
    model = _UpsampleModel().to(device)
    guard = SdcGuard(model, _loss, every=1, reporter=Reporter(rank=0, sink=lambda e: None))
    batch = (torch.randn(4096, 64, device=device), torch.randint(0, 4, (4096,), device=device))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = guard.startup(batch)
    guard.close()
    loud = [str(w.message) for w in caught if issubclass(w.category, NondeterminismWarning)]
    return {"nondeterministic_op": report.nondeterministic_op, "deterministic": report.deterministic,
            "mismatched": list(report.mismatched), "selfcheck_tolerance": report.selfcheck_tolerance,
            "warned": bool(loud)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_injob: no CUDA device (torch.cuda.is_available() is False); nothing to check", file=sys.stderr)
        return 2
    result: dict = {"bench": "gpu_injob", "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                    else "cpu", "torch": torch.__version__}
    result.update(digest_checks(device))
    result["selfcheck"] = selfcheck_run(device, args.steps, flip_step=args.steps // 2)
    result["nondeterminism"] = nondeterminism_probe(device)
    width = 1024 if device.type == "cuda" else 256
    tokens = [1024, 4096, 16384] if device.type == "cuda" else [256, 1024]
    result["cost"] = {
        "digest_fraction": [selfcheck_cost.digest_fraction(width, t, device) for t in tokens],
        "step_overhead": selfcheck_cost.step_overhead(width, tokens[0], device, steps=100, rounds=4, every=100)}
    sc = result["selfcheck"]
    result["ok"] = bool(all(result["digest_cross_device"].values()) and result["bitflip_detected"]
                        and sc["false_alarms"] == 0 and sc["flip_caught"])
    print(json.dumps(result, indent=2, default=str))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
