"""Per-workload Kafka identities and topic ACLs: the production overlay renders, every object it
renders is valid for its Kubernetes model, each principal may do exactly what it needs, the
workloads authenticate as their own principal, and the plain ``kafka-acls.sh`` script grants the
same as the Strimzi KafkaUsers.

``kubectl kustomize`` renders the overlay; Kubernetes' own kinds are read into the ``kubernetes``
client's models and written back (a field the model does not know is dropped and fails the
comparison). KafkaUser is a CRD (kafka.strimzi.io/v1beta2) with no client model, so its structure
is checked here against the schema of Strimzi's AclRule.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from fleethealth.bus import parse_dsn
from fleethealth.commands import build_parser
from fleethealth.probe.rollback import GROUP_PREFIX
from fleethealth.schema import Topic

ROOT = Path(__file__).resolve().parents[2]
OVERLAY = ROOT / "deploy" / "k8s" / "overlays" / "production"
SCRIPT = ROOT / "deploy" / "kafka" / "acls.sh"

INPUTS = {Topic.TELEMETRY.value, Topic.STEPS.value, Topic.EVENTS.value}
OUTPUTS = {Topic.FINDINGS.value, Topic.RECOMMENDATIONS.value, Topic.DEADLETTER.value}
EXPECTED = {
    # principal: {(resource type, name): operations}
    # a node produces its inputs; its rollback relay reads recommendations in group fh-rollback-NODE
    # (a prefixed grant, written "fh-rollback-*" here)
    "fh-probe-gpu": {**{("topic", t): {"Write", "Describe"} for t in INPUTS},
                     ("topic", Topic.RECOMMENDATIONS.value): {"Read", "Describe"},
                     ("group", GROUP_PREFIX + "*"): {"Read", "Describe"}},
    "fh-detect": {**{("topic", t): {"Read", "Describe", "Create"} for t in INPUTS},
                  **{("topic", t): {"Write", "Describe", "Create"} for t in OUTPUTS},
                  # the stages: fh.nodestate between them, fh.findings read by the job and policy stages,
                  # the derived interruptions published on fh.events
                  ("topic", Topic.EVENTS.value): {"Read", "Write", "Describe", "Create"},
                  ("topic", Topic.FINDINGS.value): {"Read", "Write", "Describe", "Create"},
                  ("topic", Topic.NODESTATE.value): {"Read", "Write", "Describe", "Create"},
                  # detector snapshots (snapshot_to = "bus"): the detector replicas, and no one else
                  ("topic", Topic.SNAPSHOTS.value): {"Read", "Write", "Describe", "Create"},
                  **{("group", g): {"Read", "Describe"} for g in ("fh-detect", "fh-detect-node", "fh-detect-job",
                                                                   "fh-detect-policy")}},
    "fh-act": {("topic", Topic.RECOMMENDATIONS.value): {"Read", "Describe"},
               ("topic", Topic.EVENTS.value): {"Write", "Describe"},
               ("topic", Topic.DEADLETTER.value): {"Write", "Describe"},
               ("group", "fh-act-kubernetes"): {"Read", "Describe"},
               ("group", "fh-act-slurm"): {"Read", "Describe"}},
    "fh-sweep": {("topic", Topic.EVENTS.value): {"Write", "Describe"}},
}
_OPERATIONS = {"Read", "Write", "Create", "Delete", "Alter", "Describe", "ClusterAction", "AlterConfigs",
               "DescribeConfigs", "IdempotentWrite", "All"}
WORKLOADS = {"probe": "fh-probe-gpu", "detect": "fh-detect", "act": "fh-act", "sweep": "fh-sweep"}
"""Each workload's principal, by its app.kubernetes.io/component label (every detector stage is fh-detect)."""
WHOLE_TIER = ("apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: [{standalone}]\n"
              "components: [{whole_tier}, {kafka_auth}]\n")
"""An operator's small install with identities: the whole tier listed before kafka-auth (deploy/README.md)."""


def _render(tree: Path) -> list[dict[str, Any]]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl not installed: cannot render the kustomization (install kubectl >= 1.27)")
    out = subprocess.run(["kubectl", "kustomize", str(tree)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {tree} failed: {out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module", params=["production", "whole-tier"])
def docs(request, tmp_path_factory) -> list[dict[str, Any]]:
    import os

    if request.param == "production":
        return _render(OVERLAY)
    mine = tmp_path_factory.mktemp("whole-tier")
    k8s = ROOT / "deploy" / "k8s"
    (mine / "kustomization.yaml").write_text(WHOLE_TIER.format(
        standalone=os.path.relpath(k8s / "overlays" / "standalone", mine),
        whole_tier=os.path.relpath(k8s / "components" / "whole-tier", mine),
        kafka_auth=os.path.relpath(k8s / "components" / "kafka-auth", mine)))
    return _render(mine)


def _users(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "KafkaUser"}


def _grants(user: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    grants: dict[tuple[str, str], set[str]] = {}
    for rule in user["spec"]["authorization"]["acls"]:
        res = rule["resource"]
        name = res["name"] + ("*" if res["patternType"] == "prefix" else "")
        grants.setdefault((res["type"], name), set()).update(rule["operations"])
    return grants


def _without_nulls(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _without_nulls(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [_without_nulls(v) for v in obj]
    return obj


def test_kubernetes_objects_are_valid_for_their_models(docs):
    kubernetes = pytest.importorskip("kubernetes")
    api = kubernetes.client.ApiClient()
    checked = set()
    for doc in docs:
        if doc["apiVersion"].startswith("kafka.strimzi.io/"):
            continue
        version = doc["apiVersion"].split("/")[-1].capitalize()
        name = next(n for n in (version + doc["kind"], "Core" + version + doc["kind"]) if hasattr(kubernetes.client, n))
        model = api.deserialize(json.dumps(doc), name, "application/json")
        assert _without_nulls(api.sanitize_for_serialization(model)) == _without_nulls(doc), \
            f"{doc['kind']}/{doc['metadata']['name']}: fields the {name} model does not know"
        checked.add(doc["kind"])
    assert {"DaemonSet", "Deployment", "CronJob"} <= checked


def test_kafka_users_have_strimzis_structure(docs):
    users = _users(docs)
    assert set(users) == set(EXPECTED)
    for name, user in users.items():
        assert user["apiVersion"] == "kafka.strimzi.io/v1beta2"
        assert user["metadata"]["namespace"] == "fleethealth"
        assert user["metadata"]["labels"]["strimzi.io/cluster"]
        assert set(user["spec"]) == {"authentication", "authorization"}
        assert user["spec"]["authentication"] == {"type": "scram-sha-512"}
        assert user["spec"]["authorization"]["type"] == "simple"
        for rule in user["spec"]["authorization"]["acls"]:
            assert set(rule) == {"resource", "operations"}, f"{name}: {rule}"
            assert set(rule["resource"]) == {"type", "name", "patternType"}
            assert rule["resource"]["type"] in {"topic", "group"}
            # topics by exact name only; a group by prefix only where a principal serves many nodes
            assert rule["resource"]["patternType"] == "literal" or (
                rule["resource"]["type"] == "group" and rule["resource"]["patternType"] == "prefix"), f"{name}: {rule}"
            assert set(rule["operations"]) <= _OPERATIONS and len(rule["operations"]) == len(set(rule["operations"]))


def test_each_principal_may_do_exactly_what_it_needs(docs):
    users = _users(docs)
    for name, want in EXPECTED.items():
        assert _grants(users[name]) == want, name
    probe = _grants(users["fh-probe-gpu"])
    assert {key for key, ops in probe.items() if "Read" in ops and key[0] == "topic"} == \
        {("topic", Topic.RECOMMENDATIONS.value)}, "a node reads recommendations (its relay), no other topic"
    assert {key for key in probe if key[0] == "group"} == {("group", GROUP_PREFIX + "*")}, \
        "a node may join only the rollback relay's groups"
    assert not any("Write" in probe.get(("topic", t), ()) for t in OUTPUTS), \
        "a node may not write findings or recommendations"
    assert not any("Write" in ops for key, ops in _grants(users["fh-act"]).items()
                   if key == ("topic", Topic.RECOMMENDATIONS.value)), "the adapter may not write recommendations"
    every_topic = {t.value for t in Topic}
    for name, user in users.items():
        assert {n for (kind, n) in _grants(user) if kind == "topic"} <= every_topic, name


def _containers(docs: list[dict[str, Any]]) -> dict[str, tuple[dict[str, Any], dict[str, Any], str]]:
    """name -> (pod spec, first container, component label) of every workload."""
    out = {}
    for d in docs:
        spec = (d["spec"]["jobTemplate"]["spec"]["template"]["spec"] if d["kind"] == "CronJob"
                else d["spec"]["template"]["spec"] if d["kind"] in {"Deployment", "DaemonSet"} else None)
        if spec is not None:
            component = d["metadata"]["labels"]["app.kubernetes.io/component"]
            out[d["metadata"]["name"]] = (spec, spec["containers"][0], component)
    return out


def test_each_workload_authenticates_as_its_own_principal(docs):
    from urllib.parse import parse_qs

    parser = build_parser()
    workloads = _containers(docs)
    assert {c for _, _, c in workloads.values()} >= set(WORKLOADS)
    for workload, (spec, container, component) in workloads.items():
        env = {e["name"]: e for e in container.get("env", [])}
        if component not in WORKLOADS:
            assert "KAFKA_DSN" not in env, f"{workload} has Kafka credentials it does not use"
            continue
        var = "FLEETHEALTH_KAFKA" if component == "sweep" else "KAFKA_DSN"
        assert set(env[var]) == {"name", "value"}, f"{workload}: {env[var]}"
        dsn = env[var]["value"]
        scheme, hosts = parse_dsn(dsn)
        assert scheme == "kafka" and hosts and all(h.endswith(":9093") for h in hosts)
        options = {k: v[0] for k, v in parse_qs(dsn.split("?", 1)[1]).items()}
        assert options["username"] == WORKLOADS[component], workload
        assert options["security_protocol"] == "SASL_SSL" and options["sasl_mechanism"] == "SCRAM-SHA-512"
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        password = volumes[mounts[str(Path(options["password_file"]).parent)]]["secret"]
        assert password["secretName"] == WORKLOADS[component], f"{workload} mounts another principal's password"
        assert password["items"] == [{"key": "password", "path": Path(options["password_file"]).name}]
        ca = volumes[mounts[str(Path(options["ssl_cafile"]).parent)]]["secret"]
        assert ca["secretName"] == "fleethealth-kafka-ca"
        if var == "KAFKA_DSN":  # the arguments still take the DSN from the variable, and parse
            argv = container.get("args") or container["command"][1:]
            assert "$(KAFKA_DSN)" in argv
            assert parser.parse_args([a.replace("$(NODE_NAME)", "n0001") for a in argv]).run is not None


def _script_grants(env: dict[str, str] | None = None) -> dict[str, dict[tuple[str, str], set[str]]]:
    out = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=30,
                         env={"PATH": "/usr/bin:/bin", **(env or {})})
    assert out.returncode == 0, out.stderr
    grants: dict[str, dict[tuple[str, str], set[str]]] = {}
    for line in out.stdout.splitlines():
        words = line.split()
        assert words[0] == "kafka-acls.sh" and "--add" in words
        principal = words[words.index("--allow-principal") + 1].removeprefix("User:")
        pattern = words[words.index("--resource-pattern-type") + 1]
        assert pattern in {"literal", "prefixed"}, line
        kind = next(k for k in ("topic", "group") if f"--{k}" in words)
        name = words[words.index(f"--{kind}") + 1] + ("*" if pattern == "prefixed" else "")
        ops = {words[i + 1] for i, w in enumerate(words) if w == "--operation"}
        grants.setdefault(principal, {}).setdefault((kind, name), set()).update(ops)
    return grants


def test_the_plain_kafka_script_grants_what_the_kafka_users_grant(docs):
    users = _users(docs)
    assert _script_grants() == {name: _grants(user) for name, user in users.items()}
    per_node = _script_grants({"PROBE_USERS": "node-n0001 node-n0002"})
    assert per_node["node-n0001"] == per_node["node-n0002"] == EXPECTED["fh-probe-gpu"]
    assert "fh-probe-gpu" not in per_node


def test_the_script_help_runs_nothing():
    """``acls.sh --help`` prints its usage and runs no kafka-acls.sh (a stand-in that records any call
    is first on PATH); an unknown argument is refused."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        called = Path(tmp) / "called"
        stub = Path(tmp) / "kafka-acls.sh"
        stub.write_text(f"#!/bin/sh\necho called >> {called}\n")
        stub.chmod(0o755)
        env = {"PATH": f"{tmp}:/usr/bin:/bin"}
        out = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=30, env=env)
        assert out.returncode == 0 and "--dry-run" in out.stdout and not called.exists(), out
        bad = subprocess.run(["bash", str(SCRIPT), "--bogus"], capture_output=True, text=True, timeout=30, env=env)
        assert bad.returncode == 2 and "unknown argument" in bad.stderr and not called.exists()


def _stage_groups(docs: list[dict[str, Any]]) -> set[str]:
    """The consumer group each detector Deployment joins, as ``fleethealth detect`` names it
    (``--group``, with the stage appended for node, job and policy; the whole tier's ``serve`` uses
    the default group at stage all)."""
    from fleethealth.commands.detect import stage_group
    from fleethealth.config import COMMAND_KEYS

    parser = build_parser()
    default = next(k.default for k in COMMAND_KEYS if k.name == "detect.group")
    groups = set()
    for d in docs:
        if d["kind"] != "Deployment" or d["metadata"]["labels"].get("app.kubernetes.io/component") != "detect":
            continue
        args = parser.parse_args(d["spec"]["template"]["spec"]["containers"][0]["args"])
        groups.add(stage_group(getattr(args, "group", default), getattr(args, "stage", "all")))
    return groups


def test_every_detector_deployments_group_is_granted(docs):
    """Each stage joins a consumer group of its own (fh-detect-node, -job, -policy; fh-detect for the
    whole tier): the detectors' principal may read in every group a rendered Deployment joins, in
    the KafkaUser and in acls.sh alike, or the stage is refused at its first JoinGroup."""
    groups = _stage_groups(docs)
    assert groups, "no detector Deployment rendered"
    granted = {name for (kind, name), ops in _grants(_users(docs)["fh-detect"]).items()
               if kind == "group" and {"Read", "Describe"} <= ops}
    assert groups <= granted, f"groups not granted to fh-detect: {sorted(groups - granted)}"
    script = {name for (kind, name), ops in _script_grants()["fh-detect"].items() if kind == "group" and "Read" in ops}
    assert groups <= script, f"acls.sh does not grant {sorted(groups - script)}"
