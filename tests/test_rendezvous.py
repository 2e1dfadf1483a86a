"""The launch's rendezvous store listens only where the launcher said, and what it carries is never unpickled."""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from tests.conftest import ROOT, free_port

# One rank of a two-rank gloo group made by trainers.rendezvous; rank 0 reports where its store listens.
RANK = textwrap.dedent(
    """
    import json, os, sys
    import psutil, torch, torch.distributed as dist
    from trainers.rendezvous import init_process_group

    init_process_group("gloo", 60)
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)  # the group works: 1 + 2
    if dist.get_rank() == 0:
        port = int(os.environ["MASTER_PORT"])
        listening = sorted(
            c.laddr.ip for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port
        )
        print(json.dumps({"sum": t.item(), "listening": listening}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    """
)


def _other_address() -> str | None:
    """An address of this host other than loopback, from which a peer elsewhere would connect."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


def _group(master_addr: str, extra_env: dict[str, str] | None = None) -> tuple[dict, int]:
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": master_addr, "MASTER_PORT": str(port), "WORLD_SIZE": "2", **(extra_env or {})}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK],
            env={**env, "RANK": str(r)},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=120) for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], outs
    return json.loads(outs[0][0].strip().splitlines()[-1]), port


def test_the_store_listens_on_the_launchers_address_only():
    report, _ = _group("127.0.0.1")
    assert report["sum"] == 3.0
    # torch's own store would listen on every interface (0.0.0.0 / ::)
    assert report["listening"] == ["127.0.0.1"]


def test_the_store_binds_where_tessera_store_bind_says():
    """On Kubernetes the pod's IP (the downward API): the peers reach it there, and nothing else does."""
    other = _other_address()
    if other is None:
        pytest.skip("this host has no address other than loopback")
    report, _ = _group(other, {"TESSERA_STORE_BIND": other})
    assert report["listening"] == [other]


def test_an_address_not_of_this_host_is_one_fatal_line():
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "2"}
    env["TESSERA_STORE_BIND"] = "192.0.2.254"  # TEST-NET-1: on no host's interfaces here
    code = (
        "from trainers.rendezvous import init_process_group\n"
        "from trainers.exit_codes import FatalError\n"
        "try:\n    init_process_group('gloo', 5)\n"
        "except FatalError as exc:\n    print(exc)\n"
    )
    if "192.0.2.254" in {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}:
        pytest.skip("192.0.2.254 is an address of this host")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == (
        "rendezvous store: 192.0.2.254 (192.0.2.254) is not an address of this host, so rank 0 cannot listen there; "
        "set TESSERA_STORE_BIND to this host's address that the other ranks reach"
    )


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_pickle_planted_in_the_store_is_never_unpickled(tmp_path):
    """A peer that reaches the store and writes the start plan's key gets a failed read, not code run."""
    import torch.distributed as dist

    from trainers.rendezvous import post as _post
    from trainers.rendezvous import read as _read

    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(_Payload(marker)))  # the payload does what it says when unpickled
    assert marker.exists()
    marker.unlink()

    store = dist.HashStore()
    store.set("tessera/plan", pickle.dumps(({"plan": _Payload(marker)}, None)))
    with pytest.raises(ValueError):  # not JSON: refused
        _read(store, "tessera/plan")
    assert not marker.exists()
    # the plan itself goes through as JSON
    _post(store, "tessera/plan2", {"plan": {"kind": "fresh", "tokens": 0}, "skip": 0}, None)
    assert json.loads(store.get("tessera/plan2")) == {
        "answer": {"plan": {"kind": "fresh", "tokens": 0}, "skip": 0},
        "failure": None,
    }
    assert _read(store, "tessera/plan2") == {"plan": {"kind": "fresh", "tokens": 0}, "skip": 0}
