"""Removing what a Kubernetes launch created, and knowing it is gone: on cancel, before an indexed job
is recreated, and for ended groups an earlier process left behind.

Every delete is foreground (infra/kube_api.py), so a group's object disappears only after its pods;
waiting for the object is therefore waiting for the pods. A new group must never start while an old
rank can still join its rendezvous, and a cancelled flow must not leave a trainer behind.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from infra.kube_api import Kube, KubeError


def _wait_gone(kube: Kube, kind: str, name: str, deadline: float, stop: threading.Event | None = None) -> bool:
    """Whether the object is gone before `deadline` (monotonic) and before `stop` is set. An API that does not
    answer meanwhile is asked again: a blip during cleanup must not fail a stage that has ended."""
    while True:
        try:
            if kube.get(kind, name) is None:
                return True
        except KubeError as exc:
            if not exc.transient:
                raise
        if time.monotonic() >= deadline or (stop is not None and stop.is_set()):
            return False
        time.sleep(0.5)


def delete_launch(kube: Kube, objects: list[dict], wait_s: float, report: Callable[[str], None]) -> None:
    """Delete every object of a launch and wait up to `wait_s` until they are gone; a refused delete is
    reported, not raised, so the rest still go."""
    deadline = time.monotonic() + wait_s
    for obj in reversed(objects):  # the group first, so nothing recreates pods while the rest goes
        while True:
            try:
                kube.delete(obj["kind"], obj["metadata"]["name"])
                break
            except KubeError as exc:
                if exc.transient and time.monotonic() < deadline:  # a blip: ask again, within the wait
                    time.sleep(0.5)
                    continue
                report(f"could not delete {obj['kind']} {obj['metadata']['name']}: {exc}")
                break
    for obj in objects:
        _wait_gone(kube, obj["kind"], obj["metadata"]["name"], deadline)


def delete_for_recreate(kube: Kube, kind: str, name: str, wait_s: float, stop: threading.Event) -> None:
    """What BlockingRecreate does for a JobSet: every old pod is gone before the new group starts.
    Raises KubeError when the group outlives `wait_s`, or when the launch is being stopped meanwhile."""
    kube.delete(kind, name)
    if not _wait_gone(kube, kind, name, time.monotonic() + wait_s, stop):
        raise KubeError(0, "", f"{kind} {name} was not deleted within {wait_s:.0f}s")


def delete_ended_group(kube: Kube, kind: str, name: str, wait_s: float) -> None:
    """Delete an ended group and the objects created beside it (same name), waiting until it is gone."""
    for each in (kind, "Service", "ConfigMap", "NetworkPolicy"):
        kube.delete(each, name)
    _wait_gone(kube, kind, name, time.monotonic() + wait_s)
