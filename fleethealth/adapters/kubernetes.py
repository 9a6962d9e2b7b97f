"""Kubernetes adapter: cordon or drain a node through the official ``kubernetes`` client, the way
``kubectl`` does it, and mark what fleethealth did so it only ever undoes its own work.

Two operations, named by what they do:

``cordon``
    ``spec.unschedulable: true`` and the taint ``fleethealth.io/unhealthy=cordon:NoSchedule`` in one
    strategic-merge patch that carries the node's ``resourceVersion`` (a concurrent writer makes it
    fail with 409; it is retried on a fresh read), then the node condition
    ``FleetHealthUnhealthy=True`` (``PATCH /api/v1/nodes/{name}/status``; conditions merge by type).
    Running pods stay.
``drain``
    ``cordon`` (taint value ``drain``), then an Eviction (``POST .../pods/{pod}/eviction``, policy/v1)
    for every pod on the node except DaemonSet pods (their controller would put them straight back),
    mirror (static) pods, pods already finished or terminating and pods in ``skip_namespaces``
    (default ``kube-system``), with ``grace_period_s`` (default: each pod's own
    ``terminationGracePeriodSeconds``, as ``kubectl drain`` does). As ``kubectl drain`` does, a pod no
    controller manages (it would be gone for good) and a pod with ``emptyDir`` data (lost with it)
    make the whole drain refuse, evicting nothing, unless ``force`` / ``delete_emptydir_data`` allow
    them (``kubectl drain --force`` / ``--delete-emptydir-data``; config keys ``act.drain_force``,
    ``act.drain_delete_emptydir_data``): the node stays cordoned and :class:`DrainRefused` names the
    pods and the option. The Eviction API
    honours PodDisruptionBudgets: a 429 means "not now", and the pod is tried again every
    ``pdb_retry_s`` until ``drain_timeout_s``; a pod still protected then is reported and the drain
    raises :class:`DrainIncomplete` (the node stays cordoned; the recommendation is tried again later).
    A budget is never overridden and no pod is deleted directly.

Recommendations map to these (:data:`DEFAULT_OPERATIONS`): ``evict`` (the job restarts without the
node), ``drain`` (hang, failure risk, fatal Xid) and ``quarantine`` (silent data corruption) all
``drain``: in Kubernetes only an eviction moves a pod. ``operations=`` maps any of them to
``cordon`` instead, to let running pods finish.

Ownership, as NVIDIA's NVSentinel and Slurm's NHC keep it:

- the label ``fleethealth.io/cordoned-by=fleethealth`` is set only when fleethealth made the node
  unschedulable (a node a person cordoned first is never claimed), with the annotations
  ``fleethealth.io/reason`` (why) and ``fleethealth.io/at`` (when, RFC 3339);
- a node labelled ``fleethealth.io/opt-out=true`` is left alone: no cordon, no drain, no release
  (:class:`~fleethealth.adapters.base.LeftAlone`);
- :meth:`KubernetesAdapter.release` removes the fleethealth taint, annotations and condition, and
  uncordons the node only when the label says fleethealth cordoned it.

Each action leaves a Kubernetes Event on the node (``kubectl describe node`` shows it; in namespace
``default``, where node events live); an Event that cannot be written is logged, not fatal. Every
call is retried at most ``retries`` times with exponential backoff and full jitter on 409 (patches,
after a fresh read), 429 and 5xx; other refusals raise :class:`SchedulerError` at once. A step whose
result is already in place is not sent again, so replaying a recommendation makes no write.

The client is imported only when an adapter is built without an ``api`` object.
"""

from __future__ import annotations

import hashlib
import logging
import random
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from fleethealth.adapters.base import LeftAlone, SchedulerError, UnknownNode, check_node_name, clean_reason
from fleethealth.schema import Action, Recommendation

__all__ = ["KubernetesAdapter", "Operation", "DrainIncomplete", "DrainRefused", "drain_filter",
           "DEFAULT_SKIP_NAMESPACES", "DEFAULT_OPERATIONS", "TAINT_KEY",
           "CONDITION_TYPE", "OWNER_LABEL", "OWNER", "REASON_ANNOTATION", "AT_ANNOTATION", "OPT_OUT_LABEL"]

log = logging.getLogger("fleethealth.adapters.kubernetes")

TAINT_KEY = "fleethealth.io/unhealthy"
"""The one taint fleethealth sets (value: the operation, effect ``NoSchedule``); the probe DaemonSet
and the sweep CronJob tolerate it."""
OWNER_LABEL = "fleethealth.io/cordoned-by"
OWNER = "fleethealth"
"""``fleethealth.io/cordoned-by=fleethealth``: fleethealth made this node unschedulable, so a release
may uncordon it (``kubectl get nodes -l fleethealth.io/cordoned-by`` lists them)."""
REASON_ANNOTATION = "fleethealth.io/reason"
AT_ANNOTATION = "fleethealth.io/at"
OPT_OUT_LABEL = "fleethealth.io/opt-out"
"""``kubectl label node NODE fleethealth.io/opt-out=true``: fleethealth leaves the node alone."""
CONDITION_TYPE = "FleetHealthUnhealthy"
_LEGACY_CORDON_ANNOTATION = "fleethealth.io/cordoned"  # earlier releases' mark of their own cordon
_SMP = "application/strategic-merge-patch+json"
_JSON_HEADERS = {"Content-Type": "application/json"}  # the generated client sets none for POST
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_RETRIED = frozenset({409, 429, 500, 502, 503, 504})
_MIRROR_ANNOTATION = "kubernetes.io/config.mirror"
DEFAULT_SKIP_NAMESPACES = ("kube-system",)
"""Namespaces whose pods a drain leaves running (the cluster's own DNS, network and storage pods)."""


class Operation(StrEnum):
    """What the adapter does to a node: ``cordon`` (no new pods) or ``drain`` (cordon + evict pods)."""

    CORDON = "cordon"
    DRAIN = "drain"


DEFAULT_OPERATIONS: Mapping[Action, Operation] = {
    Action.EVICT: Operation.DRAIN, Action.DRAIN: Operation.DRAIN, Action.QUARANTINE: Operation.DRAIN}


class DrainIncomplete(SchedulerError):
    """The node is cordoned, but some pods could not be evicted before the drain timed out (a
    PodDisruptionBudget kept refusing, or the API kept failing); ``blocked`` names them ``ns/pod``."""

    def __init__(self, message: str, blocked: tuple[str, ...]) -> None:
        super().__init__(message)
        self.blocked = blocked


class DrainRefused(DrainIncomplete):
    """The node is cordoned, but a pod on it may not be evicted without an explicit option (as
    ``kubectl drain`` refuses without ``--force`` or ``--delete-emptydir-data``), so none was;
    ``blocked`` names those pods ``ns/pod``."""


@dataclass(frozen=True)
class _Pod:
    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


def _rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _k8s_node(node: str) -> str:
    check_node_name(node)
    if len(node) > 253 or not _DNS_SUBDOMAIN.fullmatch(node):
        raise SchedulerError(f"refusing node name {node!r}: not a Kubernetes node name (RFC 1123 subdomain)")
    return node


class KubernetesAdapter:
    """Cordon, drain, mark and release Kubernetes nodes (see the module docstring).

    Parameters
    ----------
    api:
        A ``kubernetes.client.CoreV1Api``; default: one built from ``kubeconfig`` (or the
        in-cluster service account when ``in_cluster``).
    field_manager:
        The field manager the API server records for these writes.
    operations:
        Which :class:`Operation` each action gets; default :data:`DEFAULT_OPERATIONS`.
    grace_period_s:
        Seconds each evicted pod gets to stop; ``None``: the pod's own termination grace period.
    drain_timeout_s, pdb_retry_s:
        How long a drain keeps retrying evictions a PodDisruptionBudget refuses, and how often.
    retries, backoff_s:
        Attempts per API call on 409/429/5xx, and the first backoff (doubled each time, full jitter).
    event_namespace:
        Where node Events are written (``default``, as the kubelet and ``kubectl drain`` do).
    force, delete_emptydir_data:
        Evict pods no controller manages, and pods with ``emptyDir`` volumes (kubectl's ``--force``
        and ``--delete-emptydir-data``); without them such a pod makes the drain refuse.
    skip_namespaces:
        Namespaces whose pods a drain leaves running (default ``kube-system``: the cluster's own
        DNS and network pods stay on a cordoned node).
    sleep, clock, rng:
        Replaceable in tests (no test sleeps).
    """

    name = "kubernetes"

    def __init__(self, api: Any = None, *, kubeconfig: str | None = None, in_cluster: bool = False,
                 field_manager: str = "fleethealth", operations: Mapping[Action, Operation] | None = None,
                 grace_period_s: int | None = None, drain_timeout_s: float = 300.0, pdb_retry_s: float = 5.0,
                 retries: int = 4, backoff_s: float = 0.5, event_namespace: str = "default",
                 force: bool = False, delete_emptydir_data: bool = False,
                 skip_namespaces: tuple[str, ...] = DEFAULT_SKIP_NAMESPACES,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic,
                 rng: Callable[[], float] = random.random, wall_clock: Callable[[], float] = time.time) -> None:
        if retries < 1:
            raise SchedulerError(f"retries must be >= 1, got {retries}")
        if grace_period_s is not None and grace_period_s < 0:
            raise SchedulerError(f"grace_period_s must be >= 0, got {grace_period_s}")
        self.field_manager = field_manager
        self.operations = dict(DEFAULT_OPERATIONS if operations is None else operations)
        self.grace_period_s = grace_period_s
        self.drain_timeout_s = drain_timeout_s
        self.pdb_retry_s = pdb_retry_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.event_namespace = event_namespace
        self.force = force
        self.delete_emptydir_data = delete_emptydir_data
        self.skip_namespaces = tuple(skip_namespaces)
        self._sleep = sleep
        self._clock = clock
        self._rng = rng
        self._wall_clock = wall_clock
        self._api = api if api is not None else self._build_api(kubeconfig, in_cluster)

    @staticmethod
    def _build_api(kubeconfig: str | None, in_cluster: bool) -> Any:
        from kubernetes import client, config

        try:
            if in_cluster:
                config.load_incluster_config()
            else:
                config.load_kube_config(config_file=kubeconfig)
        except (config.ConfigException, OSError) as exc:
            raise SchedulerError(f"no Kubernetes configuration: {exc}") from exc
        return client.CoreV1Api()

    # ------------------------------------------------------------ contract
    def supports(self, action: Action) -> bool:
        return action in self.operations

    def plan(self, rec: Recommendation) -> tuple[str, ...]:
        node = _k8s_node(rec.node)
        op = self._operation(rec)
        ops = [f"PATCH /api/v1/nodes/{node} unschedulable=true taint {TAINT_KEY}={op.value}:NoSchedule "
               f"label {OWNER_LABEL}={OWNER}",
               f"PATCH /api/v1/nodes/{node}/status condition {CONDITION_TYPE}=True"]
        if op is Operation.DRAIN:
            ops.append(f"POST eviction for each pod on {node} (not DaemonSet or mirror pods), grace "
                       f"{'pod default' if self.grace_period_s is None else f'{self.grace_period_s} s'}")
        return (*ops, f"POST event on node {node}")

    def apply(self, rec: Recommendation) -> tuple[str, ...]:
        op = self._operation(rec)
        message = clean_reason(f"{rec.action.value} ({rec.id}): {rec.reason}", limit=1000)
        if op is Operation.DRAIN:
            return self.drain(rec.node, reason=_condition_reason(rec), message=message, ts=rec.ts)
        return self.cordon(rec.node, reason=_condition_reason(rec), message=message, ts=rec.ts)

    # ------------------------------------------------------------ operations
    def cordon(self, node: str, *, reason: str, message: str, ts: float,
               operation: Operation = Operation.CORDON) -> tuple[str, ...]:
        """Cordon and taint ``node``, mark it and set the condition; return the writes made."""
        node = _k8s_node(node)
        done, current = self._cordon(node, operation, reason, message, ts)
        if done:
            self._event(node, current, f"FleetHealth{operation.value.capitalize()}", message, ts)
        return tuple(done)

    def drain(self, node: str, *, reason: str, message: str, ts: float) -> tuple[str, ...]:
        """Cordon ``node`` (taint value ``drain``), then evict its pods; see the module docstring."""
        node = _k8s_node(node)
        done, current = self._cordon(node, Operation.DRAIN, reason, message, ts)
        listed = self._call(node, "list pods", lambda: self._api.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={node}"))
        pods, refused = drain_filter(listed.items or [], force=self.force,
                                     delete_emptydir_data=self.delete_emptydir_data,
                                     skip_namespaces=self.skip_namespaces)
        if refused:
            why = "; ".join(f"{pod} ({what})" for pod, what in refused[:5]) + (" ..." if len(refused) > 5 else "")
            self._event(node, current, "FleetHealthDrainRefused", message + f"; drain refused, no pod evicted: {why}",
                        ts)
            raise DrainRefused(f"kubernetes drain of node {node!r} refused, as kubectl drain refuses: {why}; the "
                               "node stays cordoned, no pod was evicted", tuple(str(pod) for pod, _ in refused))
        evicted, blocked = self._evict_all(node, pods)
        done += [f"POST /api/v1/namespaces/{pod.namespace}/pods/{pod.name}/eviction" for pod in evicted]
        if done:
            note = f"; evicted {len(evicted)} pods" if evicted else ""
            if blocked:
                note += f"; {len(blocked)} pods still protected by a PodDisruptionBudget"
            self._event(node, current, "FleetHealthDrain", message + note, ts)
        if blocked:
            names = ", ".join(map(str, blocked[:5])) + (" ..." if len(blocked) > 5 else "")
            raise DrainIncomplete(f"kubernetes drain of node {node!r} incomplete after {self.drain_timeout_s:g} s: "
                                  f"{len(blocked)} pods not evicted ({names}); the node stays cordoned and the "
                                  "drain is tried again later", tuple(map(str, blocked)))
        return tuple(done)

    def release(self, node: str, *, ts: float, message: str = "released") -> tuple[str, ...]:
        """Undo fleethealth's marks on ``node``: remove its taint and annotations, set the condition to
        False, and uncordon the node only when fleethealth cordoned it (:data:`OWNER_LABEL`); a
        person's cordon stays. A node that opted out is left alone (:class:`LeftAlone`)."""
        node = _k8s_node(node)
        for attempt in range(1, self.retries + 1):
            current = self._read(node)
            self._check_opt_in(node, current)
            labels, annotations = _labels(current), _annotations(current)
            ours = labels.get(OWNER_LABEL) == OWNER or annotations.get(_LEGACY_CORDON_ANNOTATION) == "true"
            taints = _taints(current)
            kept = [t for t in taints if t["key"] != TAINT_KEY]
            marks = {k: None for k in (REASON_ANNOTATION, AT_ANNOTATION, _LEGACY_CORDON_ANNOTATION) if k in annotations}
            meta: dict[str, Any] = {"resourceVersion": current.metadata.resource_version}
            if marks:
                meta["annotations"] = marks
            if ours:
                meta["labels"] = {OWNER_LABEL: None}
            spec: dict[str, Any] = {"taints": kept}
            if ours and _unschedulable(current):
                spec = {"unschedulable": False, **spec}
            if len(kept) == len(taints) and not marks and not ours:
                done = []
                break
            try:
                self._api.patch_node(node, {"metadata": meta, "spec": spec}, field_manager=self.field_manager,
                                     _content_type=_SMP)
            except Exception as exc:  # the client's ApiException, translated below
                if self._again(exc, attempt):
                    continue
                raise self._translate(exc, node, "release") from exc
            spec_op = "unschedulable=false " if ours else "(cordon not ours, kept) "
            done = [f"PATCH /api/v1/nodes/{node} {spec_op}remove taint {TAINT_KEY} and fleethealth marks"]
            break
        if _condition(current) is not None and _condition(current).status != "False":
            body = {"status": {"conditions": [{
                "type": CONDITION_TYPE, "status": "False", "reason": "Released", "message": clean_reason(message),
                "lastHeartbeatTime": _rfc3339(ts), "lastTransitionTime": _rfc3339(ts)}]}}
            self._call(node, "set condition", lambda: self._api.patch_node_status(
                node, body, field_manager=self.field_manager, _content_type=_SMP))
            done.append(f"PATCH /api/v1/nodes/{node}/status condition {CONDITION_TYPE}=False")
        if done:
            self._event(node, current, "FleetHealthRelease", clean_reason(message), ts, kind="Normal")
        return tuple(done)

    def resume(self, node: str, *, message: str = "passed the complete full self-test") -> str | None:
        """:meth:`release` at the wall clock's time, for the sweep's return to pool; the writes made
        as one line, ``None`` when fleethealth had nothing on the node."""
        done = self.release(node, ts=self._wall_clock(), message=message)
        return "; ".join(done) or None

    # ------------------------------------------------------------ steps
    def _operation(self, rec: Recommendation) -> Operation:
        try:
            return Operation(self.operations[rec.action])
        except KeyError:
            raise SchedulerError(f"kubernetes has no operation for action {rec.action.value!r}") from None

    def _cordon(self, node: str, op: Operation, reason: str, message: str, ts: float) -> tuple[list[str], Any]:
        done: list[str] = []
        for attempt in range(1, self.retries + 1):
            current = self._read(node)
            self._check_opt_in(node, current)
            taints = _taints(current)
            mine = [t for t in taints if t["key"] == TAINT_KEY and t["effect"] == "NoSchedule"]
            cordoned = _unschedulable(current)
            ours = _labels(current).get(OWNER_LABEL) == OWNER
            annotations = _annotations(current)
            in_place = (cordoned and mine and mine[0].get("value") == op.value
                        and annotations.get(REASON_ANNOTATION) == message)
            if in_place:
                break
            others = [t for t in taints if not (t["key"] == TAINT_KEY and t["effect"] == "NoSchedule")]
            meta: dict[str, Any] = {"resourceVersion": current.metadata.resource_version,
                                    "annotations": {REASON_ANNOTATION: message, AT_ANNOTATION: _rfc3339(ts)}}
            if not cordoned or ours:  # never claim a cordon someone else made
                meta["labels"] = {OWNER_LABEL: OWNER}
            body = {"metadata": meta,
                    "spec": {"unschedulable": True,
                             "taints": [*others, {"key": TAINT_KEY, "value": op.value, "effect": "NoSchedule"}]}}
            try:
                self._api.patch_node(node, body, field_manager=self.field_manager, _content_type=_SMP)
            except Exception as exc:
                if self._again(exc, attempt):
                    continue
                raise self._translate(exc, node, "cordon and taint") from exc
            owner = f" label {OWNER_LABEL}={OWNER}" if "labels" in meta else " (cordon not ours: no owner label)"
            done.append(f"PATCH /api/v1/nodes/{node} unschedulable=true taint {TAINT_KEY}={op.value}:NoSchedule"
                        + owner)
            break
        cond = _condition(current)
        if cond is None or not (cond.status == "True" and cond.reason == reason and cond.message == message):
            body = {"status": {"conditions": [{
                "type": CONDITION_TYPE, "status": "True", "reason": reason, "message": message,
                "lastHeartbeatTime": _rfc3339(ts), "lastTransitionTime": _rfc3339(ts)}]}}
            self._call(node, "set condition", lambda: self._api.patch_node_status(
                node, body, field_manager=self.field_manager, _content_type=_SMP))
            done.append(f"PATCH /api/v1/nodes/{node}/status condition {CONDITION_TYPE}=True reason={reason}")
        return done, current

    def _evict_all(self, node: str, pods: list[_Pod]) -> tuple[list[_Pod], list[_Pod]]:
        """Evict ``pods``; return (evicted, still blocked at the timeout)."""
        pending = list(pods)
        evicted: list[_Pod] = []
        deadline = self._clock() + self.drain_timeout_s
        while pending:
            blocked = []
            for pod in pending:
                if self._evict(node, pod):
                    evicted.append(pod)
                else:
                    blocked.append(pod)
            pending = blocked
            if not pending or self._clock() + self.pdb_retry_s > deadline:
                break
            log.info("drain %s: %d pods protected by a PodDisruptionBudget; retrying in %g s", node,
                     len(pending), self.pdb_retry_s)
            self._sleep(self.pdb_retry_s)
        return evicted, pending

    def _evict(self, node: str, pod: _Pod) -> bool:
        """One eviction; ``False`` when a PodDisruptionBudget (429) refuses it for now."""
        body: dict[str, Any] = {"apiVersion": "policy/v1", "kind": "Eviction",
                                "metadata": {"name": pod.name, "namespace": pod.namespace}}
        if self.grace_period_s is not None:
            body["deleteOptions"] = {"gracePeriodSeconds": self.grace_period_s}
        attempt = 1
        while True:
            try:
                self._api.create_namespaced_pod_eviction(pod.name, pod.namespace, body, _headers=_JSON_HEADERS)
                return True
            except Exception as exc:
                status = _status(exc)
                if status == 404:  # already gone
                    return True
                if status == 429:  # the disruption budget says not now: the drain loop comes back
                    return False
                if not self._again(exc, attempt):
                    raise self._translate(exc, node, f"eviction of pod {pod}") from exc
                attempt += 1

    def _event(self, node: str, current: Any, reason: str, message: str, ts: float, *, kind: str = "Warning") -> None:
        digest = hashlib.sha256(f"{node}|{reason}|{message}|{ts}".encode()).hexdigest()[:16]
        stamp = _rfc3339(ts)
        body = {"apiVersion": "v1", "kind": "Event",
                "metadata": {"name": f"{node}.fleethealth.{digest}", "namespace": self.event_namespace},
                "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": node,
                                   "uid": getattr(current.metadata, "uid", None) or node},
                "reason": reason, "message": message[:1024], "type": kind, "count": 1,
                "firstTimestamp": stamp, "lastTimestamp": stamp,
                "source": {"component": "fleethealth"}, "reportingComponent": "fleethealth",
                "reportingInstance": "fleethealth"}
        try:
            self._call(node, "record event", lambda: self._api.create_namespaced_event(self.event_namespace, body,
                                                                                _headers=_JSON_HEADERS),
                       retry_conflict=False)
        except SchedulerError as exc:
            if "HTTP 409" not in str(exc):  # 409: the same event exists already (a replay)
                log.warning("could not record the event on node %s (the action stands): %s", node, exc)

    # ------------------------------------------------------------ helpers
    def _check_opt_in(self, node: str, current: Any) -> None:
        if _labels(current).get(OPT_OUT_LABEL, "").lower() == "true":
            raise LeftAlone(f"kubernetes node {node!r} is labelled {OPT_OUT_LABEL}=true: fleethealth leaves it alone")

    def _read(self, node: str) -> Any:
        return self._call(node, "read", lambda: self._api.read_node(node))

    def _call(self, node: str, what: str, fn: Callable[[], Any], *, retry_conflict: bool = True) -> Any:
        attempt = 1
        while True:
            try:
                return fn()
            except Exception as exc:
                if not ((retry_conflict or _status(exc) != 409) and self._again(exc, attempt)):
                    raise self._translate(exc, node, what) from exc
                attempt += 1

    def _again(self, exc: Exception, attempt: int) -> bool:
        """True (after a backoff) when ``exc`` is worth another attempt and attempts remain."""
        if _status(exc) in _RETRIED and attempt < self.retries:
            self._backoff(attempt)
            return True
        return False

    def _backoff(self, attempt: int) -> None:
        self._sleep(self.backoff_s * (2 ** (attempt - 1)) * self._rng())  # full jitter

    @staticmethod
    def _translate(exc: Exception, node: str, what: str) -> SchedulerError:
        status = _status(exc)
        if status == 404:
            return UnknownNode(f"kubernetes does not know node {node!r}")
        if status is None and isinstance(exc, SchedulerError):
            return exc
        detail = getattr(exc, "reason", None) or str(exc)
        return SchedulerError(f"kubernetes {what} of node {node!r} failed"
                              f"{'' if status is None else f' (HTTP {status})'}: {str(detail)[:300]}")


def _status(exc: Exception) -> int | None:
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) else None


def _labels(node: Any) -> dict[str, str]:
    return dict((node.metadata.labels or {}) if node.metadata is not None else {})


def _annotations(node: Any) -> dict[str, str]:
    return dict((node.metadata.annotations or {}) if node.metadata is not None else {})


def _unschedulable(node: Any) -> bool:
    return bool(node.spec is not None and node.spec.unschedulable)


def _taints(node: Any) -> list[dict[str, Any]]:
    return [_taint_obj(t) for t in (node.spec.taints or [])] if node.spec is not None else []


def _condition(node: Any) -> Any:
    for cond in (node.status.conditions or []) if node.status is not None else []:
        if cond.type == CONDITION_TYPE:
            return cond
    return None


def drain_filter(pods: list[Any], *, force: bool = False, delete_emptydir_data: bool = False,
                 skip_namespaces: tuple[str, ...] = DEFAULT_SKIP_NAMESPACES
                 ) -> tuple[list[_Pod], list[tuple[_Pod, str]]]:
    """``kubectl drain``'s filters over a node's pods (client ``V1Pod`` objects): the pods to evict,
    and the pods that make the drain refuse with what would allow each.

    Left running: DaemonSet and mirror pods, pods finished or terminating, pods in ``skip_namespaces``.
    Refused unless allowed: a pod no controller manages (``force``), a pod with an ``emptyDir``
    volume (``delete_emptydir_data``)."""
    evict: list[_Pod] = []
    refused: list[tuple[_Pod, str]] = []
    for pod in pods:
        meta = pod.metadata
        owners = [ref for ref in (meta.owner_references or []) if ref.controller]
        if meta.deletion_timestamp is not None or _MIRROR_ANNOTATION in (meta.annotations or {}):
            continue
        if any(ref.kind == "DaemonSet" for ref in owners) or meta.namespace in skip_namespaces:
            continue
        if pod.status is not None and pod.status.phase in ("Succeeded", "Failed"):
            continue
        ref = _Pod(meta.namespace, meta.name)
        if not owners and not force:
            refused.append((ref, "no controller manages it: it would not come back; act.drain_force allows it"))
        elif any(v.empty_dir is not None for v in ((pod.spec.volumes if pod.spec else None) or [])) \
                and not delete_emptydir_data:
            refused.append((ref, "its emptyDir data would be lost; act.drain_delete_emptydir_data allows it"))
        else:
            evict.append(ref)
    return evict, refused


def _taint_obj(taint: Any) -> dict[str, Any]:
    obj = {"key": taint.key, "effect": taint.effect}
    if taint.value is not None:
        obj["value"] = taint.value
    if getattr(taint, "time_added", None) is not None:
        added = taint.time_added
        obj["timeAdded"] = added if isinstance(added, str) else added.strftime("%Y-%m-%dT%H:%M:%SZ")
    return obj


def _condition_reason(rec: Recommendation) -> str:
    """A CamelCase condition reason from the action (condition reasons are one word)."""
    return "FleetHealth" + "".join(part.capitalize() for part in rec.action.value.split("_"))
