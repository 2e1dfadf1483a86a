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
    """Whether the object is gone before `deadline` (monotonic) and before `stop` is set."""
    while kube.get(kind, name) is not None:
        if time.monotonic() >= deadline or (stop is not None and stop.is_set()):
            return False
        time.sleep(0.5)
    return True


def delete_launch(kube: Kube, objects: list[dict], wait_s: float, report: Callable[[str], None]) -> None:
    """Delete every object of a launch and wait up to `wait_s` until they are gone; a refused delete is
    reported, not raised, so the rest still go."""
    for obj in reversed(objects):  # the group first, so nothing recreates pods while the rest goes
        try:
            kube.delete(obj["kind"], obj["metadata"]["name"])
        except KubeError as exc:
            report(f"could not delete {obj['kind']} {obj['metadata']['name']}: {exc}")
    deadline = time.monotonic() + wait_s
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
