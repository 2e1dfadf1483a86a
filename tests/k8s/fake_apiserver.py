"""A local HTTP server that speaks the Kubernetes API's JSON, for the launcher's control-logic tests.

It serves the REST paths the official client calls (JobSet custom objects, Jobs, Pods, pod logs,
Services, ConfigMaps, Events), with label and field selectors, watches (`?watch=true`, one JSON
event per line, ended after timeoutSeconds), followed log streams, foreground deletion that
removes a group's pods before the group, and Status objects for errors. Objects have the shapes
the real API returns (metadata.uid/resourceVersion/creationTimestamp, status.conditions,
containerStatuses, Job failure messages as the Job controller writes them).

It also has a real cluster's faults, each switched on by a test (FakeCluster.faults and FakeApiServer.restart):
answers of 500, answers slower than the client's timeout, a watch connection reset mid-stream, 410 Gone for a
watch from a compacted resourceVersion, and an API server that goes away and comes back with its objects.

There are no controllers: a test plays the JobSet/Job controllers and the kubelet through
FakeCluster's methods (start the pods of a group, write to a pod's log, end a container, set a
condition), so each scenario says exactly what the cluster did.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import socket
import struct
import threading
import time
import uuid
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

_PATHS = [
    (
        re.compile(r"^/apis/jobset\.x-k8s\.io/v1alpha2/namespaces/([^/]+)/jobsets(?:/([^/]+))?$"),
        "JobSet",
        "jobset.x-k8s.io/v1alpha2",
    ),
    (re.compile(r"^/apis/batch/v1/namespaces/([^/]+)/jobs(?:/([^/]+))?$"), "Job", "batch/v1"),
    (re.compile(r"^/api/v1/namespaces/([^/]+)/pods(?:/([^/]+))?$"), "Pod", "v1"),
    (re.compile(r"^/api/v1/namespaces/([^/]+)/services(?:/([^/]+))?$"), "Service", "v1"),
    (re.compile(r"^/api/v1/namespaces/([^/]+)/configmaps(?:/([^/]+))?$"), "ConfigMap", "v1"),
    (re.compile(r"^/api/v1/namespaces/([^/]+)/events(?:/([^/]+))?$"), "Event", "v1"),
    (
        re.compile(r"^/apis/networking\.k8s\.io/v1/namespaces/([^/]+)/networkpolicies(?:/([^/]+))?$"),
        "NetworkPolicy",
        "networking.k8s.io/v1",
    ),
]
_LOG_PATH = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)/log$")
_NODE_PATH = re.compile(r"^/api/v1/nodes/([^/]+)$")  # cluster-scoped: stored in namespace ""
_CHILD_LABEL = {"JobSet": "jobset.sigs.k8s.io/jobset-name", "Job": "batch.kubernetes.io/job-name"}


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str) -> dict:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _matches(obj: dict, labels: str, fields: str) -> bool:
    have = obj["metadata"].get("labels") or {}
    for term in filter(None, labels.split(",")):
        key, _, value = term.partition("=")
        if have.get(key) != value:
            return False
    for term in filter(None, fields.split(",")):
        key, _, value = term.partition("=")
        node = obj
        for part in key.split("."):
            node = (node or {}).get(part) if isinstance(node, dict) else None
        if node != value:
            return False
    return True


class Faults:
    """Faults a test switches on; each counter is spent one request at a time."""

    def __init__(self) -> None:
        self.errors = 0  # the next this many requests (of any kind) are answered 500 InternalError
        self.delay_s = 0.0  # every answer is held back this long first (a slow API server)
        self.reset_watches = 0  # the next this many watches are reset (TCP RST) after their first events
        self.follow_delay_s = 0.0  # a followed log answers this long after it is asked (a kubelet slow to open it)
        self.lock = threading.Lock()

    def take(self, what: str) -> bool:
        with self.lock:
            left = getattr(self, what)
            if left > 0:
                setattr(self, what, left - 1)
            return left > 0


class FakeCluster:
    """The API server's state, plus the moves a controller or kubelet would make."""

    def __init__(self, delete_delay_s: float = 0.3):
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.history: list[tuple[int, str, str, dict]] = []  # (resourceVersion, type, kind, object)
        self.logs: dict[str, bytearray] = {}
        self.log_closed: set[str] = set()
        self.creates: list[tuple[str, str]] = []  # (kind, name) of every POST that succeeded
        self.deletes: list[tuple[str, str, str]] = []  # (kind, name, propagationPolicy)
        self.refuse: dict[str, tuple[int, str, str]] = {}  # kind -> the error a POST (or a Node PATCH) of it gets
        self.delete_delay_s = delete_delay_s
        self.faults = Faults()
        self.compacted = 0  # a watch from an older resourceVersion gets 410 Gone (compact() moves it)
        self.requests = 0  # every request served, watches and logs included
        self.expired = 0  # watches answered 410 Gone
        self._rv = itertools.count(1)
        self.cond = threading.Condition()

    @property
    def version(self) -> int:
        """The newest resourceVersion (what a list reports)."""
        with self.cond:
            return self.history[-1][0] if self.history else 0

    def compact(self) -> None:
        """What etcd's compaction does to watchers: every version up to now is gone (a watch from one gets 410)."""
        with self.cond:
            self.compacted = self.version

    # -- storage -------------------------------------------------------------------------------------

    def _emit(self, kind: str, event: str, obj: dict) -> None:
        rv = next(self._rv)
        obj["metadata"]["resourceVersion"] = str(rv)
        self.history.append((rv, event, kind, copy.deepcopy(obj)))
        self.cond.notify_all()

    def put(self, kind: str, obj: dict, ns: str = "default") -> dict:
        with self.cond:
            meta = obj.setdefault("metadata", {})
            meta.setdefault("namespace", ns)
            key = (kind, meta["namespace"], meta["name"])
            event = "MODIFIED" if key in self.objects else "ADDED"
            if event == "ADDED":
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("creationTimestamp", now())
            self.objects[key] = obj
            self._emit(kind, event, obj)
            return obj

    def get(self, kind: str, name: str, ns: str | None = None) -> dict | None:
        with self.cond:
            for (k, n, name_), obj in self.objects.items():
                if k == kind and name_ == name and (ns is None or n == ns):
                    return obj
        return None

    def items(self, kind: str, labels: str = "", fields: str = "") -> list[dict]:
        with self.cond:
            return [o for (k, _, _), o in self.objects.items() if k == kind and _matches(o, labels, fields)]

    def remove(self, kind: str, name: str, ns: str) -> None:
        with self.cond:
            obj = self.objects.pop((kind, ns, name), None)
            if obj is not None:
                self._emit(kind, "DELETED", obj)
                if kind == "Pod":
                    self.log_closed.add(name)

    def delete(self, kind: str, name: str, ns: str, policy: str) -> dict | None:
        """Foreground: mark the owner, remove its pods, then the owner (what the garbage collector does)."""
        with self.cond:
            obj = self.objects.get((kind, ns, name))
            if obj is None:
                return None
            self.deletes.append((kind, name, policy))
            obj["metadata"]["deletionTimestamp"] = now()
            if policy == "Foreground":
                obj["metadata"]["finalizers"] = ["foregroundDeletion"]
            self._emit(kind, "MODIFIED", obj)

        def collect() -> None:
            time.sleep(self.delete_delay_s)
            if kind in _CHILD_LABEL:
                for pod in self.items("Pod", f"{_CHILD_LABEL[kind]}={name}"):
                    self.remove("Pod", pod["metadata"]["name"], ns)
            self.remove(kind, name, ns)

        threading.Thread(target=collect, daemon=True).start()
        return obj

    def names(self) -> list[tuple[str, str]]:
        with self.cond:
            return sorted((k, n) for (k, _, n) in self.objects if k not in ("Event", "Node"))  # the launcher's

    # -- what controllers and kubelets do -------------------------------------------------------------

    def wait_for(self, kind: str, name: str | None = None, timeout: float = 30.0, new_after: int = 0) -> dict:
        """The object once it exists (name None: any of the kind created after the `new_after`-th create)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                recent = set(self.creates[new_after:])
                found = [
                    o
                    for (k, _, n), o in self.objects.items()
                    if (k, n) in recent
                    and k == kind
                    and (name is None or n == name)
                    and not o["metadata"].get("deletionTimestamp")
                ]
                if found:
                    return found[0]
                left = deadline - time.monotonic()
                assert left > 0, f"no {kind} {name or ''} appeared; objects: {self.names()}"
                self.cond.wait(left)

    def wait_gone(self, kind: str, name: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while any(k == kind and n == name for (k, _, n) in self.objects):
                left = deadline - time.monotonic()
                assert left > 0, f"{kind} {name} was not deleted"
                self.cond.wait(left)

    def start_pods(self, group: dict, phase: str = "Running", indexes: list[int] | None = None) -> list[str]:
        """The pods a Job (or a JobSet's one Indexed Job) creates, one per completion index (`indexes`: only those,
        as the Job controller starts a parallelism-bounded Job's next indexes, or replaces one index's failed pod)."""
        kind, name, ns = group["kind"], group["metadata"]["name"], group["metadata"]["namespace"]
        if kind == "JobSet":
            rj = group["spec"]["replicatedJobs"][0]
            job_name, job_spec = f"{name}-{rj['name']}-0", rj["template"]["spec"]
        else:
            job_name, job_spec = name, group["spec"]
        template = job_spec["template"]
        names = []
        for index in range(job_spec.get("completions", 1)) if indexes is None else indexes:
            suffix = uuid.uuid4().hex[:5]
            pod_name = (
                f"{job_name}-{index}-{suffix}"
                if job_spec.get("completionMode") == "Indexed"
                else f"{job_name}-{suffix}"
            )
            labels = {
                **template["metadata"].get("labels", {}),
                "batch.kubernetes.io/job-name": job_name,
                "job-name": job_name,
                "batch.kubernetes.io/job-completion-index": str(index),
            }
            if kind == "JobSet":
                labels["jobset.sigs.k8s.io/jobset-name"] = name
            container = template["spec"]["containers"][0]["name"]
            running = (
                {"running": {"startedAt": now()}}
                if phase == "Running"
                else {"waiting": {"reason": "ContainerCreating"}}
            )
            spec = copy.deepcopy(template["spec"]) | {"nodeName": f"gpu-{index}"}  # the scheduler's choice
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": pod_name,
                    "namespace": ns,
                    "labels": labels,
                    "annotations": {"batch.kubernetes.io/job-completion-index": str(index)},
                    "ownerReferences": [
                        {
                            "apiVersion": "batch/v1",
                            "kind": "Job",
                            "name": job_name,
                            "uid": str(uuid.uuid4()),
                            "controller": True,
                        }
                    ],
                },
                "spec": spec,
                "status": {
                    "phase": phase,
                    "conditions": [{"type": "PodScheduled", "status": "True"}],
                    "containerStatuses": [
                        {
                            "name": container,
                            "ready": phase == "Running",
                            "restartCount": 0,
                            "image": container,
                            "state": running,
                        }
                    ],
                },
            }
            self.logs[pod_name] = bytearray()
            self.put("Pod", pod, ns)
            names.append(pod_name)
        return names

    def pod(self, name: str) -> dict:
        pod = self.get("Pod", name)
        assert pod is not None, f"no pod {name}"
        return pod

    def log(self, pod: str, text: str) -> None:
        with self.cond:
            self.logs.setdefault(pod, bytearray()).extend(text.encode())
            self.cond.notify_all()

    def terminate(self, pod_name: str, exit_code: int, reason: str | None = None, message: str | None = None) -> None:
        """The container ends; the pod's phase follows (restartPolicy Never). `message`: what the container wrote to
        its terminationMessagePath, which the kubelet copies into the state."""
        pod = copy.deepcopy(self.pod(pod_name))
        state = {
            "exitCode": exit_code,
            "reason": reason or ("Completed" if exit_code == 0 else "Error"),
            "startedAt": now(),
            "finishedAt": now(),
        }
        if message is not None:
            state["message"] = message
        pod["status"]["containerStatuses"][0]["state"] = {"terminated": state}
        pod["status"]["containerStatuses"][0]["ready"] = False
        pod["status"]["phase"] = "Succeeded" if exit_code == 0 else "Failed"
        self.put("Pod", pod)
        with self.cond:
            self.log_closed.add(pod_name)
            self.cond.notify_all()

    def evict(self, pod_name: str) -> None:
        """What the eviction API and the kubelet do: DisruptionTarget, then SIGTERM (the trainer exits 76)."""
        pod = copy.deepcopy(self.pod(pod_name))
        pod["status"]["conditions"].append(
            {
                "type": "DisruptionTarget",
                "status": "True",
                "reason": "EvictionByEvictionAPI",
                "message": "Eviction API: evicting",
                "lastTransitionTime": now(),
            }
        )
        self.put("Pod", pod)
        self.terminate(pod_name, 76)

    def set_pod_status(self, pod_name: str, **status) -> None:
        pod = copy.deepcopy(self.pod(pod_name))
        pod["status"].update(status)
        self.put("Pod", pod)

    def set_waiting(self, pod_name: str, reason: str, message: str) -> None:
        pod = copy.deepcopy(self.pod(pod_name))
        pod["status"]["containerStatuses"][0]["state"] = {"waiting": {"reason": reason, "message": message}}
        self.put("Pod", pod)

    def event(self, pod_name: str, reason: str, message: str, kind: str = "Warning") -> None:
        pod = self.pod(pod_name)
        self.put(
            "Event",
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"name": f"{pod_name}.{uuid.uuid4().hex[:12]}", "namespace": pod["metadata"]["namespace"]},
                "involvedObject": {
                    "kind": "Pod",
                    "name": pod_name,
                    "namespace": pod["metadata"]["namespace"],
                    "uid": pod["metadata"]["uid"],
                },
                "reason": reason,
                "message": message,
                "type": kind,
                "count": 1,
                "firstTimestamp": now(),
                "lastTimestamp": now(),
                "source": {"component": "default-scheduler"},
            },
            pod["metadata"]["namespace"],
        )

    def set_status(self, kind: str, name: str, **status) -> None:
        obj = copy.deepcopy(self.get(kind, name))
        obj.setdefault("status", {}).update(status)
        self.put(kind, obj)

    def set_condition(self, kind: str, name: str, ctype: str, reason: str = "", message: str = "", **status) -> None:
        obj = copy.deepcopy(self.get(kind, name))
        st = obj.setdefault("status", {})
        st.setdefault("conditions", []).append(
            {"type": ctype, "status": "True", "reason": reason, "message": message, "lastTransitionTime": now()}
        )
        st.update(status)
        self.put(kind, obj)


class _Handler(BaseHTTPRequestHandler):
    cluster: FakeCluster
    protocol_version = "HTTP/1.0"  # a streamed body ends when the connection closes, as a watch does

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def setup(self) -> None:
        super().setup()
        with self.server.open_lock:
            self.server.open.add(self.connection)

    def finish(self) -> None:
        with self.server.open_lock:
            self.server.open.discard(self.connection)
        try:
            super().finish()
        except OSError:  # the connection was cut under it (a reset, a restart)
            pass

    def _faulted(self) -> bool:
        """A fault the test switched on answers this request instead (True: nothing more to send)."""
        c = self.cluster
        with c.cond:
            c.requests += 1
        if c.faults.delay_s:
            time.sleep(c.faults.delay_s)
        if c.faults.take("errors"):
            self._send(500, _status(500, "InternalError", "Internal error occurred: etcdserver: request timed out"))
            return True
        return False

    def _route(self):
        url = urlparse(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        for pattern, kind, api_version in _PATHS:
            m = pattern.match(url.path)
            if m:
                return kind, api_version, m[1], m[2], query
        return None, None, None, None, query

    def do_GET(self) -> None:
        if self._faulted():
            return
        url = urlparse(self.path)
        m = _LOG_PATH.match(url.path)
        if m:
            return self._log(m[1], m[2], {k: v[-1] for k, v in parse_qs(url.query).items()})
        kind, api_version, ns, name, query = self._route()
        if kind is None:
            return self._send(
                404, _status(404, "NotFound", f"the server could not find the requested resource ({url.path})")
            )
        c = self.cluster
        if name:
            obj = c.get(kind, name, ns)
            if obj is None:
                return self._send(404, _status(404, "NotFound", f'{kind.lower()}s "{name}" not found'))
            return self._send(200, obj)
        labels, fields = query.get("labelSelector", ""), query.get("fieldSelector", "")
        if query.get("watch") in ("true", "True", "1"):
            since = int(query["resourceVersion"]) if query.get("resourceVersion") else None
            return self._watch(kind, ns, labels, fields, float(query.get("timeoutSeconds", "5")), since)
        items = [o for o in c.items(kind, labels, fields) if o["metadata"]["namespace"] == ns]
        if kind in (
            "Job",
            "Pod",
            "Service",
            "ConfigMap",
            "Event",
            "NetworkPolicy",
        ):  # the API omits kind on list items of built-ins
            items = [{k: v for k, v in o.items() if k not in ("kind", "apiVersion")} for o in items]
        self._send(
            200,
            {
                "apiVersion": api_version,
                "kind": f"{kind}List",
                "metadata": {"resourceVersion": str(c.version)},
                "items": items,
            },
        )

    def _watch(self, kind: str, ns: str, labels: str, fields: str, timeout: float, since: int | None) -> None:
        """Without a resourceVersion: the current state as ADDED, then changes; with one, the changes after it,
        or (compacted away) one ERROR event holding a 410 Status, as the real server streams it."""
        c = self.cluster
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "identity")
        self.end_headers()
        deadline = time.monotonic() + timeout
        with c.cond:
            if since is not None and since < c.compacted:
                c.expired += 1
                gone = _status(410, "Expired", f"too old resource version: {since} ({c.compacted})")
                self.wfile.write(json.dumps({"type": "ERROR", "object": gone}).encode() + b"\n")
                return
            if since is None:
                start = len(c.history)
                initial = [copy.deepcopy(o) for o in c.items(kind, labels, fields) if o["metadata"]["namespace"] == ns]
            else:
                start = next((i for i, h in enumerate(c.history) if h[0] > since), len(c.history))
                initial = []
        try:
            for obj in initial:
                self.wfile.write(json.dumps({"type": "ADDED", "object": obj}).encode() + b"\n")
            self.wfile.flush()
            if c.faults.take("reset_watches"):  # the connection drops mid-watch: RST, no clean end
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.connection.close()
                return
            pos = start
            while True:
                with c.cond:
                    while pos >= len(c.history):
                        left = deadline - time.monotonic()
                        if left <= 0:
                            return
                        c.cond.wait(left)
                    batch = c.history[pos:]
                    pos = len(c.history)
                for _, event, k, obj in batch:
                    if k == kind and obj["metadata"]["namespace"] == ns and _matches(obj, labels, fields):
                        self.wfile.write(json.dumps({"type": event, "object": obj}).encode() + b"\n")
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            return

    def _log(self, ns: str, name: str, query: dict) -> None:
        c = self.cluster
        if c.get("Pod", name, ns) is None and name not in c.logs:
            return self._send(404, _status(404, "NotFound", f'pods "{name}" not found'))
        if query.get("follow") not in ("true", "True", "1"):
            data = bytes(c.logs.get(name, b""))
            if "tailLines" in query:
                data = b"".join(data.splitlines(keepends=True)[-int(query["tailLines"]) :])
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        time.sleep(c.faults.follow_delay_s)
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        pos = 0
        try:
            while True:
                with c.cond:
                    while pos >= len(c.logs.get(name, b"")) and name not in c.log_closed:
                        c.cond.wait(1.0)
                    data = bytes(c.logs.get(name, b"")[pos:])
                    closed = name in c.log_closed
                pos += len(data)
                if data:
                    self.wfile.write(data)
                    self.wfile.flush()
                if closed and pos >= len(c.logs.get(name, b"")):
                    return
        except (BrokenPipeError, ConnectionResetError):
            return

    def do_POST(self) -> None:
        if self._faulted():
            return
        kind, api_version, ns, name, _ = self._route()
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        c = self.cluster
        if kind in c.refuse:
            code, reason, message = c.refuse[kind]
            return self._send(code, _status(code, reason, message))
        obj_name = body.get("metadata", {}).get("name")
        if not obj_name:
            return self._send(422, _status(422, "Invalid", f"{kind} is invalid: metadata.name: Required value"))
        if c.get(kind, obj_name, ns) is not None:
            return self._send(409, _status(409, "AlreadyExists", f'{kind.lower()}s "{obj_name}" already exists'))
        body.setdefault("apiVersion", api_version)
        body.setdefault("kind", kind)
        obj = c.put(kind, body, ns)
        with c.cond:
            c.creates.append((kind, obj_name))
            c.cond.notify_all()
        self._send(201, obj)

    def do_PATCH(self) -> None:
        """A merge patch of an object's metadata: a Node's labels and annotations (`patch_node`), or the
        ownerReferences of the objects beside a group (`patch`)."""
        if self._faulted():
            return
        c = self.cluster
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        m = _NODE_PATH.match(urlparse(self.path).path)
        if m is None:
            kind, _, ns, name, _ = self._route()
            obj = c.get(kind, name, ns) if kind in ("ConfigMap", "Service", "NetworkPolicy") and name else None
            if obj is None:
                return self._send(404, _status(404, "NotFound", f'{(kind or "object").lower()}s "{name}" not found'))
            obj = copy.deepcopy(obj)
            obj["metadata"].update({k: v for k, v in (body.get("metadata") or {}).items() if k == "ownerReferences"})
            return self._send(200, c.put(kind, obj, ns))
        if "Node" in c.refuse:
            code, reason, message = c.refuse["Node"]
            return self._send(code, _status(code, reason, message))
        node = c.get("Node", m[1], "")
        if node is None:
            return self._send(404, _status(404, "NotFound", f'nodes "{m[1]}" not found'))
        node = copy.deepcopy(node)
        for key in ("labels", "annotations"):
            merged = {**(node["metadata"].get(key) or {}), **(body.get("metadata", {}).get(key) or {})}
            node["metadata"][key] = {k: v for k, v in merged.items() if v is not None}
        self._send(200, c.put("Node", node, ""))

    def do_DELETE(self) -> None:
        if self._faulted():
            return
        kind, _, ns, name, query = self._route()
        length = int(self.headers.get("Content-Length", 0) or 0)
        body = json.loads(self.rfile.read(length) or b"{}") if length else {}
        policy = query.get("propagationPolicy") or body.get("propagationPolicy") or "Background"
        obj = self.cluster.delete(kind, name, ns, policy) if kind else None
        if obj is None:
            return self._send(404, _status(404, "NotFound", f'{(kind or "object").lower()}s "{name}" not found'))
        self._send(200, obj)


class FakeApiServer:
    """The server on 127.0.0.1, and a kubeconfig that points the official client at it."""

    def __init__(self, cluster: FakeCluster | None = None):
        self.cluster = cluster or FakeCluster()
        self._handler = type("Handler", (_Handler,), {"cluster": self.cluster})
        self._serve(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def _serve(self, address: tuple[str, int]) -> None:
        self.httpd = ThreadingHTTPServer(address, self._handler, bind_and_activate=False)
        self.httpd.allow_reuse_address = True
        self.httpd.daemon_threads = True
        self.httpd.handle_error = lambda request, client_address: None  # a reset connection is the test's doing
        self.httpd.open, self.httpd.open_lock = set(), threading.Lock()  # connections being served
        self.httpd.server_bind()
        self.httpd.server_activate()
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> FakeApiServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def restart(self, down_s: float) -> None:
        """The API server goes away for `down_s` (connections refused, open watches and log streams cut), then
        comes back on the same address with every object and resourceVersion it had, as etcd keeps them."""
        address = self.httpd.server_address
        self.httpd.shutdown()
        self.httpd.server_close()
        with self.httpd.open_lock:  # open watches and followed logs are cut, as a dying server cuts them
            for conn in self.httpd.open:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        time.sleep(down_s)
        self._serve(address)
        self._thread.start()

    def kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "fake",
                    "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                    "contexts": [
                        {"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": namespace}}
                    ],
                    "users": [{"name": "fake", "user": {"token": "not-a-secret"}}],
                }
            )
        )
        return path
