"""Failure predictor: features on hand-made telemetry (rates, deltas, Xid classes, slopes, GPU loss),
the shipped artifact (metadata, size, version check), failure_risk findings on a simulated precursor,
the harder generator's fields (NaN where a GPU model does not report them) and the training script's
path end to end on small runs."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from fleethealth.detectors.predict import (
    FEATURES,
    MODEL_NAME,
    FailurePredictor,
    GpuFeatures,
    ModelArtifact,
    _default_paths,
    load_model,
)
from fleethealth.errors import ConfigError
from fleethealth.schema import Event, EventKind, FindingKind, Telemetry

F = {name: i for i, name in enumerate(FEATURES)}


def _sample(ts, node="n0001", **cols):
    base = {name: np.zeros(2) for name in ("ecc_sbe_volatile", "retired_sbe", "retired_dbe", "remap_correctable",
                                           "remap_uncorrectable", "remap_pending", "retired_pending",
                                           "ecc_dbe_volatile", "nvlink_crc_flit", "nvlink_crc_data",
                                           "nvlink_replay", "nvlink_recovery", "pcie_replay")}
    base.update(temp_c=np.full(2, 66.0), nvlink_links_up=np.full(2, 18.0), nvlink_links_max=np.full(2, 18.0))
    for name, value in cols.items():
        base[name] = np.asarray(value, dtype=np.float64)
    return Telemetry.from_columns(node, "r00", ts, np.arange(2), **base)


def test_rates_deltas_and_levels():
    feats = GpuFeatures()
    rows = []
    for i in range(13):  # one sample every 5 min for an hour
        ts = 300.0 * i
        rows += feats.check([_sample(ts, ecc_sbe_volatile=[10.0 * i, 0.0], retired_sbe=[i // 6, 0],
                                      remap_pending=[float(i > 10), 0.0], temp_c=[66.0 + 0.5 * i, 66.0],
                                      nvlink_crc_flit=[0.0, 30.0 * i], nvlink_links_up=[18.0, 16.0])])
    last = rows[-1]
    assert last.X.shape == (2, len(FEATURES)) and last.gpu.tolist() == [0, 1]
    x, y = last.X
    assert x[F["sbe_rate_short_per_h"]] == pytest.approx(120.0)  # 10 per 5 min
    assert x[F["sbe_rate_recent_per_h"]] == pytest.approx(120.0)
    assert x[F["sbe_accel_per_h"]] == pytest.approx(0.0)
    assert x[F["sbe_count_short"]] == 120.0 and x[F["sbe_volatile_log"]] == pytest.approx(np.log1p(120.0))
    assert x[F["retired_pages_delta"]] == 2.0 and x[F["remap_pending"]] == 1.0
    assert x[F["temp_slope_c_per_h"]] == pytest.approx(6.0)
    assert x[F["temp_margin_c"]] == pytest.approx(85.0 - 72.0)
    assert y[F["nvlink_err_rate_per_h"]] == pytest.approx(360.0) and y[F["nvlink_links_down"]] == 2.0
    assert y[F["sbe_rate_short_per_h"]] == 0.0


def test_resolution_stale_samples_and_xid_classes():
    feats = GpuFeatures(resolution_s=60.0)
    assert len(feats.check([_sample(0.0), _sample(30.0), _sample(60.0)])) == 2  # 30 s is under resolution
    assert feats.check([_sample(10.0)]) == [] and feats.stale_total_ == 1
    events = [Event(node="n0001", ts=100.0, kind=EventKind.XID, gpu=0, code=code) for code in (63, 48, 74, 13, 62)]
    (row,) = feats.check([_sample(200.0)], events)
    x = row.X[0]
    assert (x[F["xid_ecc"]], x[F["xid_nvlink"]], x[F["xid_app"]], x[F["xid_hw_other"]]) == (2, 1, 1, 1)
    assert row.X[1][F["xid_ecc"]] == 0


def test_lost_gpu_starts_a_fresh_history():
    feats = GpuFeatures()
    for i in range(6):
        feats.check([_sample(300.0 * i, ecc_sbe_volatile=[500.0 * i, 0.0])])
    lost = Event(node="n0001", ts=1600.0, kind=EventKind.XID, gpu=0, code=79)
    feats.check([], [lost])
    (row,) = feats.check([_sample(1900.0, ecc_sbe_volatile=[0.0, 0.0])])
    assert row.X[0][F["sbe_rate_short_per_h"]] == 0.0 and row.X[0][F["xid_hw_other"]] == 0.0
    assert feats.lost_[("n0001", 0)] == 1600.0


def test_shipped_artifact_metadata_and_size():
    model_path, meta_path = _default_paths()
    meta = json.loads(meta_path.read_text())
    assert meta["name"] == MODEL_NAME and meta["features"] == list(FEATURES)
    assert meta["sklearn"] and meta["estimator"] == "HistGradientBoostingClassifier"
    assert 0 < meta["threshold"] <= 1 and meta["horizon_s"] == 86_400.0
    assert model_path.stat().st_size < 400_000
    art = load_model()
    assert art.predict_proba(np.zeros((3, len(FEATURES)))).shape == (3,)


def test_version_mismatch_and_bad_artifacts_are_clear_errors(tmp_path):
    model_path, meta_path = _default_paths()
    shutil.copy(model_path, tmp_path / "m.joblib")
    meta = json.loads(meta_path.read_text())
    (tmp_path / "m.json").write_text(json.dumps({**meta, "sklearn": "0.0.1"}))
    with pytest.raises(ConfigError, match=r"scikit-learn 0\.0\.1.*retrain with"):
        load_model(tmp_path / "m.joblib")
    with pytest.raises(ConfigError, match="retrain"):
        FailurePredictor(model=tmp_path / "m.joblib", use_model=True).check([], [])
    assert load_model(tmp_path / "m.joblib", check_version=False).meta["sklearn"] == "0.0.1"
    (tmp_path / "m.json").write_text(json.dumps({**meta, "features": ["x"]}))
    with pytest.raises(ConfigError, match="other features"):
        load_model(tmp_path / "m.joblib")
    with pytest.raises(ConfigError, match="cannot read"):
        load_model(tmp_path / "absent.joblib")


def test_simulated_precursor_is_flagged_before_failure_and_healthy_gpus_are_not():
    """A 32-GPU simulated fleet (2 s steps) with one ecc_precursor GPU and background noise on others."""
    from fleethealth.sim.fleet import FleetSim
    from fleethealth.sim.scenario import Scenario

    sim = FleetSim(Scenario.from_obj({
        "seed": 11, "fleet": {"racks": 1, "nodes_per_rack": 4, "gpus_per_node": 8}, "job": {"steps": 600},
        "faults": [{"kind": "ecc_precursor", "node": "n0002", "gpu": 6, "start_step": 50, "fail_step": 500}]}))
    det = FailurePredictor(use_model=True)
    found = []
    for frame in sim.run():
        found += det.check(frame.telemetry, frame.events)
    assert [(f.node, f.gpu) for f in found] == [("n0002", 6)]
    f = found[0]
    assert f.kind is FindingKind.FAILURE_RISK and f.ts < sim.step_ts(500)
    assert f.probability >= det.threshold_ and f.evidence["horizon_s"] == 86_400.0
    top = f.evidence["top_features"]
    assert top and top[0]["feature"] in FEATURES and top[0]["probability_without"] < f.probability
    assert set(f.evidence["features"]) == set(FEATURES)


class _Always:
    """A stand-in classifier scoring every row ``p`` (tests the episode logic, not the model)."""

    def __init__(self, p: float) -> None:
        self.p = p

    def predict_proba(self, X):
        return np.column_stack([np.full(len(X), 1 - self.p), np.full(len(X), self.p)])


def _artifact(p: float) -> ModelArtifact:
    return ModelArtifact(model=_Always(p), meta={"name": "stub", "threshold": 0.5, "horizon_s": 86_400.0,
                                                 "reference": [0.0] * len(FEATURES)})


def test_probability_needs_hard_evidence_and_fires_once_per_episode():
    det = FailurePredictor(model=_artifact(0.99), clear_after_s=600.0, use_model=True)
    found = []
    for i in range(30):  # GPU 0: a steady trickle (2 per 5 min); GPU 1: corrected errors piling up
        found += det.check([_sample(300.0 * i, ecc_sbe_volatile=[2.0 * i, 40.0 * i])])
    assert [(f.gpu, f.ts) for f in found] == [(1, 600.0)]  # 80 errors in the hour passes the 50 floor
    assert found[0].probability == 0.99 and found[0].evidence["model"] == "stub"
    lost = Event(node="n0001", ts=9000.0, kind=EventKind.XID, gpu=1, code=79)
    assert det.check([_sample(9100.0, ecc_sbe_volatile=[60.0, 9999.0])], [lost]) == []  # muted after loss
    quiet = FailurePredictor(model=_artifact(0.1), use_model=True)
    assert quiet.check([_sample(0.0, remap_pending=[1.0, 0.0])]) == []


def test_default_is_the_ecc_rule_and_needs_no_model():
    det = FailurePredictor(model="/nonexistent/model.joblib")  # not loaded: the rule needs none
    found = []
    for i in range(30):  # GPU 0: corrected errors piling up, nothing else; GPU 1: a row remap pending from 1 h
        pending = [0.0, float(i >= 12)]
        found += det.check([_sample(300.0 * i, ecc_sbe_volatile=[400.0 * i, 0.0], remap_pending=pending)])
    assert [(f.gpu, f.ts, f.probability) for f in found] == [(1, 3600.0, 1.0)]
    assert found[0].evidence["rule"] == ["remap_pending"] and found[0].evidence["model"] == "ecc_rule"
    hopper = FailurePredictor()
    nan = np.full(2, np.nan)
    assert hopper.check([_sample(0.0, retired_sbe=nan, retired_dbe=nan, retired_pending=nan)]) == []
    # Hopper retires no pages: a row remapped for an uncorrectable error is what the rule reads
    [remap] = hopper.check([_sample(60.0, retired_sbe=nan, retired_dbe=nan, retired_pending=nan,
                                     remap_uncorrectable=[0.0, 1.0])])
    assert (remap.gpu, remap.evidence["rule"]) == (1, ["row_remap_delta"])
    assert remap.evidence["features"]["retired_pages_delta"] is None
    with pytest.raises(ConfigError, match="use_model"):
        FailurePredictor(use_model="yes").check([], [])


def test_threshold_parameter_is_validated():
    with pytest.raises(ConfigError, match="threshold"):
        FailurePredictor(threshold=1.5).check([], [])


def test_training_script_round_trip(tmp_path):
    from fleethealth.detectors import predict_train as pt

    spec = pt.make_run(101)
    assert spec == pt.make_run(101)  # deterministic for the seed
    X, y = pt.collect(spec)
    assert X.shape[1] == len(FEATURES) and 0 < y.sum() < len(y)
    art = pt.train([101, 103], [1000])
    path = pt.save(art, tmp_path)
    loaded = load_model(path)
    assert loaded.meta["train_seeds"] == [101, 103] and loaded.meta["synth_train_seeds"] == [1000]
    assert not np.isnan(loaded.reference).any()
    np.testing.assert_allclose(loaded.predict_proba(X[:50]), art.predict_proba(X[:50]))


def test_harder_generator_reports_what_each_gpu_model_reports_and_features_keep_the_gaps():
    from fleethealth.detectors.failure_synth import GPU_MODELS, make_synth_run, stream
    from fleethealth.detectors.health import HealthRules

    run = make_synth_run(5, nodes=4, days=0.5)
    assert run == make_synth_run(5, nodes=4, days=0.5) and run.failures and set(run.kinds) == set(run.failures)
    assert run.gpu_days == pytest.approx(4 * 8 * 0.5, rel=0.01)
    feats, rules = GpuFeatures(), HealthRules()
    lost, rows = [], []
    for telemetry, events in stream(run):
        lost += [(e.node, e.gpu, e.ts) for e in events if e.code == 79]
        rows += feats.check(telemetry, events)
        rules.check(telemetry, events)
        for s in telemetry:
            spec = GPU_MODELS[s.model]
            up = ~np.isnan(s.columns["ecc_sbe_volatile"])
            assert np.isnan(s.columns["retired_sbe"][up]).all() != spec["pages"]
            assert np.isnan(s.columns["remap_pending"][up]).all() != spec["remap"]
    assert sorted((n, g) for n, g, _ in lost) == sorted(run.failures)
    assert all(run.failures[(n, g)] == ts for n, g, ts in lost)
    models = dict(zip(run.nodes, run.models, strict=True))
    for r in rows[-len(run.nodes):]:
        pages = GPU_MODELS[models[r.node]]["pages"]
        assert np.isnan(r.X[:, F["retired_pages_delta"]]).all() != pages
        assert np.isnan(r.X[:, F["row_remap_delta"]]).all() == pages
        assert not np.isnan(r.X[:, F["sbe_rate_short_per_h"]]).any()


def test_temperature_margin_is_to_each_gpus_own_slowdown_limit():
    """A GPU that reports its slowdown temperature is judged against it; one that does not (NaN:
    an old driver) against ``thermal_limit_c``."""
    feats = GpuFeatures(thermal_limit_c=85.0)
    rows = feats.check([_sample(0.0, temp_c=[80.0, 80.0], slowdown_temp_c=[87.0, np.nan])])
    own, fallback = rows[-1].X[:, F["temp_margin_c"]]
    assert own == pytest.approx(7.0) and fallback == pytest.approx(5.0)
    rows = GpuFeatures(thermal_limit_c=90.0).check([_sample(0.0, temp_c=[80.0, 80.0],
                                                              slowdown_temp_c=[87.0, np.nan])])
    assert rows[-1].X[:, F["temp_margin_c"]].tolist() == pytest.approx([7.0, 10.0])


def _precursor_stream(start: float = 1000.5, n: int = 600, tick: float = 1.0) -> list[Telemetry]:
    """One node's samples every ``tick`` s from ``start`` (off the minute): GPU 0 remaps a row at the
    200th sample, another at the 420th, a remap pending from the 300th; GPU 1 healthy."""
    out = []
    for i in range(n):
        rows = float(i >= 200) + float(i >= 420)
        out.append(_sample(start + tick * i, ecc_sbe_volatile=[3.0 * i, 0.0], remap_correctable=[rows, 0.0],
                           remap_pending=[float(i >= 300), 0.0]))
    return out


def _findings(samples: list[Telemetry], cuts: list[int], *, trip_at: int | None = None, begin: int = 0) -> list:
    """``failure_risk`` findings of ``samples[begin:]`` fed in the batches ``cuts`` gives, the detector
    rebuilt from its explicit state after batch ``trip_at``."""
    from fleethealth.detectors.state import from_state, state_dict

    det, out, at = FailurePredictor(), [], begin
    for n, cut in enumerate([*cuts, len(samples)]):
        out += det.check(samples[at:cut])
        at = cut
        if n == trip_at:
            det = from_state(state_dict(det), like=FailurePredictor())
    return [(f.id, f.node, f.gpu, f.ts) for f in out]


def test_findings_do_not_depend_on_batching_restores_or_where_the_history_begins():
    """The same samples give the same findings (ids and event times) in one batch, in batches of any
    size, with a snapshot round trip between two, and from a history begun later (a partition rebuilt
    from the group's commit, a detector started mid-stream): rows fall on the event-time grid, the first
    sample of each ``resolution_s`` interval, not ``resolution_s`` after wherever sampling began."""
    samples = _precursor_stream()
    whole = _findings(samples, [])
    assert [(node, gpu) for _, node, gpu, _ in whole] == [("n0001", 0)]
    assert whole[0][3] - 0.5 == 1200.0  # the first sample of its minute (the stream starts at 1000.5)
    rng = np.random.default_rng(7)
    for _ in range(6):
        cuts = sorted(rng.choice(np.arange(1, len(samples)), size=int(rng.integers(2, 40)), replace=False).tolist())
        assert _findings(samples, cuts, trip_at=int(rng.integers(0, len(cuts)))) == whole, cuts
    for begin in (1, 17, 59, 100, 150):  # begun before the first remap: the same rows from the grid on
        assert _findings(samples, [begin + 5, begin + 200], trip_at=0, begin=begin) == whole, begin
    # a round trip that also re-reads what the state had taken (a restore from the commit before it)
    det = FailurePredictor()
    first = det.check(samples[:250])
    from fleethealth.detectors.state import from_state, state_dict

    again = from_state(state_dict(det), like=FailurePredictor())
    assert [(f.id, f.node, f.gpu, f.ts) for f in [*first, *again.check(samples[180:])]] == whole


def _stream(n: int, seed: int = 3) -> list[Telemetry]:
    """``n`` samples a minute apart whose counters rise by random steps and whose temperature wanders."""
    rng = np.random.default_rng(seed)
    sbe, flit, temp = np.zeros(2), np.zeros(2), np.full(2, 66.0)
    out = []
    for i in range(n):
        sbe = sbe + rng.integers(0, 4, 2)
        flit = flit + rng.integers(0, 3, 2)
        temp = temp + rng.normal(0.0, 0.4, 2)
        out.append(_sample(60.0 * i + 0.5, ecc_sbe_volatile=sbe, nvlink_crc_flit=flit, temp_c=np.round(temp, 1)))
    return out


def test_history_holds_the_long_window_in_place_and_a_snapshot_writes_two_arrays_a_node():
    """Rows past the long window leave the history: the rows after it are those of a history begun
    at the window's start, the history's buffers stop growing at what the window holds, and a
    snapshot's arrays do not grow with the rows."""
    from fleethealth.detectors.state import state_dict

    windows = {"recent_s": 120.0, "short_s": 300.0, "long_s": 600.0, "resolution_s": 60.0}
    samples = _stream(90)
    whole = GpuFeatures(**windows)
    rows = [whole.check([s]) for s in samples]
    hist = whole.nodes_["n0001"].rows
    assert len(hist) == 12 and np.all(np.diff(hist.ts) == 60.0)  # [ts - long - resolution, ts]
    assert hist.rows.shape == (12, 2, 10) and hist.ts_buf.size == 16  # doubled 4 -> 8 -> 16, then kept
    late = GpuFeatures(**windows)
    begun = 40  # a history begun 40 minutes in has every row the long window reads from minute 50 on
    late_rows = [late.check([s]) for s in samples[begun:]]
    for i in range(begun + 10, len(samples)):
        np.testing.assert_array_equal(rows[i][0].X, late_rows[i - begun][0].X)
    arrays = len(state_dict(GpuFeatures(**windows)).arrays)
    short = GpuFeatures(**windows)
    short.check(samples[:20])
    assert len(state_dict(short).arrays) == len(state_dict(whole).arrays) > arrays
