"""``fleethealth selftest`` with a bus that is down or misnamed: the verdict a sweep reads from the
exit code and the printed records must not depend on the bus.

A sweep launches ``selftest --kafka DSN`` on each node; a bus outage used to turn a passing suite
into exit 2 with nothing printed. Runs in-process on the CPU with one or two small tests; the bus
is a closed local port (nothing listens), so the producer fails for real.
"""

from __future__ import annotations

import socket

import orjson
import pytest

from fleethealth.commands import main


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _records(out: str) -> list[dict]:
    return [orjson.loads(line) for line in out.splitlines() if line.strip()]


def test_bus_down_keeps_results_and_the_suites_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    """A failing suite with the bus down: exit 1 (the suite's verdict, not 2), the record printed,
    a warning on stderr. (One run: each waits out the producer's connect timeout.)"""
    argv = ["selftest", "--device", "cpu", "--only", "gemm_exact_bf16", "--json", "--node", "n0101",
            "--inject-fault", "bitflip", "--kafka", f"kafka://127.0.0.1:{_closed_port()}"]
    assert main(argv) == 1
    out, err = capsys.readouterr()
    records = _records(out)
    assert [(r["test"], r["node"], r["verdict"]) for r in records] == [("gemm_exact_bf16", "n0101", "fail")]
    assert "warning: results not published" in err


@pytest.mark.parametrize(("dsn", "message"), [("127.0.0.1:9092", "not of the form"),
                                              ("kafka://127.0.0.1:99999", "is not host:port"),
                                              ("amqp://127.0.0.1:5672", "unknown bus scheme")])
def test_malformed_dsn_is_refused_before_the_suite_runs(capsys: pytest.CaptureFixture[str], dsn, message) -> None:
    assert main(["selftest", "--device", "cpu", "--only", "gemm_exact_fp32", "--json", "--kafka", dsn]) == 2
    out, err = capsys.readouterr()
    assert out == "" and message in err
