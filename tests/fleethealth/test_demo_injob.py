"""``fleethealth demo --injob`` end to end: a real 4-rank CPU torch job with the in-job SDC defence,
a fault, detection through probe sockets, the embedded broker, the detector runner and chDB, the
rollback the policy recommends carried out, and the final weights compared bit for bit with a
clean run. Run as a user runs it, in a subprocess; nothing is mocked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest


def _demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fleethealth", "demo", "--injob", *args],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("fault", ["transient", "deterministic", "none"])
def test_injob_demo_finds_the_fault_rolls_back_before_it_and_ends_bitwise_equal(fault: str, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run = _demo("--fault", fault, "--json", "--ckpt-dir", str(ckpt))
    assert run.returncode == 0, run.stdout + run.stderr
    out = orjson.loads(run.stdout)
    assert out["fault"] == fault and out["ok"] is True
    assert out["final_bitwise_equal_to_clean"] is True
    assert out["events_dropped"] == 0
    records = sorted(ckpt.glob("ckpt-*.json"))
    assert len(records) == out["checkpoints_written"] > 0
    assert not list(ckpt.glob("*.partial*"))
    if fault == "none":
        assert out["sdc_findings"] == 0 and out["detected_at_step"] is None and out["rollback_step"] is None
        assert out["job_exits"] == ["completed"]
        return
    expected = {"transient": ("sdc.selfcheck", "transient", 2), "deterministic": ("sdc.replay", "persistent", 1)}
    detector, classification, rank = expected[fault]
    assert (out["detected_by"], out["classification"], out["culprit_rank"]) == (detector, classification, rank)
    assert out["injected_rank"] == rank and out["quarantined"] is True
    assert out["detected_at_step"] >= out["injected_at_step"] >= out["rollback_step"]
    assert out["rollback_guard"] == "allowed" and out["rollback_uri"].endswith(f"ckpt-{out['rollback_step']:06d}.pt")
    if fault == "transient":  # the job rolled back by itself, to the checkpoint the policy chose
        assert out["in_job_rollback"] == [out["detected_at_step"], out["rollback_step"]]
        assert out["halted_at_step"] is None and out["replaced_with"] is None
        assert out["job_exits"] == ["completed"]
    else:  # a device that keeps computing wrong: halt, and resume on a spare from the policy's target
        assert out["in_job_rollback"] is None
        assert out["replaced_with"] == "n0004" and out["sdc_findings_after_rollback"] == 0
        assert out["job_exits"] == ["halted", "completed"]
    # the record beside the target checkpoint vouches for it against this class of fault
    target = orjson.loads((ckpt / f"ckpt-{out['rollback_step']:06d}.json").read_bytes())
    mark = target["last_verified_step"] if fault == "transient" else target["last_replay_step"]
    assert mark is not None and mark >= out["rollback_step"]


@pytest.mark.parametrize(("args", "cause"), [
    (("--fault", "cosmic"), "unknown --fault 'cosmic'"),
    (("--world", "3"), "--world 3"),
    (("--world", "100000"), "this machine can run at most"),
])
def test_injob_demo_bad_input_is_one_line_and_exit_2(args: tuple[str, ...], cause: str) -> None:
    run = _demo(*args)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and cause in lines[0], run.stderr
    assert run.stdout == ""


def test_injob_demo_refuses_a_checkpoint_directory_it_cannot_write(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    run = _demo("--fault", "transient", "--ckpt-dir", str(blocker / "ckpt"))
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot be written" in lines[0], run.stderr
    assert not (blocker.parent / "ckpt").exists()
