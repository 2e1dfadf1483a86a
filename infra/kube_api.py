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

import urllib3
from kubernetes import client, config
from kubernetes.client.rest import ApiException
from kubernetes.watch.watch import iter_resp_lines

from infra.kube_names import JOBSET_GROUP, JOBSET_PLURAL, JOBSET_VERSION

FOREGROUND = "Foreground"  # the owner goes only after its Jobs and pods: nothing outlives a delete

# Every request has a client-side limit: the client's default is none, and a half-open connection (a node of the
# API server gone without a FIN) would then block its caller forever. (connect, read) seconds.
REQUEST_TIMEOUT = (10.0, 30.0)
# A watch is ended by the server after its timeoutSeconds; silence this much longer means the connection is dead.
WATCH_SLACK_S = 15.0
# A followed log can be quiet for minutes (a checkpoint save, an evaluation): the read limit only has to notice a
# dead connection eventually; the relay then reconnects and skips what it already has.
FOLLOW_READ_S = 300.0


class KubeError(RuntimeError):
    """An API call the cluster refused; `status` is the HTTP status (0: no answer)."""

    def __init__(self, status: int, reason: str, message: str):
        super().__init__(f"{status} {reason}: {message}" if status else message)
        self.status, self.reason, self.message = status, reason, message

    @property
    def transient(self) -> bool:
        """Whether asking again later may succeed: no answer, throttled, the server's own error, or a watch
        whose resourceVersion was compacted away (410: relist and watch again)."""
        return isinstance(self, ApiUnreachable) or self.status in (410, 429) or self.status >= 500


class ApiUnreachable(KubeError):
    """No answer from the API server: refused, reset, timed out, or the stream broke off."""

    def __init__(self, what: str, exc: BaseException):
        super().__init__(0, "", f"no answer from the Kubernetes API ({what}): {type(exc).__name__}: {exc}")


# What urllib3 and the socket raise when the server is away, resets, or never answers; the client passes them on.
_TRANSPORT = (urllib3.exceptions.HTTPError, OSError)


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
            resp = fn(*args, _preload_content=False, _request_timeout=REQUEST_TIMEOUT, **kwargs)
            return json.loads(resp.data or b"{}")
        except ApiException as exc:
            raise _error(exc) from None
        except _TRANSPORT as exc:
            raise ApiUnreachable(fn.__name__, exc) from None

    def _custom(self, verb: str, *args, **kwargs) -> dict:
        fn = getattr(self.custom, f"{verb}_namespaced_custom_object")
        return self._call(fn, JOBSET_GROUP, JOBSET_VERSION, self.namespace, JOBSET_PLURAL, *args, **kwargs)

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
        return self._list_raw(kind, selector, field_selector).get("items", [])

    def _list_raw(self, kind: str, selector: str = "", field_selector: str = "") -> dict:
        if kind == "JobSet":
            return self._custom("list", label_selector=selector, field_selector=field_selector)
        fn = {
            "ConfigMap": self.core.list_namespaced_config_map,
            "NetworkPolicy": self.networking.list_namespaced_network_policy,
            "Service": self.core.list_namespaced_service,
            "Job": self.batch.list_namespaced_job,
            "Pod": self.core.list_namespaced_pod,
            "Event": self.core.list_namespaced_event,
        }[kind]
        return self._call(fn, self.namespace, label_selector=selector, field_selector=field_selector)

    def patch(self, kind: str, name: str, patch: dict) -> dict:
        """A merge patch of a namespaced object beside a group (its metadata: ownerReferences)."""
        fn = {
            "ConfigMap": self.core.patch_namespaced_config_map,
            "NetworkPolicy": self.networking.patch_namespaced_network_policy,
            "Service": self.core.patch_namespaced_service,
        }[kind]
        return self._call(fn, name, self.namespace, patch)

    def patch_node(self, name: str, patch: dict) -> dict:
        """A strategic merge patch of a Node (cluster-scoped: its labels, to keep groups off it)."""
        return self._call(self.core.patch_node, name, patch)

    # -- watch and logs ------------------------------------------------------------------------------

    def get_with_version(self, kind: str, name: str) -> tuple[dict | None, str]:
        """The object (None when there is none) and the resourceVersion to watch it from: the list's, so a watch
        started from it misses no change made after this read, the object's deletion included."""
        listed = self._list_raw(kind, field_selector=f"metadata.name={name}")
        items = listed.get("items", [])
        return (items[0] if items else None), (listed.get("metadata") or {}).get("resourceVersion", "")

    def watch(self, kind: str, name: str, timeout_s: int, resource_version: str = "") -> Iterator[tuple[str, dict]]:
        """(type, object) events of one JobSet or Job after `resource_version` (none: its current state first, as
        ADDED) until the server ends the watch after timeout_s.

        Raises KubeError 410 when that version is too old (the server compacted it: relist), ApiUnreachable when
        the connection breaks or stays silent past timeout_s + WATCH_SLACK_S. The client's own Watch is not used:
        with raw events it fails on an ERROR event (KeyError 'raw_object') instead of reporting it.
        """
        if kind == "JobSet":
            fn = self.custom.list_namespaced_custom_object
            args: tuple = (JOBSET_GROUP, JOBSET_VERSION, self.namespace, JOBSET_PLURAL)
        else:
            fn, args = self.batch.list_namespaced_job, (self.namespace,)
        extra = {"resource_version": resource_version} if resource_version else {}
        try:
            resp = fn(
                *args,
                field_selector=f"metadata.name={name}",
                watch=True,
                timeout_seconds=timeout_s,
                _preload_content=False,
                _request_timeout=(REQUEST_TIMEOUT[0], timeout_s + WATCH_SLACK_S),
                **extra,
            )
        except ApiException as exc:
            raise _error(exc) from None
        except _TRANSPORT as exc:
            raise ApiUnreachable(f"watch of {kind} {name}", exc) from None
        try:
            for line in iter_resp_lines(resp):
                if not line.strip():
                    continue
                try:
                    event = json.loads(line)
                except ValueError:
                    raise ApiUnreachable(f"watch of {kind} {name}", ValueError(f"cut-off event: {line[:80]}")) from None
                obj = event.get("object") or {}
                if event.get("type") == "ERROR":  # a Status in the stream, e.g. 410 Expired
                    raise KubeError(int(obj.get("code") or 0), obj.get("reason", ""), obj.get("message", ""))
                yield event["type"], obj
        except _TRANSPORT as exc:
            raise ApiUnreachable(f"watch of {kind} {name}", exc) from None
        finally:
            resp.close()
            resp.release_conn()

    def follow_log(self, pod: str, container: str, since_start: bool = True) -> Iterator[bytes]:
        """The container's output as it is written, until the container ends (or the stream breaks). The first
        chunk is b"" once the server has answered: a follower can tell "open and quiet" from "still asking"."""
        try:
            resp = self.core.read_namespaced_pod_log(
                pod,
                self.namespace,
                container=container,
                follow=True,
                _preload_content=False,
                _request_timeout=(REQUEST_TIMEOUT[0], FOLLOW_READ_S),
            )
        except ApiException as exc:
            raise _error(exc) from None
        except _TRANSPORT as exc:
            raise ApiUnreachable(f"log of pod {pod}", exc) from None
        try:
            yield b""
            yield from resp.stream(4096, decode_content=True)
        except _TRANSPORT as exc:
            raise ApiUnreachable(f"log of pod {pod}", exc) from None
        finally:
            resp.release_conn()

    def log_tail(self, pod: str, container: str, lines: int) -> str:
        try:
            resp = self.core.read_namespaced_pod_log(
                pod,
                self.namespace,
                container=container,
                tail_lines=lines,
                _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT,
            )
            return resp.data.decode(errors="replace")
        except ApiException as exc:
            raise _error(exc) from None
        except _TRANSPORT as exc:
            raise ApiUnreachable(f"log of pod {pod}", exc) from None
