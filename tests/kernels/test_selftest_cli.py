"""``fleethealth selftest``: exit 0 / 1 / 2, one JSON record per test, results on the bus and in
the store, and ``slow`` against a baseline. Runs in-process on the CPU with small test subsets."""

from __future__ import annotations

import time
import uuid

import orjson
import pytest

from fleethealth.commands import main
from fleethealth.kernels.suite import SIZES, plan


def _records(out: str) -> list[dict]:
    return [orjson.loads(line) for line in out.splitlines() if line.strip()]


def test_healthy_run_exits_0_with_one_record_per_test(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["selftest", "--device", "cpu", "--only", "gemm_exact_fp32,gemm_abft_fp32,memory", "--json",
                 "--node", "n0042"])
    records = _records(capsys.readouterr().out)
    assert code == 0
    assert [r["test"] for r in records][:2] == ["gemm_exact_fp32", "gemm_abft_fp32"]
    assert len(records) == 7 and all(r["verdict"] == "pass" and r["node"] == "n0042" for r in records)
    for r in records:
        assert r["throughput"] > 0 and r["unit"] in ("TFLOP/s", "GB/s") and r["duration_s"] > 0
        assert r["mismatches"] == [] and r["max_error"] == 0.0 or r["test"] == "gemm_abft_fp32"


@pytest.mark.parametrize(("fault", "only", "failing"), [
    ("bitflip", "gemm_exact_bf16", "gemm_exact_bf16"),
    ("stuck-bit", "memory", "memory_walking_ones"),
])
def test_injected_fault_exits_1_and_the_record_locates_it(capsys: pytest.CaptureFixture[str], fault: str, only: str,
                                                           failing: str) -> None:
    code = main(["selftest", "--device", "cpu", "--only", only, "--inject-fault", fault, "--json"])
    records = {r["test"]: r for r in _records(capsys.readouterr().out)}
    assert code == 1
    bad = records[failing]
    assert bad["verdict"] == "fail" and bad["mismatches"]
    assert len(bad["mismatches"][0]["bits"]) == 1


def test_slow_fault_against_a_baseline_file_is_slow_and_exits_1(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    healthy = tmp_path / "healthy.jsonl"
    assert main(["selftest", "--device", "cpu", "--only", "memory", "--json"]) == 0
    healthy.write_text(capsys.readouterr().out)
    code = main(["selftest", "--device", "cpu", "--only", "memory", "--json", "--baseline", str(healthy),
                 "--inject-fault", "slow"])
    records = _records(capsys.readouterr().out)
    assert code == 1
    # A 25 % stretch is far outside 5 %; but the two runs' times are this machine's, and on a loaded one a
    # pattern may run more than 25 % faster than its baseline did and still pass: at least one is slow
    assert sum(r["verdict"] == "slow" for r in records) >= 1
    assert all(r["verdict"] in ("pass", "slow") and r["baseline"] for r in records)


@pytest.mark.parametrize(("argv", "message"), [
    (["--suite", "nightly"], "unknown suite 'nightly'"),
    (["--device", "cuda:3"], "CuPy is not installed"),
    (["--device", "tpu"], "unknown device"),
    (["--only", "gemm_exact_fp64"], "unknown test 'gemm_exact_fp64'"),
    (["--inject-fault", "cosmic-ray"], "unknown fault 'cosmic-ray'"),
])
def test_bad_input_exits_2_with_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    code = main(["selftest", "--device", "cpu", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("fleethealth selftest: error: ") and message in err and "\n" not in err


def test_results_go_to_the_store_and_become_fleet_baselines(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from fleethealth.store import open_store

    dsn = f"chdb://{tmp_path}/store"
    with open_store(dsn) as store:  # selftest --store checks the schema, never migrates it
        store.migrate()
    for _ in range(3):
        assert main(["selftest", "--device", "cpu", "--only", "gemm_exact_fp32", "--store", dsn, "--node", "n0003",
                     "--json"]) == 0
    capsys.readouterr()
    assert main(["selftest", "--device", "cpu", "--only", "gemm_exact_fp32", "--store", dsn, "--json"]) in (0, 1)
    last = _records(capsys.readouterr().out)[0]
    assert last["baseline"] is not None and last["extra"]["baseline_source"] == "fleet median of 3"
    with open_store(dsn) as store:
        events = store.events(kind="selftest", node="n0003")
    assert len(events) == 3 and {e.data["test"] for e in events} == {"gemm_exact_fp32"}


def test_results_are_published_to_fh_events(broker, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """Signed with the node's key (``--key-file``): a consumer requiring signatures takes them."""
    from fleethealth.bus import Consumer
    from fleethealth.schema import EventKind, Topic
    from fleethealth.signing import KeyRing, Verifier, node_key

    node = f"st-{uuid.uuid4().hex[:8]}"
    secret = b"z" * 32
    (tmp_path / "node-key").write_text(node_key(secret, node).hex())
    assert main(["selftest", "--device", "cpu", "--only", "gemm_exact_fp32,gemm_repeat_fp32", "--kafka",
                 broker.dsn, "--node", node, "--key-file", str(tmp_path / "node-key")]) == 0
    capsys.readouterr()
    seen = []
    with Consumer(broker.dsn, [Topic.EVENTS], f"g-{node}", session_timeout_s=2.0, max_poll_interval_s=2.0,
                  verifier=Verifier("require", KeyRing(fleet_secret=secret))) as cons:
        deadline = time.monotonic() + 30
        while len(seen) < 2 and time.monotonic() < deadline:
            seen += [r.msg for r in cons.poll(timeout_s=0.5) if r.msg.node == node]
    assert sorted(e.data["test"] for e in seen) == ["gemm_exact_fp32", "gemm_repeat_fp32"]
    assert all(e.kind is EventKind.SELFTEST and e.data["verdict"] == "pass" for e in seen)
    assert cons.verifier.verified_total >= 2


def test_quick_suite_plan_is_small_on_a_cpu() -> None:
    steps = plan("quick", ["cpu"])
    assert [s.group for s in steps] == ["gemm_exact_fp32", "gemm_exact_bf16", "gemm_abft_fp32", "gemm_repeat_fp32",
                                        "memory", "collective"]
    assert SIZES[("quick", False)].memory <= 16 << 20
    full_gpu = plan("full", ["cuda:0", "cuda:1"])
    assert sum(s.group == "collective" for s in full_gpu) == 1
    assert [s.devices for s in full_gpu if s.group == "collective"] == [("cuda:0", "cuda:1")]
