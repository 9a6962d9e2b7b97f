"""``fleethealth report`` and the demo's ``report.html``, as a person uses them: a small scenario through
the real broker, detectors and chDB store (``fleethealth demo`` in a subprocess), then the page read
back: every section has its plot, the plots show what the store holds, nothing needs the network."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from fleethealth.report import SECTIONS

pytest.importorskip("matplotlib", reason="the report extra (matplotlib) is not installed")
pytest.importorskip("jinja2", reason="the report extra (jinja2) is not installed")

SCENARIO = """
seed: 3
fleet: {racks: 4, nodes_per_rack: 2, gpus_per_node: 4}
job: {id: train-rep, steps: 240, step_time_s: 2.0, jitter: 0.02}
checks: {selfcheck_every: 20, replay_every: 80, checkpoint_every: 10}
faults:
  - {kind: thermal_straggler, node: n0005, gpu: 2, start_step: 40, slowdown: 0.20}
  - {kind: hot_aisle, rack: r03, start_step: 100, temp_rise_c: 15, slowdown: 0.10}
  - {kind: sdc_deterministic, node: n0002, gpu: 1, start_step: 90}
"""


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fleethealth", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("report-demo")
    (root / "scenario.yaml").write_text(SCENARIO)
    run = _cli("demo", "--json", "--closed-loop", "--scenario", str(root / "scenario.yaml"),
               "--out", str(root / "out"), "--data", str(root / "data"))
    assert run.returncode == 0, run.stderr
    return root, orjson.loads(run.stdout)


def _sections(html: str) -> dict[str, str]:
    found = {}
    for m in re.finditer(r'<section id="([a-z]+)">(.*?)</section>', html, flags=re.S):
        found[m.group(1)] = m.group(2)
    return found


def _svg_text(section: str) -> str:
    """The words drawn in a section's SVG (matplotlib keeps text as <text> with svg.fonttype none)."""
    return " ".join(re.findall(r"<text[^>]*>([^<]*)</text>", section))


@pytest.mark.slow
def test_demo_writes_a_self_contained_report_with_every_plot(demo: tuple[Path, dict]) -> None:
    root, summary = demo
    page = root / "out" / "report.html"
    assert summary["report"] == str(page) and page.is_file()
    html = page.read_text()
    sections = _sections(html)
    assert set(sections) == {*SECTIONS, "closedloop"}
    for name, body in sections.items():
        assert body.count("<svg") == 1, name
        assert len(re.findall(r"<(path|use|rect|text)\b", body)) > 20, f"{name}: an empty plot"
    # nothing to fetch: no scripts, stylesheets or images from elsewhere (SVG namespaces are names, not fetches)
    assert not re.search(r'<(script|link|img|iframe)\b', html)
    assert not re.search(r'(src|href)="(https?:)?//', html)
    # each plot shows what the store holds
    assert "n0005 NODE_THERMAL" in _svg_text(sections["heatmap"])              # the straggler, where it fired
    assert "hot aisle r03" in _svg_text(sections["temperature"])               # the episode, shaded
    timeline = _svg_text(sections["timeline"])
    assert "n0005 [allowed]" in timeline and "breaker" in timeline             # guards and the breaker band
    assert "rollback target 80" in _svg_text(sections["sdc"])                  # last passing replay before 90
    assert "ETTR = 0." in _svg_text(sections["goodput"])
    assert "thermal_straggler n0005" in _svg_text(sections["scorecard"])
    assert [r["policy"] for r in summary["closed_loop"]] == ["fleethealth", "seed rule", "no detection"]
    loop = _svg_text(sections["closedloop"])
    assert "fleethealth 2 evictions" in loop  # evict n0005, quarantine n0002; the hot aisle goes to facilities
    assert "seed rule 3 evictions" in loop    # the rule takes n0005 and both nodes of the hot rack r03


@pytest.mark.slow
def test_demo_scores_each_injected_fault(demo: tuple[Path, dict]) -> None:
    root, summary = demo
    card = orjson.loads((root / "out" / "scorecard.json").read_bytes())
    assert summary["scorecard"] == card
    by_fault = {f["fault"]: f for f in card["faults"]}
    assert set(by_fault) == {"thermal_straggler", "hot_aisle", "sdc_deterministic"}
    thermal = by_fault["thermal_straggler"]
    assert (thermal["found"], thermal["kind"], thermal["diagnosis"], thermal["node"]) == (
        True, "straggler", "NODE_THERMAL", "n0005")
    assert 0 <= thermal["latency_steps"] <= 10 and (thermal["action"], thermal["guard"]) == ("evict", "allowed")
    aisle = by_fault["hot_aisle"]
    assert aisle["diagnosis"] == "ENVIRONMENTAL" and aisle["action"] == "alert_facilities"
    sdc = by_fault["sdc_deterministic"]
    assert sdc["found"] and sdc["node"] == "n0002" and "rollback" in sdc["action"].split("+")
    assert card["healthy_flagged"] == [] and card["found"] == card["injected"] == 3


@pytest.mark.slow
def test_report_command_rewrites_the_page_from_the_store(demo: tuple[Path, dict], tmp_path: Path) -> None:
    root, _ = demo
    out = tmp_path / "again.html"
    run = _cli("report", "--data", str(root / "data"), "--job", "train-rep", "--out", str(out))
    assert run.returncode == 0, run.stderr
    assert f"wrote {out} (job train-rep, 6 sections" in run.stdout
    sections = _sections(out.read_text())
    assert set(sections) == set(SECTIONS) - {"scorecard"}  # a store alone has no ground truth to score
    assert all(body.count("<svg") == 1 for body in sections.values())


@pytest.mark.slow
@pytest.mark.parametrize(("case", "needle"), [
    ("unknown job", "no job 'nope' in the store"),
    ("unwritable", "cannot write the report to"),
    ("no directory", "no directory"),
    ("a directory", "it is a directory"),
    ("empty store", "holds no job's steps"),
])
def test_bad_input_is_one_line_and_exit_2(demo: tuple[Path, dict], tmp_path: Path, case: str, needle: str) -> None:
    root, _ = demo
    data, out, job = str(root / "data"), str(tmp_path / "r.html"), []
    if case == "unknown job":
        job = ["--job", "nope"]
    elif case == "unwritable":
        out = "/proc/fleethealth-report.html"  # refused even to root: procfs takes no new files
    elif case == "a directory":
        out = str(tmp_path)
    elif case == "no directory":
        out = str(tmp_path / "missing" / "r.html")
    elif case == "empty store":
        empty = tmp_path / "empty"
        made = subprocess.run([sys.executable, "-c", "import sys; from fleethealth.store import open_store; "
                               "s = open_store(sys.argv[1]); s.migrate(); s.close()", f"chdb://{empty}/store"],
                              capture_output=True, text=True, timeout=120)  # a migrated store, no rows
        assert made.returncode == 0, made.stderr
        data = str(empty)
    run = _cli("report", "--data", data, "--out", out, *job)
    assert run.returncode == 2, run.stdout + run.stderr
    assert needle in run.stderr and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
    assert case == "a directory" or not Path(out).exists()


@pytest.mark.slow
def test_page_renders_in_a_headless_browser(demo: tuple[Path, dict], tmp_path: Path) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-headless-shell")
    if browser is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium): no headless screenshot")
    root, _ = demo
    shot = tmp_path / "page.png"
    run = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1280,4000",
                          f"--screenshot={shot}", (root / "out" / "report.html").as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert shot.is_file(), run.stderr
    from matplotlib import image

    pixels = image.imread(str(shot))
    assert pixels.std() > 0.05, "the screenshot is blank"
