"""The pure core of checkpoint validation: facts in, a verdict naming what is wrong out (no torch, no files)."""

from __future__ import annotations

import math

import pytest

from fleethealth.errors import SchemaError
from fleethealth.injob.ckptcheck.rules import (
    Band,
    CheckpointRules,
    Facts,
    FileDigest,
    Manifest,
    TensorSpec,
    judge,
)

SHA = "ab" * 32
W = TensorSpec("model.w", (4, 4), "float32")


def _facts(**kw) -> Facts:
    files = {"__0_0.distcp": FileDigest("__0_0.distcp", 100, SHA)}
    base = dict(format="dcp", manifest=Manifest("dcp", tuple(files.values()), (W,)), on_disk=files,
                needed={"__0_0.distcp": 100}, stored={"model.w": W}, norms={"model.w": 2.0})
    return Facts(**{**base, **kw})


def test_clean_facts_are_valid_and_the_missing_band_is_a_note():
    verdict = judge(_facts(), None, None)
    assert verdict.valid and verdict.notes == ("no previous valid checkpoint: norms checked for finiteness only, "
                                               "no band",)


def test_the_band_fails_a_jump_and_a_collapse_but_not_optimizer_state():
    band = Band.of([{"model.w": 1.9, "optim.state.0.exp_avg_sq": 1e-4}, {"model.w": 2.1}])
    assert judge(_facts(), None, band).valid
    up = judge(_facts(norms={"model.w": 210.0, "optim.state.0.exp_avg_sq": 5.0}), None, band)
    assert up.reasons == ("tensor model.w norm 210 is 100x the largest of the last 2 valid checkpoints (2.1); "
                          "at most 10x is allowed",)
    down = judge(_facts(norms={"model.w": 0.1}), None, band)
    assert down.reasons == ("tensor model.w norm 0.1 fell below 1/10 of the smallest of the last 2 valid "
                            "checkpoints (1.9)",)


def test_a_band_of_zeros_allows_the_floor_and_a_nan_always_fails():
    band = Band.of([{"model.b": 0.0}])
    rules = CheckpointRules(norm_floor=1e-3)
    assert judge(_facts(norms={"model.b": 0.005}), None, band, rules).valid
    assert not judge(_facts(norms={"model.b": 0.5}), None, band, rules).valid
    assert judge(_facts(norms={"model.w": math.nan}), None, None).reasons == ("tensor model.w has a non-finite "
                                                                              "norm (nan)",)


def test_each_structural_problem_is_named():
    short = {"__0_0.distcp": FileDigest("__0_0.distcp", 60, SHA)}
    assert judge(_facts(on_disk=short), None, None).reasons == (
        "file __0_0.distcp is 60 bytes, the manifest says 100 (truncated or rewritten since the save)",
        "shard __0_0.distcp is truncated: 60 bytes, the metadata needs 100")
    wrong = {"model.w": TensorSpec("model.w", (4, 4), "bfloat16")}
    assert judge(_facts(stored=wrong), None, None).reasons == ("tensor model.w is bfloat16 in the checkpoint, "
                                                               "the model's is float32",)
    assert judge(_facts(stored={}), None, None).reasons == ("tensor model.w ([4, 4] float32) is not in the "
                                                            "checkpoint",)
    assert judge(_facts(manifest=None, manifest_problem="no manifest (m.json)"), None, None).reasons == (
        "no manifest (m.json)",)


@pytest.mark.parametrize(("obj", "field"), [
    ({"fleethealth_manifest": 2}, "fleethealth_manifest"),
    ({"fleethealth_manifest": 1, "format": "zip", "files": []}, "format"),
    ({"fleethealth_manifest": 1, "format": "dcp", "files": [{"name": "../../etc/passwd", "bytes": 1,
                                                             "sha256": SHA}]}, "files"),
    ({"fleethealth_manifest": 1, "format": "dcp", "files": [{"name": "a", "bytes": -1, "sha256": SHA}]}, "files"),
    ({"fleethealth_manifest": 1, "format": "dcp", "files": [], "tensors": [{"name": "w", "shape": [-1],
                                                                            "dtype": "float32"}]}, "tensors"),
])
def test_a_bad_manifest_is_refused_naming_the_field(obj, field):
    with pytest.raises(SchemaError) as err:
        Manifest.from_obj(obj)
    assert err.value.field == field


@pytest.mark.parametrize("bad", [{"norm_factor": 1.0}, {"norm_floor": -1.0}, {"history": 0}, {"norm_skip": 3}])
def test_bad_rules_name_their_key(bad):
    with pytest.raises(SchemaError) as err:
        CheckpointRules(**bad)
    assert err.value.field == f"checkpoint.{next(iter(bad))}"
