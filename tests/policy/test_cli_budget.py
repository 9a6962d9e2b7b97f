"""``fleethealth budget``: the docs/architecture.md contract for young-daly, the seed-003 compare through the
installed command, the automatic interval, and clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import resources

import pytest

from fleethealth.commands import main

SEED003 = str(resources.files("fleethealth.scenarios") / "budget_seed003.yaml")


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_young_daly_json_contract(capsys):
    out = _json(capsys, ["budget", "young-daly", "--checkpoint-s", "30", "--mtbf-h", "3.1", "--restart-s", "600",
                         "--json"])
    for key in ("optimal_interval_s", "daly_interval_s", "overhead_at_optimum", "checkpoint_term",
                "lost_work_term", "restart_term", "overhead"):
        assert key in out
    assert out["optimal_interval_s"] / 60 == pytest.approx(13.6, abs=0.05)
    assert out["overhead_at_optimum"] == pytest.approx(0.127, abs=0.0005)
    assert out["restart_term"] == pytest.approx(0.0539, abs=0.0002)
    at30 = _json(capsys, ["budget", "young-daly", "--checkpoint-s", "30", "--mtbf-h", "3.1", "--restart-s", "600",
                          "--interval-s", "1800", "--json"])
    assert at30["interval_s"] == 1800 and at30["overhead"] == pytest.approx(0.151, abs=0.0005)
    assert at30["checkpoint_term"] == pytest.approx(30 / 1800)
    assert at30["lost_work_term"] == pytest.approx(1800 / (2 * 3.1 * 3600))


def test_young_daly_text(capsys):
    assert main(["budget", "young-daly", "--checkpoint-s", "30", "--mtbf-h", "3.1", "--restart-s", "600"]) == 0
    text = capsys.readouterr().out
    assert "13.6 min" in text and "restart R/M 5.38%" in text


def test_compare_seed003_through_the_installed_command():
    proc = subprocess.run([sys.executable, "-m", "fleethealth", "budget", "compare", SEED003, "--json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["baseline"]["hours"]["detection"] == 426.67
    assert out["baseline"]["hours"]["restore"] == 204.8
    assert out["saved_h"]["detection"] == 375.47
    assert out["candidate"]["hours"]["false_terminations"] == 34.13
    assert out["net_saved_h"] == 341.34
    assert out["net_saved_usd"] == 853.34


def test_compare_text(capsys):
    assert main(["budget", "compare", SEED003]) == 0
    text = capsys.readouterr().out
    assert "net saved: 341.34 accelerator-hours, $853.34" in text
    assert "false_terminations" in text and "idle_spares" in text


def test_interval_from_measured_failures(capsys):
    out = _json(capsys, ["budget", "interval", "--checkpoint-s", "30", "--interruptions", "15", "--window-h", "720",
                         "--json"])
    assert out["mtbf_h"] == pytest.approx(48.0)
    assert out["interval_s"] == pytest.approx((2 * 30 * 48 * 3600) ** 0.5)
    scaled = _json(capsys, ["budget", "interval", "--checkpoint-s", "30", "--mtbf-h", "49.5", "--measured-gpus",
                            "1024", "--gpus", "16384", "--json"])
    assert scaled["mtbf_h"] == pytest.approx(49.5 / 16)
    assert scaled["interval_s"] / 60 == pytest.approx(13.6, abs=0.1)


def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path):
    assert main(["budget", "young-daly", "--checkpoint-s", "30", "--mtbf-h", "0", "--restart-s", "600"]) == 2
    assert "mtbf_s must be > 0" in capsys.readouterr().err
    assert main(["budget", "compare", str(tmp_path / "nope.yaml")]) == 2
    assert "cannot read budget file" in capsys.readouterr().err
    assert main(["budget", "interval", "--checkpoint-s", "30", "--gpus", "8"]) == 2
    assert "--measured-gpus" in capsys.readouterr().err


def test_young_daly_reads_the_measured_inputs_of_a_job_from_the_store(tmp_path, capsys):
    import numpy as np

    from fleethealth.payloads.checkpoint import checkpoint_event
    from fleethealth.payloads.checkpoint_cost import checkpoint_cost_event
    from fleethealth.schema import Event, EventKind, StepBatch
    from fleethealth.store import open_store

    t0, dsn = 1_796_000_000.0, f"chdb://{tmp_path}/store"
    with open_store(dsn) as store:
        store.migrate()
        store.insert_steps([StepBatch(job="llm", step=k, node=node, ts=t0 + 60.0 * k, ranks=np.array([r], np.int32),
                                      gpus=np.array([0], np.int16), compute_s=np.array([1.0]))
                            for k in range(240) for r, node in enumerate(("gpu-a1", "gpu-a2"))])
        store.insert_events([e for k in range(24) for e in (
            checkpoint_event(ts=t0 + 600.0 * k, step=10 * k, uri="", last_verified_step=None, job="llm",
                             node="gpu-a1"),
            checkpoint_cost_event(ts=t0 + 600.0 * k + 9, step=10 * k, blocking_s=4.0, write_s=8.0, job="llm",
                                  node="gpu-a1"))]
            + [Event(node="gpu-a2", ts=t0 + 3600.0, kind=EventKind.INTERRUPTION, job="llm",
                     data={"interruption_id": "x", "detection_s": 20.0, "isolation_s": 40.0,
                           "reconfiguration_s": 100.0, "reload_s": 40.0})])
    out = _json(capsys, ["budget", "young-daly", "--job", "llm", "--store", dsn, "--json"])
    cp = out["checkpoint"]
    assert (cp["c_s"], cp["r_s"], cp["interval_s_now"]) == (4.0, 200.0, 600.0)
    assert cp["basis"]["mtbf"]["job_interruptions"] == 1 and cp["basis"]["mtbf"]["nodes"] == 2
    # the terms are the budget arithmetic at the job's interval now
    assert out["mtbf_h"] == pytest.approx(cp["mtbf_s"] / 3600) and out["interval_s"] == 600.0
    assert out["overhead"] == pytest.approx(cp["overhead_now"])
    assert out["optimal_interval_s"] == pytest.approx(cp["interval_s_recommended"])
    # a shorter window drops the stop; settings come through --set
    out = _json(capsys, ["budget", "young-daly", "--job", "llm", "--store", dsn, "--json",
                         "--set", "policy.interval.window_s=7200"])
    assert out["checkpoint"]["basis"]["mtbf"]["job_interruptions"] == 0
    # as it stood before the stop: at an event time of its own choosing
    out = _json(capsys, ["budget", "young-daly", "--job", "llm", "--store", dsn, "--json", "--at", str(t0 + 1800)])
    assert out["checkpoint"]["at"] == t0 + 1800 and out["checkpoint"]["basis"]["mtbf"]["job_interruptions"] == 0
    assert main(["budget", "young-daly", "--job", "llm", "--store", dsn, "--at", str(t0 + 7200)]) == 0
    assert "from 1 interruption in 2.00 h on 2 nodes" in capsys.readouterr().out
    assert main(["budget", "young-daly", "--job", "other", "--store", dsn]) == 2
    assert "no record of job 'other'" in capsys.readouterr().err
    assert main(["budget", "young-daly", "--job", "llm", "--store", dsn, "--mtbf-h", "3"]) == 2
    assert "leave out --mtbf-h" in capsys.readouterr().err
    assert main(["budget", "young-daly", "--checkpoint-s", "30"]) == 2
    assert "give --mtbf-h, --restart-s, or --job ID" in capsys.readouterr().err
    assert main(["budget", "young-daly", "--checkpoint-s", "1", "--mtbf-h", "1", "--restart-s", "1", "--at", "5"]) == 2
    assert "--at goes with --job" in capsys.readouterr().err
