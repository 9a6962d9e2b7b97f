"""The Kubernetes manifests agree with the code: their arguments parse with the real CLI, and the
adapter's ClusterRole grants exactly the verbs the Kubernetes adapter uses (read a node, patch it,
patch its status)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fleethealth.commands import build_parser

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


@pytest.mark.parametrize("name", ["api-deployment.yaml", "detector-deployment.yaml", "act-deployment.yaml"])
def test_container_arguments_parse_with_the_cli(name):
    (deployment,) = [d for d in _docs(name) if d["kind"] == "Deployment"]
    for container in deployment["spec"]["template"]["spec"]["containers"]:
        args = build_parser().parse_args(container["args"])
        assert args.run is not None and args.command in {"serve", "act"}


def test_act_role_grants_the_adapters_verbs_and_no_more():
    docs = {d["kind"]: d for d in _docs("act-deployment.yaml")}
    rules = {(rule["resources"][0], verb) for rule in docs["ClusterRole"]["rules"] for verb in rule["verbs"]}
    assert {("nodes", "get"), ("nodes", "patch"), ("nodes/status", "patch")} <= rules
    assert {resource for resource, _ in rules} == {"nodes", "nodes/status"}
    assert not any(verb in {"delete", "create", "update", "*"} for _, verb in rules)
    binding = docs["ClusterRoleBinding"]
    assert binding["subjects"][0]["name"] == docs["ServiceAccount"]["metadata"]["name"]
    spec = docs["Deployment"]["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == docs["ServiceAccount"]["metadata"]["name"]
    args = build_parser().parse_args(spec["containers"][0]["args"])
    assert args.scheduler == "kubernetes" and args.in_cluster


def test_api_service_selects_the_api_pods():
    docs = {d["kind"]: d for d in _docs("api-deployment.yaml")}
    labels = docs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert docs["Service"]["spec"]["selector"].items() <= labels.items()
