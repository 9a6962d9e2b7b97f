"""Stand-ins for a Slurm cluster, which these machines do not have.

``fake_srun`` is an executable that logs its argument list and then runs the command that follows
``-w NODE -N 1 -n 1 [options]`` on this machine, as srun would on NODE. ``replay`` is a node-side
command that prints a recorded ``selftest --json`` run for the node named by ``--node`` (from
``recordings/``, taken from a real ``fleethealth selftest --suite full --device cpu`` run), or
exits 2 with one line when there is no recording, as a node without its devices would.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

RECORDINGS = Path(__file__).parent / "recordings"

_SRUN = f"""#!{sys.executable}
import json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_SRUN_LOG"], "a") as fh:
    fh.write(json.dumps(args) + "\\n")
if args[:1] != ["-w"] or args[2:6] != ["-N", "1", "-n", "1"]:
    print("srun: error: unexpected arguments", file=sys.stderr)
    sys.exit(1)
rest = args[6:]
while rest and rest[0].startswith("-"):
    rest = rest[1:]
os.execvp(rest[0], rest)
"""

_REPLAY = f"""#!{sys.executable}
import json, os, sys
node = sys.argv[sys.argv.index("--node") + 1]
path = os.path.join(os.environ["FAKE_RECORDINGS"], node + ".jsonl")
if not os.path.exists(path):
    print("fleethealth selftest: error: CuPy is not installed", file=sys.stderr)
    sys.exit(2)
text = open(path).read()
sys.stdout.write(text)
ok = all(json.loads(line)["verdict"] == "pass" for line in text.splitlines() if line.strip())
sys.exit(0 if ok else 1)
"""


def _script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.fixture
def fake_srun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FAKE_SRUN_LOG", str(tmp_path / "srun.log"))
    return _script(tmp_path / "srun", _SRUN)


@pytest.fixture
def replay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "recordings"
    folder.mkdir()
    monkeypatch.setenv("FAKE_RECORDINGS", str(folder))
    return _script(tmp_path / "replay", _REPLAY)


def srun_calls(tmp_path: Path) -> list[list[str]]:
    log = tmp_path / "srun.log"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def record_node(tmp_path: Path, node: str, *, fail_test: str | None = None, drop_test: str | None = None) -> None:
    """Write ``node``'s recording: the real full-suite run, optionally with one test failed or missing."""
    lines = []
    for line in (RECORDINGS / "full_cpu_pass.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["test"] == drop_test:
            continue
        rec["node"] = node
        if rec["test"] == fail_test:
            rec["verdict"] = "fail"
            rec["mismatches"] = [{"where": "C", "row": 3, "col": 4, "bits": [22]}]
            rec["mismatch_total"] = 1
        lines.append(json.dumps(rec))
    (tmp_path / "recordings" / f"{node}.jsonl").write_text("\n".join(lines) + "\n")
