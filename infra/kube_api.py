"""The Kubernetes API calls the launcher makes, through the official client, in and out as the API's JSON.

Typed calls are made with `_preload_content=False` and decoded here, so the launcher, the
classifier and the tests all read objects in the one shape the API server sends.
Configuration: in a pod, the pod's service account (the flow pod's, infra/k8s/rbac.yaml);
elsewhere, the kubeconfig that KUBECONFIG names (or ~/.kube/config), as kubectl does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

from infra.kube_names import JOBSET_GROUP, JOBSET_PLURAL, JOBSET_VERSION

FOREGROUND = "Foreground"  # the owner goes only after its Jobs and pods: nothing outlives a delete


class KubeError(RuntimeError):
    """An API call the cluster refused; `status` is the HTTP status (0: no answer)."""

    def __init__(self, status: int, reason: str, message: str):
        super().__init__(f"{status} {reason}: {message}" if status else message)
        self.status, self.reason, self.message = status, reason, message


def _error(exc: ApiException) -> KubeError:
    message = exc.reason or ""
    try:
        body = json.loads(exc.body or "{}")
        message = body.get("message") or message
    except ValueError:
        pass
    return KubeError(exc.status or 0, exc.reason or "", message)


def api_client() -> client.ApiClient:
    """A client of its own (the process-wide default configuration is left alone)."""
    try:
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            conf = client.Configuration()
            config.load_incluster_config(client_configuration=conf)
            return client.ApiClient(conf)
        # KUBECONFIG is read now, not when the client package was imported
        return config.new_client_from_config(config_file=os.environ.get("KUBECONFIG"))
    except config.ConfigException as exc:
        raise KubeError(0, "", f"no Kubernetes API to talk to: {exc} (set KUBECONFIG, or run in a pod)") from None


class Kube:
    """One namespace of one cluster."""

    def __init__(self, namespace: str, api: client.ApiClient | None = None):
        self.namespace = namespace
        self.api = api or api_client()
        self.core = client.CoreV1Api(self.api)
        self.batch = client.BatchV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.networking = client.NetworkingV1Api(self.api)

    # -- plumbing ----------------------------------------------------------------------------------

    @staticmethod
    def _call(fn, *args, **kwargs) -> dict:
        try:
            resp = fn(*args, _preload_content=False, **kwargs)
        except ApiException as exc:
            raise _error(exc) from None
        return json.loads(resp.data or b"{}")

    def _custom(self, verb: str, *args, **kwargs) -> dict:
        fn = getattr(self.custom, f"{verb}_namespaced_custom_object")
        try:
            return fn(JOBSET_GROUP, JOBSET_VERSION, self.namespace, JOBSET_PLURAL, *args, **kwargs)
        except ApiException as exc:
            raise _error(exc) from None

    # -- create / read / delete ----------------------------------------------------------------------

    def create(self, obj: dict) -> dict:
        kind = obj["kind"]
        if kind == "JobSet":
            return self._custom("create", obj)
        fn = {
            "ConfigMap": self.core.create_namespaced_config_map,
            "NetworkPolicy": self.networking.create_namespaced_network_policy,
            "Service": self.core.create_namespaced_service,
            "Job": self.batch.create_namespaced_job,
        }[kind]
        return self._call(fn, self.namespace, obj)

    def get(self, kind: str, name: str) -> dict | None:
        """The object, or None when there is none."""
        try:
            if kind == "JobSet":
                return self._custom("get", name)
            fn = {
                "ConfigMap": self.core.read_namespaced_config_map,
                "NetworkPolicy": self.networking.read_namespaced_network_policy,
                "Service": self.core.read_namespaced_service,
                "Job": self.batch.read_namespaced_job,
            }[kind]
            return self._call(fn, name, self.namespace)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def delete(self, kind: str, name: str) -> None:
        """Delete with foreground propagation; an object already gone is fine."""
        try:
            if kind == "JobSet":
                self._custom("delete", name, propagation_policy=FOREGROUND)
                return
            fn = {
                "ConfigMap": self.core.delete_namespaced_config_map,
                "NetworkPolicy": self.networking.delete_namespaced_network_policy,
                "Service": self.core.delete_namespaced_service,
                "Job": self.batch.delete_namespaced_job,
            }[kind]
            self._call(fn, name, self.namespace, propagation_policy=FOREGROUND)
        except KubeError as exc:
            if exc.status != 404:
                raise

    def list(self, kind: str, selector: str = "", field_selector: str = "") -> list[dict]:
        if kind == "JobSet":
            return self._custom("list", label_selector=selector, field_selector=field_selector).get("items", [])
        fn = {
            "ConfigMap": self.core.list_namespaced_config_map,
            "NetworkPolicy": self.networking.list_namespaced_network_policy,
            "Service": self.core.list_namespaced_service,
            "Job": self.batch.list_namespaced_job,
            "Pod": self.core.list_namespaced_pod,
            "Event": self.core.list_namespaced_event,
        }[kind]
        return self._call(fn, self.namespace, label_selector=selector, field_selector=field_selector).get("items", [])

    def patch_node(self, name: str, patch: dict) -> dict:
        """A strategic merge patch of a Node (cluster-scoped: its labels, to keep groups off it)."""
        return self._call(self.core.patch_node, name, patch)

    # -- watch and logs ------------------------------------------------------------------------------

    def watch(self, kind: str, name: str, timeout_s: int) -> Iterator[tuple[str, dict]]:
        """(type, object) events of one JobSet or Job until the server ends the watch after timeout_s."""
        if kind == "JobSet":
            fn, args = (
                self.custom.list_namespaced_custom_object,
                (JOBSET_GROUP, JOBSET_VERSION, self.namespace, JOBSET_PLURAL),
            )
        else:
            fn, args = self.batch.list_namespaced_job, (self.namespace,)
        w = watch.Watch()
        try:
            for event in w.stream(
                fn, *args, field_selector=f"metadata.name={name}", timeout_seconds=timeout_s, deserialize=False
            ):
                obj = event.get("raw_object") or event.get("object")
                if isinstance(obj, str):
                    obj = json.loads(obj)
                yield event["type"], obj
        except ApiException as exc:
            raise _error(exc) from None
        finally:
            w.stop()

    def follow_log(self, pod: str, container: str, since_start: bool = True) -> Iterator[bytes]:
        """The container's output as it is written, until the container ends (or the stream breaks)."""
        try:
            resp = self.core.read_namespaced_pod_log(
                pod, self.namespace, container=container, follow=True, _preload_content=False
            )
        except ApiException as exc:
            raise _error(exc) from None
        try:
            yield from resp.stream(4096, decode_content=True)
        finally:
            resp.release_conn()

    def log_tail(self, pod: str, container: str, lines: int) -> str:
        try:
            resp = self.core.read_namespaced_pod_log(
                pod, self.namespace, container=container, tail_lines=lines, _preload_content=False
            )
        except ApiException as exc:
            raise _error(exc) from None
        return resp.data.decode(errors="replace")
