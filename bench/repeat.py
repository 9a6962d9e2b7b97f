"""Run one pytest node id N times in a row, each in a fresh subprocess, optionally beside CPU-heavy load.

A race shows under some timings only: a test that passed once says little. This runs the same test
``--runs`` times (each ``python -m pytest -q -x NODEID`` in a process of its own, so no state is shared
between runs but the machine) and, with ``--load N``, beside N busy processes it starts itself (each
spins on one core until the last run ends). The load average is sampled before the runs and after
each, since the machine may be loaded by others as well.

Prints one JSON object: ``test``, ``runs``, ``passed``, ``failed``, ``failures`` (per failed run its
number and the first lines that say why: the assertion's ``E`` lines or pytest's summary line),
``seconds`` (each run's wall time) and ``load`` (the busy processes started and the 1-minute load
average before and after the runs, and its highest sample). With ``--show TEXT``, ``shown`` holds per run
the output lines that contain TEXT (a test's own ``print``: run it with ``-- -s``).

    python bench/repeat.py NODEID --runs 20 [--load 2] [--keep DIR] [--stop-on-fail] [--show TEXT] [-- PYTEST_ARGS]

    NODEID e.g. tests/detectors/test_runner.py::test_killed_between_every_write_and_publish_no_recommendation_is_lost
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUSY = "while True:\n    pass\n"


def why(output: str, lines: int = 6) -> list[str]:
    """The first lines of a failed run's output that say why: pytest's ``E`` lines (the assertion and
    its values), else its ``FAILED``/``ERROR`` summary lines, else the output's last lines."""
    text = output.splitlines()
    picked = [line.strip() for line in text if line.startswith("E ")]
    if not picked:
        picked = [line.strip() for line in text if line.startswith(("FAILED", "ERROR"))]
    if not picked:
        picked = [line.strip() for line in text[-lines:]]
    return [line[:300] for line in picked[:lines]]


def run_once(node: str, timeout_s: float, extra: list[str]) -> tuple[bool, float, str]:
    """One run of ``node`` in a fresh interpreter: (passed, seconds, output). Each run has a temporary
    folder of its own (``--basetemp``), removed afterwards, so no run spends its time deleting the
    folders other pytest runs on the machine left under the shared default."""
    started = time.monotonic()
    base = Path(tempfile.mkdtemp(prefix="repeat-"))
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider",
                             f"--basetemp={base / 'tmp'}", *extra, node],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the run and every process it started (its own session)
        out, _ = proc.communicate()
        out += f"\nTIMEOUT: the run took over {timeout_s} s"
    finally:
        took = time.monotonic() - started
        shutil.rmtree(base, ignore_errors=True)
    return proc.returncode == 0, took, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("node", help="a pytest node id (file::test)")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--load", type=int, default=0, help="busy processes to run beside the test (0: none)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take before it counts failed")
    ap.add_argument("--stop-on-fail", action="store_true", help="stop after the first failed run")
    ap.add_argument("--keep", type=Path, default=None, help="a folder to write each failed run's whole output to")
    ap.add_argument("--show", default=None, metavar="TEXT", help="keep each run's output lines that contain TEXT")
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    args.pytest_args = argv[cut + 1:]  # after --, for pytest (argparse would take "-s" for an option of its own)
    if args.runs < 1 or args.load < 0:
        ap.error("--runs must be at least 1 and --load at least 0")

    busy = [subprocess.Popen([sys.executable, "-c", BUSY], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for _ in range(args.load)]
    loads = [os.getloadavg()[0]]
    passed, failures, seconds, shown = 0, [], [], []
    try:
        for n in range(1, args.runs + 1):
            ok, took, output = run_once(args.node, args.timeout, args.pytest_args)
            seconds.append(round(took, 1))
            if args.show is not None:
                shown.append([line.strip()[:400] for line in output.splitlines() if args.show in line])
            loads.append(os.getloadavg()[0])
            if ok:
                passed += 1
            else:
                failures.append({"run": n, "why": why(output)})
                if args.keep is not None:
                    args.keep.mkdir(parents=True, exist_ok=True)
                    (args.keep / f"run-{n}.txt").write_text(output)
            print(f"run {n}: {'passed' if ok else 'FAILED'} in {took:.1f} s, load {loads[-1]:.2f}",
                  file=sys.stderr, flush=True)
            if not ok and args.stop_on_fail:
                break
    finally:
        for proc in busy:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    runs = len(seconds)
    print(json.dumps({"test": args.node, "runs": runs, "passed": passed, "failed": runs - passed,
                      "failures": failures, "seconds": seconds, **({"shown": shown} if args.show else {}),
                      "load": {"busy_processes": args.load, "cores": os.cpu_count(), "loadavg_1m_before": loads[0],
                               "loadavg_1m_after": loads[-1], "loadavg_1m_max": max(loads)}}, indent=1))
    return 0 if passed == runs else 1


if __name__ == "__main__":
    sys.exit(main())
