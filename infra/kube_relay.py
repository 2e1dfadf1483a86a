"""A Kubernetes launch's local log file: pod 0's output relayed as it comes, between the launcher's
own lines, and at the end the failing pod's last lines and the line that explains the end.

The training task reads a Kubernetes job's log exactly as a local one's (infra/joblog.py), so the
pods' output has to land in a file on the flow's side. Pod 0 is the one followed: its ranks print
the progress lines, and a group restart replaces it with a new pod whose output follows the old.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from infra.kube_api import Kube, KubeError
from infra.kube_names import COMPLETION_INDEX_ANNOTATION, Workload, selector_string

PREFIX = "tessera.k8s:"  # the launcher's own lines in the job log


class LogRelay:
    """Writes one launch's log: `line` for the launcher, `run` (a thread) for pod 0's output, `close`
    for the last line, after which nothing more is written."""

    END_ROUNDS = 5  # lists tried after the end when the API does not answer

    def __init__(
        self,
        kube: Kube,
        work: Workload,
        container: str,
        path: Path,
        *,
        ended: threading.Event,
        stop: threading.Event,
    ):
        self.kube, self.work, self.container, self.path = kube, work, container, path
        self.pod0_name: str | None = None  # the pod 0 whose output is being (or was last) relayed
        self._ended, self._stop = ended, stop  # the group has ended / the launcher is being cancelled
        self._lock = threading.Lock()  # the relay thread and the watcher both append to the file
        self._closed = False
        self.ask_again = True  # False once the launch ended because the API was lost: asking again cannot help
        self._streaming_since: float | None = None  # monotonic time of the open stream's last bytes (or its start)

    def line(self, text: str) -> None:
        with self._lock:
            if not self._closed:
                self._write(f"{PREFIX} {text}\n".encode())

    def close(self, message: str) -> None:
        """The line that explains the end, written last: the relay stops at it, even mid-stream."""
        with self._lock:
            self._closed = True
            self._write(f"{PREFIX} {message}\n".encode())

    def last_lines_of(self, pod: str, lines: int = 200) -> None:
        """The last lines of a pod that failed, unless it is pod 0 (whose output is already here)."""
        if pod == self.pod0_name:
            return
        try:
            text = self.kube.log_tail(pod, self.container, lines)
        except KubeError:
            return
        self.line(f"last lines of pod {pod}:")
        with self._lock:
            self._write(text.encode() + (b"" if text.endswith("\n") else b"\n"))

    def caught_up(self, quiet_s: float) -> bool:
        """The relay is following a live pod's stream that has brought nothing for `quiet_s`: everything the pod
        has written is in the file, and waiting for the stream's end would wait for the pod's."""
        since = self._streaming_since
        return since is not None and time.monotonic() - since >= quiet_s

    def _write(self, data: bytes) -> None:
        with open(self.path, "ab") as f:
            f.write(data)

    def _pod0(self) -> dict | None:
        pods = [
            p
            for p in self.kube.list("Pod", selector_string(self.work.selector(with_attempt=True)))
            if (p["metadata"].get("annotations") or {}).get(COMPLETION_INDEX_ANNOTATION, "0") == "0"
        ]
        started = [p for p in pods if (p.get("status") or {}).get("phase") in ("Running", "Succeeded", "Failed")]
        return max(started, key=lambda p: p["metadata"].get("creationTimestamp", ""), default=None)

    def _pod(self, name: str) -> dict | None:
        pods = self.kube.list("Pod", field_selector=f"metadata.name={name}")
        return pods[0] if pods else None

    def run(self) -> None:
        """Follow each pod 0 in turn until the group has ended and the last one's output is in the file."""
        written: dict[str, int] = {}  # pod uid -> bytes of its log already in the file
        done: set[str] = set()
        unanswered = 0  # rounds in a row whose pod list the API did not answer
        while True:
            ended = self._ended.is_set()  # read first: one more round after the end picks up the last output
            try:
                pod = self._pod0()
                unanswered = 0
            except KubeError:
                pod, unanswered = None, unanswered + 1
                # After the end, one unanswered list (a busy API server, a loaded node) must not leave pod 0's last
                # output out of the log: ask again a few times (the end waits for this within relay_drain_s).
                if ended and self.ask_again and unanswered < self.END_ROUNDS and not self._stop.wait(1.0):
                    continue
            uid = pod["metadata"].get("uid", pod["metadata"]["name"]) if pod else None
            if pod is not None and uid not in done:
                name = pod["metadata"]["name"]
                if uid not in written:
                    written[uid] = 0
                    self.pod0_name = name
                    self.line(f"output of pod {name}:")
                skip = written[uid]
                try:
                    for chunk in self.kube.follow_log(name, self.container):
                        # from the server's first answer on (b""), not from the asking: a stream still being opened
                        # on a loaded node is not "quiet", and its pod's output is still to come
                        self._streaming_since = time.monotonic()
                        if skip:
                            dropped = min(skip, len(chunk))
                            chunk, skip = chunk[dropped:], skip - dropped
                        if chunk:
                            with self._lock:
                                if self._closed:
                                    return
                                self._write(chunk)
                            written[uid] += len(chunk)
                except (KubeError, OSError, ValueError):
                    pass  # the pod went away under the stream, or the API did; the next round sees which
                finally:
                    self._streaming_since = None
                try:
                    phase = ((self._pod(name) or {}).get("status") or {}).get("phase")
                except KubeError:  # the API is away: the pod may be running still; follow it again later
                    if self._stop.wait(1.0):
                        return
                    continue
                if phase in (None, "Succeeded", "Failed"):
                    done.add(uid)
                elif self._stop.wait(0.5):  # the stream ended early (a read timeout, a reset): not a busy loop
                    return
                continue
            if ended or self._stop.is_set():
                return
            time.sleep(0.5)
