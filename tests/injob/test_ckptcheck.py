"""Checkpoint validation on checkpoints a real CPU training run wrote: DCP directories and torch.save files.

The run trains a tiny MLP with Adam and checkpoints at steps 2, 4 and 6 in both formats, each followed
by the in-job validator's call; every bad case is a copy of a good checkpoint, damaged as a failing
rank or storage would damage it, and must fail with a reason naming what is wrong.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fleethealth.commands import main
from fleethealth.injob.ckptcheck.background import CheckpointValidator
from fleethealth.injob.ckptcheck.files import MANIFEST_NAME, manifest_path, spec_of, validate, write_manifest
from fleethealth.injob.ckptcheck.rules import CheckpointRules
from fleethealth.injob.reporter import Reporter
from fleethealth.payloads.validation import CheckpointValidation

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
STEPS = (2, 4, 6)


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 3))


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A real training run: (directory, {step: dcp dir}, {step: torch.save file}, last state, events)."""
    root = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    model, seen = _model(), []
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    validator = CheckpointValidator(Reporter(job="llm-run", rank=0, gpu=0, sink=seen.append))
    dirs, files = {}, {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        for step in range(1, STEPS[-1] + 1):
            x = torch.randn(16, 6)
            loss = torch.nn.functional.cross_entropy(model(x), (x.sum(1) > 0).long())
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step in STEPS:
                state = _state(model, opt, step)
                dirs[step] = root / f"dcp-{step}"
                dcp.save(state, checkpoint_id=dirs[step], no_dist=True)
                validator.saved(step, dirs[step], state)
                files[step] = root / f"ckpt-{step}.pt"
                torch.save(state, files[step])
                validator.saved(step, files[step], state)
                assert validator.wait(60)
    validator.close()
    return root, dirs, files, _state(model, opt, STEPS[-1]), seen


def _copy(src: Path, dst: Path) -> Path:
    if src.is_dir():
        shutil.copytree(src, dst)
    else:
        shutil.copy(src, dst)
        shutil.copy(manifest_path(src), manifest_path(dst))
    return dst


def _flip(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x10
    path.write_bytes(bytes(data))


def _shard(d: Path) -> Path:
    [shard] = sorted(d.glob("*.distcp"))
    return shard


def test_the_run_validated_each_checkpoint_in_the_background_and_reported_it(run):
    _, dirs, files, _, seen = run
    records = [CheckpointValidation.from_event(e) for e in seen]
    assert [(r.step, r.valid) for r in records] == [(s, True) for s in STEPS for _ in (0, 1)]
    assert {e.job for e in seen} == {"llm-run"} and all(r.duration_s is not None for r in records)
    for step in STEPS:
        manifest = json.loads((dirs[step] / MANIFEST_NAME).read_text())
        assert manifest["step"] == step and {f["name"] for f in manifest["files"]} >= {".metadata"}
        assert manifest_path(files[step]).is_file()


@pytest.mark.parametrize("fmt", ["dcp", "file"])
def test_a_good_checkpoint_passes_with_its_band(run, fmt):
    _, dirs, files, _, _ = run
    book = dirs if fmt == "dcp" else files
    verdict = validate(book[6], history=[book[2], book[4]])
    assert verdict.valid and verdict.reasons == () and verdict.notes == ()
    assert verdict.norms["model.0.weight"] > 0


def test_a_missing_shard_fails(run, tmp_path):
    bad = _copy(run[1][6], tmp_path / "bad")
    shard = _shard(bad)
    shard.unlink()
    reasons = validate(bad).reasons
    assert f"shard {shard.name} is missing (the checkpoint's metadata places tensors in it)" in reasons


def test_a_truncated_shard_and_a_truncated_file_fail(run, tmp_path):
    bad = _copy(run[1][6], tmp_path / "bad")
    shard = _shard(bad)
    full = shard.stat().st_size
    os.truncate(shard, full // 2)
    assert f"shard {shard.name} is truncated: {full // 2} bytes, the metadata needs {full}" in validate(bad).reasons
    f = _copy(run[2][6], tmp_path / "bad.pt")
    os.truncate(f, f.stat().st_size - 100)
    reasons = validate(f).reasons
    assert any(r.startswith("test load failed") for r in reasons)
    assert any("bytes, the manifest says" in r for r in reasons)


@pytest.mark.parametrize("fmt", ["dcp", "file"])
def test_a_flipped_byte_fails_on_its_digest(run, tmp_path, fmt):
    src = run[1][6] if fmt == "dcp" else run[2][6]
    bad = _copy(src, tmp_path / ("bad" if fmt == "dcp" else "bad.pt"))
    _flip(_shard(bad) if fmt == "dcp" else bad, 0.6)
    [reason] = [r for r in validate(bad).reasons if "SHA-256" in r]
    assert "differs from the manifest's (changed since the save" in reason


def test_a_tampered_metadata_is_not_unpickled(run, tmp_path):
    bad = _copy(run[1][6], tmp_path / "bad")
    _flip(bad / ".metadata", 0.9)
    reasons = validate(bad).reasons
    assert ".metadata not read: its digest does not match the manifest's (DCP's reader unpickles it)" in reasons


def test_a_checkpoint_without_a_manifest_is_not_valid(run, tmp_path):
    bad = _copy(run[1][6], tmp_path / "bad")
    (bad / MANIFEST_NAME).unlink()
    reasons = validate(bad).reasons
    assert reasons[0] == "no manifest (fleethealth-manifest.json): the digests written at save time are unknown"


@pytest.mark.parametrize("fmt", ["dcp", "file"])
def test_a_tensor_of_the_wrong_shape_fails_the_test_load(run, tmp_path, fmt):
    state = run[3]
    wrong = {**state, "model": {**state["model"], "0.weight": state["model"]["0.weight"].t().contiguous()}}
    path = tmp_path / ("bad" if fmt == "dcp" else "bad.pt")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(wrong, checkpoint_id=path, no_dist=True) if fmt == "dcp" else torch.save(wrong, path)
    write_manifest(path, spec_of(state), step=7)     # the model's shapes, as the in-job call records them
    assert validate(path).reasons == ("tensor model.0.weight has shape [6, 12] in the checkpoint, the model's "
                                      "is [12, 6]",)


@pytest.mark.parametrize("fmt", ["dcp", "file"])
def test_an_exploded_norm_fails_though_every_digest_matches(run, tmp_path, fmt):
    _, dirs, files, state, _ = run
    book = dirs if fmt == "dcp" else files
    boom = {**state, "model": {**state["model"], "2.weight": state["model"]["2.weight"] * 100}}
    path = tmp_path / ("bad" if fmt == "dcp" else "bad.pt")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(boom, checkpoint_id=path, no_dist=True) if fmt == "dcp" else torch.save(boom, path)
    write_manifest(path, spec_of(state), step=8)
    assert validate(path).valid            # without history only finiteness: what digests alone would say
    [reason] = validate(path, history=[book[s] for s in STEPS]).reasons
    assert reason.startswith("tensor model.2.weight norm ") and "the largest of the last 3 valid checkpoints" in reason
    assert "at most 10x is allowed" in reason
    # a looser band lets it through: the factor is the setting that decides
    assert validate(path, history=[book[6]], rules=CheckpointRules(norm_factor=1000.0)).valid


def test_the_command_exit_codes(run, tmp_path, capsys):
    _, dirs, files, _, _ = run
    assert main(["checkpoint", "validate", str(dirs[6]), "--history", str(dirs[2]), str(dirs[4])]) == 0
    assert capsys.readouterr().out.startswith(f"{dirs[6]}: valid")
    bad = _copy(dirs[6], tmp_path / "bad")
    _shard(bad).unlink()
    assert main(["checkpoint", "validate", str(bad), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["valid"] is False and any("is missing" in r for r in out["reasons"])
    assert main(["checkpoint", "validate", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["checkpoint", "validate", str(files[6]), "--history", str(bad)]) == 2   # a bad band source
    assert "history checkpoint" in capsys.readouterr().err
    assert main(["checkpoint", "validate", str(files[6]), "--set", "checkpoint.norm_factor=0.5"]) == 2
    assert "checkpoint.norm_factor" in capsys.readouterr().err


def test_the_command_help_explains_the_checks_and_exit_codes(capsys):
    with pytest.raises(SystemExit) as done:
        main(["checkpoint", "validate", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for words in ("inventory", "digests", "test load", "norms", "exit status: 0 valid, 1 invalid", "2 unusable"):
        assert words in text
