"""The knobs of deploy/README.md ("Knobs"), as an operator uses them: the tree is copied, the
README's own command makes the overlay ``deploy/k8s/overlays/mine``, each knob's block is appended to
it as written and the overlay is rendered by the real ``kubectl kustomize``. Every rendered object is
read into the ``kubernetes`` client's model of its kind and written back (a field the model does
not know fails), the policy keeps one writer, and each knob does what the README says it does.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from fleethealth.adapters.kubernetes import TAINT_KEY
from fleethealth.commands import build_parser
from fleethealth.probe.dcgm import BINDING_DIRS, find_bindings

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "deploy" / "README.md"
_CRD_GROUPS = ("monitoring.coreos.com/", "kafka.strimzi.io/")


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"### {title}\n")
    end = text.find("\n### ", start + 1)
    return text[start:end]


def _blocks(section: str, lang: str) -> list[str]:
    return [textwrap.dedent(b) for b in re.findall(rf"^ *```{lang}\n(.*?)^ *```", section, re.S | re.M)]


def _knobs() -> dict[str, str]:
    knobs = {}
    for block in _blocks(_section("Knobs"), "yaml"):
        first, _, _ = block.partition("\n")
        match = re.fullmatch(r"# knob: ([a-z0-9-]+)", first)
        assert match, f"a Knobs block without its '# knob: NAME' line: {first}"
        knobs[match.group(1)] = block
    return knobs


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """A copy of deploy/k8s with the overlay the README's install steps make (step 1, and step 3's
    topology file), by their own commands."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl not installed: cannot render the kustomizations (install kubectl >= 1.27)")
    root = tmp_path_factory.mktemp("operator")
    shutil.copytree(ROOT / "deploy" / "k8s", root / "deploy" / "k8s")
    steps = [b for b in _blocks(_section("Install"), "bash") if "overlays/mine/" in b]
    assert len(steps) == 2 and not any("kubectl" in b for b in steps)
    for step in steps:
        out = subprocess.run(["bash", "-euo", "pipefail", "-c", step], cwd=root, capture_output=True, text=True,
                             timeout=30)
        assert out.returncode == 0, out.stderr
    assert (root / "deploy" / "k8s" / "overlays" / "mine" / "kustomization.yaml").is_file()
    return root


def _render(tree: Path, name: str, knob: str = "") -> list[dict[str, Any]]:
    mine = tree / "deploy" / "k8s" / "overlays" / "mine"
    overlay = mine.parent / f"mine-{name}"  # the operator's overlay, files and all, once per knob
    shutil.copytree(mine, overlay, dirs_exist_ok=True)
    (overlay / "kustomization.yaml").write_text((mine / "kustomization.yaml").read_text() + knob)
    out = subprocess.run(["kubectl", "kustomize", str(overlay)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"knob {name}: {out.stderr}"
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    _valid(docs, name)
    return docs


def _without_nulls(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _without_nulls(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [_without_nulls(v) for v in obj]
    return obj


def _valid(docs: list[dict[str, Any]], name: str) -> None:
    """Every object valid for its model; exactly one policy writer, in one replica, Recreate."""
    kubernetes = pytest.importorskip("kubernetes")
    api = kubernetes.client.ApiClient()
    for doc in docs:
        if doc["apiVersion"].startswith(_CRD_GROUPS):
            continue
        version = doc["apiVersion"].split("/")[-1].capitalize()
        names = (version + doc["kind"], "Core" + version + doc["kind"])
        model = next(n for n in names if hasattr(kubernetes.client, n))
        back = api.sanitize_for_serialization(api.deserialize(json.dumps(doc), model, "application/json"))
        assert _without_nulls(back) == _without_nulls(doc), f"{name}: {doc['kind']}/{doc['metadata']['name']}"
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PriorityClass"}
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] not in cluster_scoped} == {"fleethealth"}, name
    parser = build_parser()
    writers = []
    for d in _kind(docs, "Deployment").values():
        args = parser.parse_args(d["spec"]["template"]["spec"]["containers"][0]["args"])
        if (args.command == "serve" and not args.no_detect) or getattr(args, "stage", None) == "policy":
            writers.append(d)
    assert len(writers) == 1, f"{name}: {[w['metadata']['name'] for w in writers]}"
    from fleethealth.commands._settings import schema

    for container in _containers(docs).values():  # a mistyped FLEETHEALTH_* variable stops the command
        schema().check_environ({e["name"]: "" for e in container.get("env", [])})
    assert writers[0]["spec"]["replicas"] == 1 and writers[0]["spec"]["strategy"]["type"] == "Recreate"


def _kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _pod(doc: dict[str, Any]) -> dict[str, Any]:
    template = doc["spec"]["jobTemplate"]["spec"]["template"] if doc["kind"] == "CronJob" else doc["spec"]["template"]
    return template["spec"]


def _containers(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: c for d in docs if d["kind"] in {"Deployment", "DaemonSet", "CronJob"}
            for c in _pod(d)["containers"]}


def _detectors(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {n: d for n, d in _kind(docs, "Deployment").items()
            if d["metadata"]["labels"]["app.kubernetes.io/component"] == "detect"}


# ---------------------------------------------------------------- what each knob does
def _images(docs, knob):
    new = {r["name"]: f"{r['newName']}:{r['newTag']}" for r in knob["images"]}
    target = {"fleethealth-probe": "ghcr.io/fleethealth/fleethealth-probe",
              "fleethealth-sweep": "ghcr.io/fleethealth/fleethealth-sweep"}
    for d in docs:
        if d["kind"] in {"Deployment", "DaemonSet", "CronJob"}:
            for c in [*_pod(d).get("initContainers", []), *_pod(d)["containers"]]:
                assert c["image"] == new[target.get(d["metadata"]["name"], "ghcr.io/fleethealth/fleethealth")]


def _endpoints(docs, knob):
    (kafka,) = knob["configMapGenerator"][0]["literals"]
    assert _kind(docs, "ConfigMap")["fleethealth-endpoints"]["data"] == dict([kafka.split("=", 1)])
    secrets = _kind(docs, "Secret")
    for gen in knob["secretGenerator"]:
        key, value = gen["literals"][0].split("=", 1)
        assert base64.b64decode(secrets[gen["name"]]["data"][key]).decode() == value


def _existing_secrets(docs, knob):
    assert not {"fleethealth-store", "fleethealth-store-api"} & set(_kind(docs, "Secret"))
    refs = {s["secretRef"]["name"] for c in _containers(docs).values()
            for s in c.get("envFrom", []) if "secretRef" in s}
    assert {"fleethealth-store", "fleethealth-store-api"} <= refs  # still mounted: made outside the tree


def _replicas(docs, knob):
    want = {r["name"]: r["count"] for r in knob["replicas"]}
    got = {n: d["spec"]["replicas"] for n, d in _detectors(docs).items()}
    assert got == {**want, "fleethealth-detect-policy": 1}


def _whole_tier(docs, knob):
    (detect,) = _detectors(docs).values()
    assert build_parser().parse_args(detect["spec"]["template"]["spec"]["containers"][0]["args"]).command == "serve"


def _racks(docs, knob, tmp_path: Path) -> None:
    """Each probe finds its own node's rack in the file the ConfigMap carries, where the env points."""
    from fleethealth.nodename import rack_from_topology

    spec = _pod(_kind(docs, "DaemonSet")["fleethealth-probe"])
    (probe,) = spec["containers"]
    path = {e["name"]: e.get("value") for e in probe["env"]}["FLEETHEALTH_NODE_TOPOLOGY"]
    mount = next(m for m in probe["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    data = _kind(docs, "ConfigMap")[volume["configMap"]["name"]]["data"]  # the generated name, hash and all
    local = tmp_path / path.lstrip("/")
    local.parent.mkdir(parents=True)
    local.write_text(data[Path(path).name])
    assert rack_from_topology(str(local), "gpu-a18") == "r07" and rack_from_topology(str(local), "gpu-b01") == "r08"


def _resources(docs, knob):
    (patch,) = yaml.safe_load(knob["patches"][0]["patch"])
    assert _containers(docs)["fleethealth-detect-job"]["resources"] == patch["value"]
    assert _containers(docs)["fleethealth-detect-node"]["resources"] != patch["value"]


def _node_selector(docs, knob):
    gpu = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert _pod(_kind(docs, "DaemonSet")["fleethealth-probe"])["nodeSelector"] == gpu
    assert _pod(_kind(docs, "CronJob")["fleethealth-sweep"])["nodeSelector"] == gpu
    detectors = _detectors(docs)
    assert len(detectors) == 3
    assert all(_pod(d)["nodeSelector"] == {"node-role.example.com/services": "true"} for d in detectors.values())


def _tolerations(docs, knob):
    (patch,) = yaml.safe_load(knob["patches"][0]["patch"])
    tolerations = _pod(_kind(docs, "DaemonSet")["fleethealth-probe"])["tolerations"]
    assert tolerations == patch["value"] and any(t["key"] == TAINT_KEY for t in tolerations)


def _monitor_labels(docs, knob):
    monitoring = [d for d in docs if d["apiVersion"].startswith("monitoring.coreos.com/")]
    assert monitoring and {d["metadata"]["labels"]["release"] for d in monitoring} == {"my-prometheus"}


def _dcgm(major: int):
    def check(docs, knob, tmp_path: Path) -> None:
        """The probe reads DCGM from the host engine by its qualified name, and the node's DCGM
        ``major`` install, laid out as its packages lay it out (the bindings in the directory the
        probe's own search list names for that major, ``libdcgm.so.<major>`` in the library
        directory), appears in the container where DCGM_BINDINGS and LD_LIBRARY_PATH point."""
        spec = _pod(_kind(docs, "DaemonSet")["fleethealth-probe"])
        (probe,) = spec["containers"]
        args = build_parser().parse_args([a.replace("$(NODE_NAME)", "gpu-a17") for a in probe["args"]])
        assert args.source == "dcgm" and args.dcgm_host.endswith(".svc.cluster.local:5555")
        layout = {4: "/usr/share/datacenter-gpu-manager-4/", 3: "/usr/local/dcgm/"}[major]  # DCGM's packages
        (bindings,) = [d for d in BINDING_DIRS if d.startswith(layout)]
        host, ctr = tmp_path / f"host{major}", tmp_path / f"ctr{major}"
        (host / bindings.lstrip("/")).mkdir(parents=True)
        (host / bindings.lstrip("/") / "pydcgm.py").write_text("")
        lib = host / "usr/lib/x86_64-linux-gnu" / f"libdcgm.so.{major}"
        lib.parent.mkdir(parents=True)
        lib.write_text("")
        volumes = {v["name"]: v for v in spec["volumes"]}
        for name in ("dcgm-bindings", "dcgm-lib"):  # the README names the paths the knob mounts
            assert f"`{volumes[name]['hostPath']['path']}`" in README.read_text(), name
        for mount in probe["volumeMounts"]:  # each hostPath mount, as a link from the container's path
            source = volumes[mount["name"]].get("hostPath", {}).get("path", "")
            if "dcgm" in mount["name"]:
                target = ctr / mount["mountPath"].lstrip("/")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.symlink_to(host / source.lstrip("/"))
        env = {e["name"]: e.get("value") for e in probe["env"]}
        assert find_bindings(str(ctr / env["DCGM_BINDINGS"].lstrip("/"))) == ctr / env["DCGM_BINDINGS"].lstrip("/")
        assert (ctr / env["LD_LIBRARY_PATH"].lstrip("/") / f"libdcgm.so.{major}").is_file()
        assert not [p for p in (ctr / env["LD_LIBRARY_PATH"].lstrip("/")).iterdir() if p.name != lib.name]
    return check


def _snapshot_key(docs, knob):
    for name, c in _containers(docs).items():
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        has = env.get("FLEETHEALTH_DETECT_SNAPSHOT_KEY_FILE") == "/etc/fleethealth/snapshot/key"
        assert has == (name in {"fleethealth-detect-node", "fleethealth-detect-job"}), name
        if has:
            mount = {"name": "snapshot-key", "mountPath": "/etc/fleethealth/snapshot", "readOnly": True}
            assert mount in c["volumeMounts"], name


def _signing(docs, knob):
    """Every detector Deployment and the API check signatures with the fleet secret; nothing else
    mounts it (a node, the actor or the sweep holding it could sign as any node)."""
    for name, d in _kind(docs, "Deployment").items():
        (container,) = _pod(d)["containers"]
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        holds = name in _detectors(docs) or name == "fleethealth-api"
        assert (env.get("FLEETHEALTH_SIGNING_MODE") == "require") == holds, name
        if holds:
            mount = next(m for m in container["volumeMounts"] if m["name"] == "fleet-secret")
            assert env["FLEETHEALTH_SIGNING_FLEET_SECRET_FILE"].startswith(mount["mountPath"] + "/")
            assert mount["readOnly"], name
    holders = {n for n, d in _kind(docs, "Deployment").items()
               if any(v.get("secret", {}).get("secretName") == "fleethealth-fleet-secret"
                      for v in _pod(d).get("volumes", []))}
    assert holders == {*_detectors(docs), "fleethealth-api"}
    for d in docs:
        if d["kind"] in {"DaemonSet", "CronJob"}:
            assert "fleethealth-fleet-secret" not in json.dumps(d), d["metadata"]["name"]


def _act_enforce(docs, knob):
    args = build_parser().parse_args(_containers(docs)["fleethealth-act"]["args"])
    assert args.command == "act" and not args.dry_run and args.max_actions == 5


CHECKS = {"images": _images, "endpoints": _endpoints, "existing-secrets": _existing_secrets, "replicas": _replicas,
          "whole-tier": _whole_tier, "resources": _resources, "node-selector": _node_selector,
          "tolerations": _tolerations, "monitor-labels": _monitor_labels, "dcgm-4": _dcgm(4), "dcgm-3": _dcgm(3),
          "snapshot-key": _snapshot_key, "act-enforce": _act_enforce, "racks": _racks, "signing": _signing}
_LAYS_OUT_FILES = {"dcgm-4", "dcgm-3", "racks"}
"""Checks that lay out files (a node's DCGM install, the probe's view of a ConfigMap) in tmp_path."""


def test_every_knob_in_the_readme_is_checked_here():
    assert set(_knobs()) == set(CHECKS)


def test_the_overlay_of_install_step_1_renders_as_is(tree):
    docs = _render(tree, "plain")
    assert set(_detectors(docs)) == {"fleethealth-detect-node", "fleethealth-detect-job", "fleethealth-detect-policy"}
    args = build_parser().parse_args(_containers(docs)["fleethealth-act"]["args"])
    assert args.dry_run  # until the act-enforce knob


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_each_knob_renders_valid_objects_and_does_what_it_says(tree, name, tmp_path):
    block = _knobs()[name]
    docs = _render(tree, name, block)
    check = CHECKS[name]
    if name in _LAYS_OUT_FILES:
        check(docs, yaml.safe_load(block), tmp_path)
    else:
        check(docs, yaml.safe_load(block))
    assert docs != _render(tree, "plain"), f"knob {name} changed nothing"


def test_the_knobs_combine_as_the_readme_says(tree):
    """All knobs in one overlay, each key's lists merged (the README's rule), but the alternatives:
    the whole tier (it removes the stages other knobs name), existing Secrets (the endpoints knob
    makes them) and DCGM 4 (DCGM 3 is the same component, patched)."""
    alternatives = {"whole-tier", "existing-secrets", "dcgm-4"}
    merged: dict[str, Any] = {}
    for name, block in _knobs().items():
        if name in alternatives:
            continue
        for key, value in yaml.safe_load(block).items():
            if isinstance(value, list):
                merged[key] = merged.get(key, []) + [v for v in value if v not in merged.get(key, [])]
            else:
                merged[key] = {**merged.get(key, {}), **value}
    docs = _render(tree, "all", yaml.safe_dump(merged, sort_keys=False))
    for name, block in _knobs().items():
        if name not in alternatives | _LAYS_OUT_FILES:
            CHECKS[name](docs, yaml.safe_load(block))
