"""The policy package's public surface and its import weight."""

from __future__ import annotations

import importlib
import subprocess
import sys

import fleethealth.policy as policy

MODULES = ("budget", "engine", "eviction", "goodput", "guards", "paging", "persist", "stage", "rules", "rules.context",
           "rules.straggler", "rules.sdc", "rules.hang", "rules.hardware", "rules.risk", "quarantine")


def test_exported_names():
    assert set(policy.__all__) == {
        "PolicyEngine", "PolicyStage", "Decisions", "EvictionOutcome", "EvictionWatch",
        "HealthyPosterior", "payback_s", "CircuitBreaker", "QuarantineRecord",
        "Pager", "PageRule", "Page", "PageReport", "Interruption", "Timeline", "GoodputReport", "goodput",
        "timeline", "YoungDaly", "AutoInterval", "Comparison", "young_daly", "auto_interval", "compare",
    }
    mods = [policy] + [importlib.import_module(f"fleethealth.policy.{m}") for m in MODULES]
    for mod in mods:
        for name in mod.__all__:
            assert hasattr(mod, name), f"{mod.__name__}.{name}"
    assert {"quarantine", "release", "quarantined", "add_run"} <= set(mods[-1].__all__)


def test_import_stays_light():
    code = ("import sys, fleethealth.policy, fleethealth.policy.persist; "
            "print(sorted(m for m in ('chdb', 'torch', 'fastapi', 'clickhouse_connect') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
