"""``fleethealth demo --injob --fault deterministic --corrupt-checkpoint 40``: the checkpoint the marks
alone would choose is written corrupt (a weight 100x, digests intact); rank 0's background validator
reports it invalid through the probe socket, the policy refuses it and names it, rolls back to the
newest validated checkpoint before it, and the resumed run still ends bitwise equal to a clean one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

pytestmark = pytest.mark.slow


def _demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fleethealth", "demo", "--injob", *args],
                          capture_output=True, text=True, timeout=300)


def test_the_rollback_refuses_the_corrupt_checkpoint_and_lands_on_a_validated_one(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run = _demo("--fault", "deterministic", "--corrupt-checkpoint", "40", "--json", "--ckpt-dir", str(ckpt))
    assert run.returncode == 0, run.stdout + run.stderr
    out = orjson.loads(run.stdout)
    assert out["ok"] is True and out["final_bitwise_equal_to_clean"] is True
    # without validation the replay mark (40) picks checkpoint 40; validated, the one before it
    assert out["rollback_step"] == 30 and out["rollback_guard"] == "allowed"
    [[step, why]] = out["refused_checkpoints"]
    assert step == 40 and why.startswith("invalid: tensor model.4.weight norm ") and "x the largest" in why
    assert out["validations"]["invalid"] == 1 and out["validations"]["valid"] >= 4
    # the manifest the job wrote beside each checkpoint lets the command judge them again
    from fleethealth.commands import main

    assert main(["checkpoint", "validate", str(ckpt / "ckpt-000030.pt")]) == 0


@pytest.mark.parametrize(("args", "cause"), [
    (("--fault", "transient", "--corrupt-checkpoint", "40"), "goes with --fault deterministic"),
    (("--fault", "deterministic", "--corrupt-checkpoint", "45"), "not a checkpoint step"),
])
def test_a_corrupt_checkpoint_the_demo_cannot_show_is_one_line_and_exit_2(args: tuple[str, ...], cause: str) -> None:
    run = _demo(*args)
    assert run.returncode == 2 and cause in run.stderr and len(run.stderr.strip().splitlines()) == 1
