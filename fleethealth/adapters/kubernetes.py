"""Kubernetes adapter: cordon, taint and mark a node through the official ``kubernetes`` client.

For ``evict``, ``drain`` and ``quarantine`` the adapter

1. reads the node (``GET /api/v1/nodes/{name}``),
2. cordons and taints it in one strategic-merge patch that carries the node's
   ``resourceVersion`` (so a concurrent writer makes it fail with 409 and it is retried once on
   a fresh read): ``spec.unschedulable: true`` and the taint
   ``fleethealth.io/unhealthy=<action>:NoSchedule`` added to the existing taints,
3. sets the node condition ``FleetHealthUnhealthy=True`` with the reason and the
   recommendation id (``PATCH /api/v1/nodes/{name}/status``; conditions merge by ``type``).

A step whose result is already in place is not sent again, so replaying a recommendation
makes no write. When the cordon is fleethealth's own (the node was schedulable before), the same
patch sets the annotation ``fleethealth.io/cordoned=true``. ``release`` undoes only what
fleethealth did: it removes the taint and sets the condition to False, and uncordons the node
(and drops the annotation) only when the annotation says fleethealth cordoned it; a node a person
cordoned stays cordoned. Running pods are not evicted: that is the job's restart at its next
checkpoint (``NoSchedule``, not ``NoExecute``).

The client is imported only when an adapter is built without an ``api`` object.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

from fleethealth.adapters.base import SchedulerError, UnknownNode, check_node_name, clean_reason
from fleethealth.schema import Action, Recommendation

__all__ = ["KubernetesAdapter", "TAINT_KEY", "CONDITION_TYPE", "CORDON_ANNOTATION"]

TAINT_KEY = "fleethealth.io/unhealthy"
CORDON_ANNOTATION = "fleethealth.io/cordoned"
"""Set to ``"true"`` when fleethealth made the node unschedulable, so a release undoes only that."""
CONDITION_TYPE = "FleetHealthUnhealthy"
_ACTIONS = frozenset({Action.EVICT, Action.DRAIN, Action.QUARANTINE})
_SMP = "application/strategic-merge-patch+json"
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_VALUE_BAD = re.compile(r"[^A-Za-z0-9_.-]+")


def _rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _label_value(text: str) -> str:
    """A valid label value (taint values follow label-value rules): ``[A-Za-z0-9_.-]``, ≤ 63."""
    value = _LABEL_VALUE_BAD.sub("-", text).strip("-_.")[:63].strip("-_.")
    return value or "unhealthy"


def _k8s_node(node: str) -> str:
    check_node_name(node)
    if len(node) > 253 or not _DNS_SUBDOMAIN.fullmatch(node):
        raise SchedulerError(f"refusing node name {node!r}: not a Kubernetes node name (RFC 1123 subdomain)")
    return node


class KubernetesAdapter:
    """Cordon, taint and condition Kubernetes nodes.

    Parameters
    ----------
    api:
        A ``kubernetes.client.CoreV1Api``; default: one built from ``kubeconfig`` (or the
        in-cluster service account when ``in_cluster``).
    field_manager:
        The field manager the API server records for these writes.
    """

    name = "kubernetes"

    def __init__(self, api: Any = None, *, kubeconfig: str | None = None, in_cluster: bool = False,
                 field_manager: str = "fleethealth") -> None:
        self.field_manager = field_manager
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
        return action in _ACTIONS

    def plan(self, rec: Recommendation) -> tuple[str, ...]:
        node = _k8s_node(rec.node)
        return (f"PATCH /api/v1/nodes/{node} spec.unschedulable=true",
                f"PATCH /api/v1/nodes/{node} taint {TAINT_KEY}={_label_value(rec.action.value)}:NoSchedule",
                f"PATCH /api/v1/nodes/{node}/status condition {CONDITION_TYPE}=True")

    def apply(self, rec: Recommendation) -> tuple[str, ...]:
        if not self.supports(rec.action):
            raise SchedulerError(f"kubernetes has no operation for action {rec.action.value!r}")
        message = clean_reason(f"{rec.action.value} ({rec.id}): {rec.reason}", limit=1000)
        return self.cordon(rec.node, taint_value=rec.action.value, reason=_condition_reason(rec),
                           message=message, ts=rec.ts)

    # ------------------------------------------------------------ operations
    def cordon(self, node: str, *, taint_value: str, reason: str, message: str, ts: float) -> tuple[str, ...]:
        """Cordon ``node``, add the fleethealth taint and set the condition; return the writes made."""
        node = _k8s_node(node)
        done: list[str] = []
        value = _label_value(taint_value)
        for attempt in (1, 2):
            current = self._read(node)
            spec = current.spec
            taints = [_taint_obj(t) for t in (spec.taints or [])] if spec is not None else []
            mine = [t for t in taints if t["key"] == TAINT_KEY and t["effect"] == "NoSchedule"]
            cordoned = bool(spec is not None and spec.unschedulable)
            if cordoned and mine and mine[0].get("value") == value:
                break
            others = [t for t in taints if not (t["key"] == TAINT_KEY and t["effect"] == "NoSchedule")]
            meta: dict[str, Any] = {"resourceVersion": current.metadata.resource_version}
            if not cordoned:
                meta["annotations"] = {CORDON_ANNOTATION: "true"}
            body = {"metadata": meta,
                    "spec": {"unschedulable": True,
                             "taints": [*others, {"key": TAINT_KEY, "value": value, "effect": "NoSchedule"}]}}
            try:
                self._api.patch_node(node, body, field_manager=self.field_manager, _content_type=_SMP)
            except Exception as exc:  # the client's ApiException, translated below
                if _status(exc) == 409 and attempt == 1:
                    continue
                raise self._translate(exc, node, "cordon and taint") from exc
            done.append(f"PATCH /api/v1/nodes/{node} unschedulable=true taint {TAINT_KEY}={value}:NoSchedule")
            break
        if _condition_differs(current, "True", reason, message):
            body = {"status": {"conditions": [{
                "type": CONDITION_TYPE, "status": "True", "reason": reason, "message": message,
                "lastHeartbeatTime": _rfc3339(ts), "lastTransitionTime": _rfc3339(ts)}]}}
            try:
                self._api.patch_node_status(node, body, field_manager=self.field_manager, _content_type=_SMP)
            except Exception as exc:
                raise self._translate(exc, node, "set condition") from exc
            done.append(f"PATCH /api/v1/nodes/{node}/status condition {CONDITION_TYPE}=True reason={reason}")
        return tuple(done)

    def release(self, node: str, *, ts: float, message: str = "released") -> tuple[str, ...]:
        """Remove the fleethealth taint, set the condition to False, and uncordon ``node`` only when
        fleethealth cordoned it (:data:`CORDON_ANNOTATION`); a person's cordon is left in place."""
        node = _k8s_node(node)
        current = self._read(node)
        spec = current.spec
        taints = [_taint_obj(t) for t in (spec.taints or [])] if spec is not None else []
        kept = [t for t in taints if t["key"] != TAINT_KEY]
        annotations = (current.metadata.annotations or {}) if current.metadata is not None else {}
        ours = annotations.get(CORDON_ANNOTATION) == "true"
        meta: dict[str, Any] = {"resourceVersion": current.metadata.resource_version}
        node_spec: dict[str, Any] = {"taints": kept}
        if ours:
            meta["annotations"] = {CORDON_ANNOTATION: None}
            node_spec = {"unschedulable": False, **node_spec}
        body = {"metadata": meta, "spec": node_spec}
        try:
            self._api.patch_node(node, body, field_manager=self.field_manager, _content_type=_SMP)
            self._api.patch_node_status(node, {"status": {"conditions": [{
                "type": CONDITION_TYPE, "status": "False", "reason": "Released", "message": clean_reason(message),
                "lastHeartbeatTime": _rfc3339(ts), "lastTransitionTime": _rfc3339(ts)}]}},
                field_manager=self.field_manager, _content_type=_SMP)
        except Exception as exc:
            raise self._translate(exc, node, "release") from exc
        spec_op = "unschedulable=false " if ours else "(cordon not ours, kept) "
        return (f"PATCH /api/v1/nodes/{node} {spec_op}remove taint {TAINT_KEY}",
                f"PATCH /api/v1/nodes/{node}/status condition {CONDITION_TYPE}=False")

    # ------------------------------------------------------------ helpers
    def _read(self, node: str) -> Any:
        try:
            return self._api.read_node(node)
        except Exception as exc:
            raise self._translate(exc, node, "read") from exc

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


def _condition_differs(current: Any, status: str, reason: str, message: str) -> bool:
    """True unless the node read already carries our condition with this status, reason and message."""
    for cond in (current.status.conditions or []) if current.status is not None else []:
        if cond.type == CONDITION_TYPE:
            return not (cond.status == status and cond.reason == reason and cond.message == message)
    return True


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
