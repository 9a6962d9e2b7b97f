"""Sweep order (riskiest first) and node-name validation."""

from __future__ import annotations

import pytest

from fleethealth.errors import ConfigError
from fleethealth.policy import quarantine
from fleethealth.schema import Finding, FindingKind
from fleethealth.sweeps.plan import rank_nodes, read_node_list, risk_from_store, validate_node


@pytest.mark.parametrize("name", ["n0001", "gpu-a17.cluster_x", "A"])
def test_plain_host_names_are_accepted(name: str) -> None:
    assert validate_node(name) == name


@pytest.mark.parametrize("name", ["", "-w", "--exclusive", "n1;reboot", "n1 n2", "$(id)", "n1\n", "a" * 65, "n/1"])
def test_names_that_could_be_options_or_shell_words_are_rejected(name: str) -> None:
    with pytest.raises(ConfigError, match="invalid node name"):
        validate_node(name)


@pytest.mark.parametrize("name", ["n1-", "n1.", "a" * 64, "_n1", "x-"])
def test_names_the_schedulers_refuse_are_refused_here_too(name: str) -> None:
    """A sweep used to accept 64 characters and a trailing '-' or '.', which the adapters refuse."""
    with pytest.raises(ConfigError, match="invalid node name"):
        validate_node(name)


@pytest.mark.parametrize("name", ["n0001", "gpu-a17.cluster_x", "A", "a" * 63, "a" * 64, "n1-", "n1.",
                                  "-w", "n[0-3]", "n1,n2", "n1 ", "é1", "n1\n"])
def test_sweeps_adapters_and_api_agree_on_node_names(name: str) -> None:
    import re

    from fleethealth.adapters.base import SchedulerError, check_node_name
    from fleethealth.api.models import NODE_PATTERN

    def accepted(check) -> bool:
        try:
            check(name)
        except (ConfigError, SchedulerError):
            return False
        return True

    api = re.fullmatch(NODE_PATTERN, name) is not None
    assert accepted(validate_node) == accepted(check_node_name) == api


def test_node_lists_accept_commas_spaces_comments_and_drop_repeats() -> None:
    assert read_node_list("n1,n2 n3\n# spare\nn2\nn4  # hot\n") == ["n1", "n2", "n3", "n4"]
    with pytest.raises(ConfigError):
        read_node_list("n1,rm -rf")  # '-rf' is not a host name


def _finding(kind: FindingKind, node: str, probability: float | None = None) -> Finding:
    return Finding(kind=kind, node=node, ts=10.0, probability=probability, detector="test")


def test_quarantined_first_then_failure_risk_then_finding_count_then_name() -> None:
    findings = [
        _finding(FindingKind.FAILURE_RISK, "n3", 0.4), _finding(FindingKind.FAILURE_RISK, "n3", 0.9),
        _finding(FindingKind.FAILURE_RISK, "n4", 0.6),
        _finding(FindingKind.SDC, "n5"), _finding(FindingKind.XID, "n5"), _finding(FindingKind.ECC, "n6"),
    ]
    order = rank_nodes(["n1", "n6", "n5", "n4", "n3", "n2", "n9"], findings, quarantined=["n2", "n9"])
    assert [r.node for r in order] == ["n2", "n9", "n3", "n4", "n5", "n6", "n1"]
    n3 = order[2]
    assert n3.probability == 0.9 and n3.reasons == ("failure risk 0.90",)
    assert order[4].reasons == ("2 findings (sdc, xid)",)


def test_risk_from_the_store_reads_findings_and_the_quarantine_book(store) -> None:
    store.insert_findings([_finding(FindingKind.FAILURE_RISK, "n0002", 0.7), _finding(FindingKind.SDC, "n0003")])
    quarantine.quarantine(store, "n0004", "sdc from cross-rank replay", 50.0)
    risks = risk_from_store(store, ["n0001", "n0002", "n0003", "n0004"])
    assert [r.node for r in risks] == ["n0004", "n0002", "n0003", "n0001"]
    assert risks[0].quarantined
    assert [r.node for r in risk_from_store(store)] == ["n0004", "n0002", "n0003"]
