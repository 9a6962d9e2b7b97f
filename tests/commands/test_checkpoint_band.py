"""``fleethealth checkpoint validate PATH --job ID`` takes the norm band from the job's stored
``checkpoint_validated`` records (a real CPU training run validated in the background, its records
in a real chDB store), and falls back to ``--history`` when the store holds none for the job. A record
whose norms are hostile (wrong types, too many) is left out, counted in the note, never trusted."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch

from fleethealth.commands import main
from fleethealth.injob.ckptcheck.background import CheckpointValidator
from fleethealth.injob.ckptcheck.files import spec_of, write_manifest
from fleethealth.injob.reporter import Reporter
from fleethealth.payloads.validation import MAX_NORMS, checkpoint_validated_event
from fleethealth.schema import Event, EventKind

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
JOB = "llm-band"


def _train(tmp_path):
    """Three torch.save checkpoints of a small real run, validated in the background; their records."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    seen: list[Event] = []
    validator = CheckpointValidator(Reporter(job=JOB, rank=0, gpu=0, sink=seen.append))
    files = {}
    for step in range(1, 7):
        x = torch.randn(16, 6)
        torch.nn.functional.cross_entropy(model(x), (x.sum(1) > 0).long()).backward()
        opt.step()
        opt.zero_grad()
        if step % 2 == 0:
            state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
            files[step] = tmp_path / f"ckpt-{step}.pt"
            torch.save(state, files[step])
            validator.saved(step, files[step], state)
            assert validator.wait(60)
    validator.close()
    return model, opt, files, seen


def test_the_band_comes_from_the_stored_records_and_falls_back_to_history(store, tmp_path, capsys) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        model, opt, files, seen = _train(tmp_path)
    assert all(e.data.get("norms", {}).get("model.0.weight", 0) > 0 for e in seen)
    seen = [dataclasses.replace(e, node="gpu-a") for e in seen]  # the probe names the node
    hostile = [checkpoint_validated_event(ts=seen[-1].ts + 1, step=8, uri="x", result="valid", job=JOB, node="gpu-a"),
               checkpoint_validated_event(ts=seen[-1].ts + 2, step=10, uri="y", result="valid", job=JOB, node="gpu-a")]
    hostile[0].data["norms"] = {"model.0.weight": "huge"}
    hostile[1].data["norms"] = {f"t{i}": 1.0 for i in range(MAX_NORMS + 1)}
    store.insert_events([*seen, *hostile])
    assert {e.kind for e in seen} == {EventKind.CHECKPOINT_VALIDATED}

    # an exploded norm (x100) in an otherwise sound checkpoint: every digest matches its manifest
    state = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "optim": opt.state_dict(), "step": 7}
    state["model"]["0.weight"] *= 100.0
    exploded = tmp_path / "ckpt-7.pt"
    torch.save(state, exploded)
    write_manifest(exploded, spec_of(state), step=7)

    capsys.readouterr()
    assert main(["checkpoint", "validate", str(exploded), "--job", JOB, "--store", store.dsn, "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert any("model.0.weight" in r and "largest of the last 3 valid" in r for r in out["reasons"]), out
    assert out["notes"][0] == (f"band from the store: job {JOB}'s valid checkpoints at steps 2, 4, 6; "
                               "2 unreadable record(s) left out")
    assert main(["checkpoint", "validate", str(files[6]), "--job", JOB, "--store", store.dsn]) == 0
    assert "valid" in capsys.readouterr().out

    # no record of the job in the store: --history sets the band
    assert main(["checkpoint", "validate", str(exploded), "--job", "other-job", "--store", store.dsn,
                 "--history", str(files[2]), str(files[4]), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["notes"][0].startswith("the store holds no valid checkpoint with norms for job other-job")
    assert any("largest of the last 2 valid" in r for r in out["reasons"]), out
