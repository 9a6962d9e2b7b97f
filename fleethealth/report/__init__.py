"""``fleethealth report``: one self-contained HTML page about a job, from the store.

:func:`build` reads a job's slice of the store (:mod:`fleethealth.report.data`), draws each section
with matplotlib (:mod:`fleethealth.report.plots`, inline SVG) and fills the Jinja2 template
``report.html.j2``; the page needs no network to open. :mod:`fleethealth.report.scorecard` scores
a finished scenario run against its injected faults, for the demo's page and summary. A wing on
floor 4: it reads the store and the policy's goodput arithmetic, and nothing above.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleethealth.errors import ConfigError

if TYPE_CHECKING:
    from fleethealth.report.scorecard import Scorecard
    from fleethealth.store.protocol import StoreLike

__all__ = ["SECTIONS", "Built", "build", "render", "write", "require_extra", "check_writable"]

SECTIONS = ("heatmap", "temperature", "timeline", "sdc", "goodput", "checkpoint", "scorecard")
"""The page's sections, in order (``scorecard`` only for a scenario run); each has ``id`` = its name.
A closed-loop demo adds ``closedloop``."""

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class Built:
    """A rendered page and what went into it."""

    html: str
    job: str
    sections: tuple[str, ...]
    render_s: float


def build(store: StoreLike, job: str | None = None, *, scorecard: Scorecard | None = None,
          progress: Progress | None = None, closed_loop: Sequence[Any] = ()) -> Built:
    """Read ``job`` (default: the job with most steps) from ``store`` and render the page."""
    require_extra()
    import jinja2

    from fleethealth import __version__
    from fleethealth.report import plots
    from fleethealth.report.data import check_summary, load

    t0 = time.perf_counter()
    data = load(store, job)
    steps: list[tuple[str, Callable[[], str]]] = [
        ("heatmap", lambda: plots.heatmap(data)), ("temperature", lambda: plots.temperature(data)),
        ("timeline", lambda: plots.timeline(data)), ("sdc", lambda: plots.sdc(data)),
        ("goodput", lambda: plots.waterfall(data)), ("checkpoint", lambda: plots.checkpoint_interval(data)),
    ]
    if scorecard is not None:
        steps.append(("scorecard", lambda: plots.scorecard(scorecard)))
    if closed_loop:
        steps.append(("closedloop", lambda: plots.closed_loop(closed_loop)))
    figures: dict[str, str] = {}
    for i, (name, draw) in enumerate(steps):
        if progress is not None:
            progress(f"report: {name}", i, len(steps))
        figures[name] = draw()
    if progress is not None:
        progress("report", len(steps), len(steps))
    env = jinja2.Environment(loader=jinja2.PackageLoader("fleethealth.report", "templates"),
                             autoescape=jinja2.select_autoescape(["html", "j2"]))
    checks = check_summary(data.checks)
    html = env.get_template("report.html.j2").render(
        version=__version__, data=data, figures=figures, scorecard=scorecard, goodput=data.goodput,
        closed_loop=list(closed_loop),
        checks_failed=sum(f for _, f in checks.values()), checks_total=sum(n for n, _ in checks.values()),
        acted=[r for r in data.recommendations if r.action.value != "none"],
        generated=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    return Built(html=html, job=data.job, sections=tuple(figures), render_s=time.perf_counter() - t0)


def require_extra() -> None:
    """A :class:`ConfigError` naming the install when matplotlib or jinja2 is missing."""
    import importlib.util

    missing = [m for m in ("matplotlib", "jinja2") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"the report needs {' and '.join(missing)}: pip install 'fleethealth[report]'")


def check_writable(out: str | Path) -> Path:
    """``out`` as a path, after checking a file can be written there (a :class:`ConfigError`
    naming the cause otherwise)."""
    path = Path(out)
    if path.is_dir():
        raise ConfigError(f"cannot write the report to {path}: it is a directory")
    if not path.parent.is_dir():
        raise ConfigError(f"cannot write the report to {path}: no directory {path.parent}")
    existed = path.exists()
    try:
        with open(path, "a", encoding="utf-8"):
            pass
        if not existed:
            path.unlink()  # only a probe: leave nothing behind if the report then fails
    except OSError as exc:
        raise ConfigError(f"cannot write the report to {path}: {exc.strerror or exc}") from None
    return path


def render(store: StoreLike, job: str | None = None, *, scorecard: Scorecard | None = None) -> str:
    """The page's HTML text (see :func:`build`)."""
    return build(store, job, scorecard=scorecard).html


def write(store: StoreLike, out: str | Path, job: str | None = None, *, scorecard: Scorecard | None = None,
          progress: Progress | None = None, closed_loop: Sequence[Any] = ()) -> Built:
    """Render and write the page to ``out``; a path that cannot be written is a :class:`ConfigError`
    (checked before anything is drawn)."""
    require_extra()
    path = check_writable(out)
    built = build(store, job, scorecard=scorecard, progress=progress, closed_loop=closed_loop)
    try:
        path.write_text(built.html, encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot write the report to {path}: {exc.strerror or exc}") from None
    return built
