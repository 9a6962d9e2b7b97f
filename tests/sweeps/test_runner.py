"""The sweep end to end: riskiest first, results to the bus and the store, and return to pool
only after the complete full suite passes (the release recorded in the quarantine book).

Nodes answer through ``fake_srun`` + ``replay`` (see conftest): a recorded real full-suite run,
optionally with one test failed or missing.
"""

from __future__ import annotations

import time
import uuid

import pytest

from fleethealth.errors import ConfigError
from fleethealth.kernels.results import SelfTestResult
from fleethealth.policy import quarantine
from fleethealth.schema import Finding, FindingKind
from fleethealth.sweeps.launch import NodeRun, SrunLauncher
from fleethealth.sweeps.release import release_decision
from fleethealth.sweeps.runner import run_sweep

from .conftest import RECORDINGS, record_node, srun_calls


def _recorded_run(node: str, suite: str = "full", drop: str | None = None, fail: str | None = None) -> NodeRun:
    import json

    results = []
    for line in (RECORDINGS / "full_cpu_pass.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["test"] == drop:
            continue
        if rec["test"] == fail:
            rec["verdict"] = "fail"
        rec["suite"] = suite
        results.append(SelfTestResult.from_data(rec))
    return NodeRun(node, suite, 1 if fail else 0, tuple(results))


def test_release_rule() -> None:
    assert release_decision(_recorded_run("n1"), quarantined=True).release
    assert not release_decision(_recorded_run("n1"), quarantined=False).release
    partial = release_decision(_recorded_run("n1", drop="memory_checkerboard"), quarantined=True)
    assert not partial.release and "memory_checkerboard@cpu" in partial.reason
    assert partial.evidence["verdict"] == "incomplete"
    failed = release_decision(_recorded_run("n1", fail="gemm_abft_fp32"), quarantined=True)
    assert not failed.release and "gemm_abft_fp32@cpu" in failed.reason and failed.evidence["verdict"] == "fail"
    quick = release_decision(_recorded_run("n1", suite="quick"), quarantined=True)
    assert not quick.release and "only a passing full suite" in quick.reason


def test_sweep_orders_by_risk_publishes_stores_and_returns_the_healthy_quarantined_node(
        store, broker, fake_srun, replay, tmp_path) -> None:
    from fleethealth.bus import Consumer, Producer
    from fleethealth.schema import Topic

    tag = uuid.uuid4().hex[:6]
    healthy_q, sick_q, partial_q, risky, plain = (f"sw{tag}-{i}" for i in range(5))
    for node in (healthy_q, risky, plain):
        record_node(tmp_path, node)
    record_node(tmp_path, sick_q, fail_test="gemm_exact_bf16")
    record_node(tmp_path, partial_q, drop_test="collective_all_gather")
    for node in (healthy_q, sick_q, partial_q):
        quarantine.quarantine(store, node, "sdc from cross-rank replay", ts=1000.0)
    store.insert_findings([Finding(kind=FindingKind.FAILURE_RISK, node=risky, ts=900.0, probability=0.8,
                                   detector="test")])
    launcher = SrunLauncher(srun=str(fake_srun), command=(str(replay),))
    with Producer(broker.dsn) as producer:
        report = run_sweep([plain, risky, sick_q, healthy_q, partial_q], launcher=launcher, store=store,
                           producer=producer)

    # Quarantined nodes first (by name among equals), then the at-risk node, then the rest.
    order = [call[1] for call in srun_calls(tmp_path)]
    assert order == sorted([healthy_q, sick_q, partial_q]) + [risky, plain]
    status = {o.run.node: o.run.status.value for o in report.outcomes}
    assert status == {healthy_q: "pass", sick_q: "fail", partial_q: "pass", risky: "pass", plain: "pass"}
    assert report.exit_code == 1

    # Return to pool: only the node with a complete passing full suite, and the book records why.
    released = {o.run.node for o in report.outcomes if o.released}
    assert released == {healthy_q}
    assert quarantine.record(store, healthy_q) is None
    assert quarantine.record(store, sick_q) is not None and quarantine.record(store, partial_q) is not None
    assert [e.action for e in quarantine.history(store, healthy_q)] == ["quarantine", "release"]
    refused = quarantine.history(store, partial_q)[-1]
    assert refused.action == "release_refused" and "incomplete" in refused.detail

    # Every result is in the store (13 tests plus the whole-suite record) and on the bus.
    stored = store.events(kind="selftest", node=healthy_q)
    assert len(stored) == 14
    suite = [e for e in stored if e.data["test"] == "suite"]
    assert len(suite) == 1 and suite[0].data["verdict"] == "pass"
    assert quarantine.check_release(healthy_q, 1000.0, suite[0].data) is None  # a record an operator can cite by id
    seen: set[tuple[str, str]] = set()
    with Consumer(broker.dsn, [Topic.EVENTS], f"g-{tag}", session_timeout_s=2.0, max_poll_interval_s=2.0) as cons:
        deadline = time.monotonic() + 30
        while len(seen) < 5 * 13 - 1 and time.monotonic() < deadline:
            seen |= {(r.msg.node, r.msg.data["test"]) for r in cons.poll(timeout_s=0.5)
                     if r.msg.node.startswith(f"sw{tag}-")}
    assert len(seen) == 5 * 13 - 1


def test_sweep_without_nodes_or_store_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="no nodes to sweep"):
        run_sweep(None, launcher=SrunLauncher())
    with pytest.raises(ConfigError, match="parallel"):
        run_sweep(["n1"], launcher=SrunLauncher(), parallel=0)


def test_sweep_cli_with_srun_prints_one_json_object_per_node(fake_srun, replay, tmp_path, capsys) -> None:
    import orjson

    from fleethealth.commands import main

    record_node(tmp_path, "n0101")
    code = main(["sweep", "n0101", "n0102", "--launcher", "srun", "--srun", str(fake_srun), "--remote-command",
                 str(replay), "--json", "--parallel", "2"])
    rows = [orjson.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 1
    assert [(r["node"], r["status"], r["tests"]) for r in rows] == [("n0101", "pass", 13), ("n0102", "error", 0)]
    assert "CuPy is not installed" in rows[1]["error"]
    assert main(["sweep", "bad;name"]) == 2


def test_a_node_far_below_the_fleet_median_of_its_model_is_slow(store, fake_srun, replay, tmp_path) -> None:
    import json

    from fleethealth.kernels.results import Verdict

    recorded = json.loads((RECORDINGS / "full_cpu_pass.jsonl").read_text().splitlines()[0])  # gemm_exact_fp32
    fleet = [SelfTestResult.from_data({**recorded, "throughput": 10 * recorded["throughput"], "ts": 10.0 + i})
             for i in range(3)]
    store.insert_events([r.to_event(f"peer{i}") for i, r in enumerate(fleet)])
    record_node(tmp_path, "n0200")
    report = run_sweep(["n0200"], launcher=SrunLauncher(srun=str(fake_srun), command=(str(replay),)), store=store)
    run = report.outcomes[0].run
    gemm = next(r for r in run.results if r.test == "gemm_exact_fp32")
    assert gemm.verdict is Verdict.SLOW and gemm.baseline == 10 * recorded["throughput"]
    assert run.status.value == "slow" and report.exit_code == 1
    stored = store.events(kind="selftest", node="n0200")
    assert {e.data["test"]: e.data["verdict"] for e in stored}["gemm_exact_fp32"] == "slow"


def test_the_sweep_on_a_node_signs_its_suite_record(store, fake_srun, replay, tmp_path) -> None:
    """With the node's own key (``--key-file``), the whole-suite record in the store carries the node's
    signature, which the API's release checks under signing.mode = require; another node's key signs nothing."""
    from fleethealth.signing import KeyRing, Signer, verify_record

    secret = b"q" * 32
    node = f"sg{uuid.uuid4().hex[:6]}"
    record_node(tmp_path, node)
    quarantine.quarantine(store, node, "sdc", ts=1000.0)

    class _Bus:
        def __init__(self, signer):
            self.signer, self.sent = signer, []

        def publish(self, event):
            self.sent.append(event)

        def flush(self):
            pass

    launcher = SrunLauncher(srun=str(fake_srun), command=(str(replay),))
    run_sweep([node], launcher=launcher, store=store, producer=_Bus(Signer.for_node(secret, node)))
    (suite,) = [e for e in store.events(kind="selftest", node=node) if e.data["test"] == "suite"]
    assert verify_record(KeyRing(fleet_secret=secret), node, suite.ts, "selftest", suite.data) is None
    other = f"{node}x"
    record_node(tmp_path, other)
    quarantine.quarantine(store, other, "sdc", ts=1000.0)
    run_sweep([other], launcher=launcher, store=store, producer=_Bus(Signer.for_node(secret, node)))
    (unsigned,) = [e for e in store.events(kind="selftest", node=other) if e.data["test"] == "suite"]
    assert "no signature" in verify_record(KeyRing(fleet_secret=secret), other, unsigned.ts, "selftest", unsigned.data)
