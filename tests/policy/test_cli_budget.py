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
