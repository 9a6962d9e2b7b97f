"""One install layout in every document: each path the docs, the systemd unit and the Slurm health
check name either is in this tree or is made by the documented install commands.

The layout (deploy/README.md, "Slurm", "Install"): fleethealth in the venv ``/opt/fleethealth/venv``,
the health check at ``/opt/fleethealth/healthcheck.sh``, settings in ``/etc/fleethealth/``, the unit
in ``/etc/systemd/system/``. The README's ``install`` lines are run as written under a stand-in root
(their absolute targets moved below a temporary directory); the venv and pip lines are read: a venv
at DIR has ``DIR/bin/pip``, and pip installing this project there adds its console scripts
(pyproject's ``[project.scripts]``) to ``DIR/bin``.
"""

from __future__ import annotations

import glob
import re
import shlex
import subprocess
import textwrap
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "deploy" / "README.md"
SLURM = ROOT / "deploy" / "slurm"
DOCS = [ROOT / "README.md", README, SLURM / "README.md", SLURM / "healthcheck.sh",
        *sorted((ROOT / "deploy" / "systemd").glob("*.service")), *sorted((ROOT / "docs").glob("*.md"))]
INSTALL_ROOT = "/opt/fleethealth"
"""fleethealth's own files on a host; every path under it that a document names must be installed."""
_ABSOLUTE = re.compile(r"(?<![\w.$-])(/(?:opt|etc|usr/local/bin)/[A-Za-z0-9_./-]*[A-Za-z0-9_-])")


def _install_blocks() -> list[str]:
    """The bash blocks of deploy/README.md's Slurm install."""
    text = README.read_text()
    start = text.index("### Install\n", text.index("\n## Slurm"))
    section = text[start:text.index("\n### ", start + 1)]
    return [textwrap.dedent(b) for b in re.findall(r"^ *```bash\n(.*?)^ *```", section, re.S | re.M)]


def _commands(block: str) -> list[str]:
    """Each command of a block: continuations joined, comments and heredoc bodies left out."""
    out, heredoc = [], None
    for line in block.replace("\\\n", " ").splitlines():
        if heredoc is not None:
            heredoc = None if line == heredoc else heredoc
            continue
        match = re.search(r"<<'?(\w+)'?", line)
        heredoc = match.group(1) if match else None
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            out += [c.strip() for c in line.split("&&")]
    return out


def _made_by_the_install(tmp_path: Path) -> set[str]:
    """Absolute paths the documented install commands make (the install lines run under tmp_path)."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    made: set[str] = set()
    for block in _install_blocks():
        for command in _commands(block):
            argv = shlex.split(command.split("<<", 1)[0])
            if argv[:3] == ["python3", "-m", "venv"]:
                venv = argv[3]
                made |= {venv, f"{venv}/bin", f"{venv}/bin/python", f"{venv}/bin/pip"}
            elif argv[0].endswith("/bin/pip") and argv[1] == "install":
                assert argv[0] in made, f"{argv[0]}: no venv made before it"
                assert all(spec.startswith(".[") for spec in argv[2:]), f"not this checkout: {command}"
                made |= {f"{argv[0].rsplit('/', 1)[0]}/{name}" for name in scripts}
            elif argv[0] == "install":
                source, target = argv[-2], argv[-1]
                assert source == "/dev/stdin" or (ROOT / source).is_file(), f"{source} is not in the tree"
                moved = command.replace(target, f"{tmp_path}{target}")
                run = subprocess.run(["bash", "-euo", "pipefail", "-c", _with_heredoc(block, command, moved)],
                                     cwd=ROOT, capture_output=True, text=True, timeout=30)
                assert run.returncode == 0, f"{command}: {run.stderr}"
                assert (tmp_path / target.lstrip("/")).is_file(), target
                made |= {target, *map(str, Path(target).parents)}
    return made


def _with_heredoc(block: str, command: str, moved: str) -> str:
    """``moved`` with the heredoc body that follows ``command`` in the block, when it has one."""
    match = re.search(r"<<'?(\w+)'?", command)
    if not match:
        return moved
    body = block.split(command, 1)[1].split("\n", 1)[1]
    return moved + "\n" + body.split(f"\n{match.group(1)}\n", 1)[0] + f"\n{match.group(1)}\n"


def test_every_installed_path_the_docs_name_is_made_by_the_install(tmp_path):
    made = _made_by_the_install(tmp_path)
    assert f"{INSTALL_ROOT}/venv/bin/fleethealth" in made and f"{INSTALL_ROOT}/healthcheck.sh" in made
    named: dict[str, set[str]] = {}
    for doc in DOCS:
        for path in _ABSOLUTE.findall(doc.read_text()):
            named.setdefault(path.rstrip("/."), set()).add(doc.relative_to(ROOT).as_posix())
    assert not [p for p in named if p.startswith("/usr/local/bin/fleethealth")], \
        "fleethealth lives in the venv, not /usr/local/bin"
    ours = {p: docs for p, docs in named.items() if p == INSTALL_ROOT or p.startswith(INSTALL_ROOT + "/")}
    missing = {p: sorted(docs) for p, docs in ours.items() if p not in made}
    assert not missing, f"named but never installed: {missing}"


def test_the_unit_and_the_health_check_start_the_installed_fleethealth(tmp_path):
    made = _made_by_the_install(tmp_path)
    unit = (ROOT / "deploy" / "systemd" / "fleethealth-probe.service").read_text()
    (start,) = re.findall(r"^ExecStart=(\S+)", unit, re.M)
    assert start in made
    installed_conf = (tmp_path / "etc" / "fleethealth" / "healthcheck.conf").read_text()
    assert re.search(r"^FLEETHEALTH=(\S+)$", installed_conf, re.M).group(1) in made
    assert "/etc/systemd/system/fleethealth-probe.service" in made
    for doc in DOCS:
        for program in re.findall(r"HealthCheckProgram=(\S+)", doc.read_text()):
            assert program in made, f"{doc.relative_to(ROOT)}: HealthCheckProgram={program} is not installed"


def test_every_tree_path_the_docs_name_exists():
    """``deploy/…`` anywhere, and deploy/README.md's own ``k8s/…``, ``slurm/…`` … relative to deploy/;
    the overlay the Kubernetes install's step 1 makes (``overlays/mine``) is the one exception."""
    named = set()
    for doc in DOCS:
        named |= {p for p in re.findall(r"(?<![\w/.-])(deploy/[A-Za-z0-9_./*-]+)", doc.read_text())}
    relative = r"`((?:k8s|clickhouse|kafka|slurm|systemd|ci|grafana)/[A-Za-z0-9_./*-]+)"
    named |= {"deploy/" + p for p in re.findall(relative, README.read_text())}
    missing = sorted(p for p in named if "overlays/mine" not in p and not glob.glob(str(ROOT / p.rstrip("."))))
    assert not missing, f"named in the docs, not in the tree: {missing}"
