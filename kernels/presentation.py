"""Presenting self-test results: the exit code, one JSON record per test, and a rich table.

Exit codes of ``fleethealth selftest`` (and of the Slurm health check built on it): 0 when every
test passed; 1 when any test failed or was slow (a node that computes wrong answers, or right
answers too slowly, should not take work); 2 when the suite could not run at all (raised as a
:class:`~fleethealth.errors.FleetHealthError` before any result exists).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from fleethealth.kernels.results import SelfTestResult, Verdict

__all__ = ["EXIT_PASS", "EXIT_FAIL", "EXIT_CANNOT_RUN", "exit_code", "json_line", "render_table", "summary"]

EXIT_PASS = 0
EXIT_FAIL = 1
EXIT_CANNOT_RUN = 2

_STYLE = {Verdict.PASS: "green", Verdict.FAIL: "bold red", Verdict.SLOW: "yellow"}


def exit_code(results: Sequence[SelfTestResult]) -> int:
    """0 when every result passed, else 1 (an empty run is 2: nothing was tested)."""
    if not results:
        return EXIT_CANNOT_RUN
    return EXIT_PASS if all(r.verdict is Verdict.PASS for r in results) else EXIT_FAIL


def json_line(result: SelfTestResult, node: str) -> bytes:
    """One ``--json`` output line: the ``selftest`` record plus ``node``."""
    return orjson.dumps({**result.to_data(), "node": node})


def summary(results: Sequence[SelfTestResult]) -> str:
    """``12 tests: 11 pass, 1 fail, 0 slow`` and the failing tests by name."""
    counts = {v: sum(r.verdict is v for r in results) for v in Verdict}
    text = f"{len(results)} tests: " + ", ".join(f"{counts[v]} {v.value}" for v in Verdict)
    bad = [f"{r.test}@{r.device}" for r in results if r.verdict is not Verdict.PASS]
    return text + (f" ({', '.join(bad)})" if bad else "")


def render_table(results: Sequence[SelfTestResult], console: Any, *, title: str = "fleethealth selftest") -> None:
    """Print the results as a table on a rich ``console``."""
    from rich.table import Table

    table = Table(title=title)
    for name, justify in (("test", "left"), ("device", "left"), ("verdict", "left"), ("throughput", "right"),
                          ("baseline", "right"), ("time s", "right"), ("mismatches", "left")):
        table.add_column(name, justify=justify, no_wrap=name != "mismatches")  # type: ignore[arg-type]
    for r in results:
        where = ", ".join(m.describe() for m in r.mismatches[:3])
        if r.mismatch_total > 3:
            where += f" … ({r.mismatch_total} in all)"
        table.add_row(r.test, r.device, f"[{_STYLE[r.verdict]}]{r.verdict.value}[/]", f"{r.throughput:.4g} {r.unit}",
                      "-" if r.baseline is None else f"{r.baseline:.4g}", f"{r.duration_s:.3f}", where or "-")
    console.print(table)
    console.print(summary(results))
