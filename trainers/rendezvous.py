"""The launch's process group, with its rendezvous store listening only where the launcher said.

Every rank of a launch joins torch.distributed through a TCPStore that global rank 0 hosts on
MASTER_PORT. Created by `init_process_group` from the environment, that store listens on every
interface of rank 0's host, and anyone who can reach the port can read and write its keys, the
start plan among them. Here rank 0 binds the listening socket itself, to the address the launcher
gave every rank (MASTER_ADDR: 127.0.0.1 for a one-node launch) or, on Kubernetes, to the pod's own
IP (TESSERA_STORE_BIND, from the downward API; the JobSet's NetworkPolicy admits only the group's
pods), and hands it to the store.

torch's libuv store cannot take a socket it did not open, so rank 0 hosts the store with torch's
other (poll-based) server: it serves the handful of keys a launch of up to some hundreds of ranks
sets, which is all tessera's launches ask of it.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

from trainers.contract import STORE_BIND_ENV
from trainers.data_check import DamagedData, announce
from trainers.exit_codes import ExitCode, FatalError, RetryableError, decide_exit

T = TypeVar("T")


def bind_address() -> str:
    """Where rank 0's store listens: TESSERA_STORE_BIND if set, else MASTER_ADDR."""
    return os.environ.get(STORE_BIND_ENV) or os.environ.get("MASTER_ADDR", "127.0.0.1")


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port) only; the errors a relaunch cannot fix are fatal, in one line."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise RetryableError(f"rendezvous store: cannot resolve {host!r} to bind to ({exc})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a relaunch's port may still be in TIME_WAIT
    try:
        sock.bind(address)
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRNOTAVAIL:
            raise FatalError(
                f"rendezvous store: {host} ({address[0]}) is not an address of this host, so rank 0 cannot listen "
                f"there; set {STORE_BIND_ENV} to this host's address that the other ranks reach"
            ) from None
        raise RetryableError(f"rendezvous store: cannot listen on {address[0]}:{port} ({exc.strerror})") from None
    return sock


def init_process_group(backend: str, timeout_s: float) -> None:
    """torch.distributed's default group for this launch (RANK, WORLD_SIZE, MASTER_ADDR/PORT from the launcher)."""
    import torch.distributed as dist

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        listening = _listen(bind_address(), port)
        # detach(): the store owns the descriptor from now on; Python closing it at exit under the store's
        # serving thread would abort the process.
        store = dist.TCPStore(
            host,
            port,
            world_size,
            is_master=True,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=listening.detach(),
            use_libuv=False,
        )
    else:
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


# The launch's store beyond the process group: the waits of setting up a launch (the start plan, a node's
# download), whose answers every rank reads as JSON.


def world() -> tuple[int, int]:
    """(global rank, world size) from the launcher's environment, before torch.distributed is up."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


@contextlib.contextmanager
def setup_store():
    """The launch's rendezvous store, for the waits of setting up a launch.

    Before training, rank 0 may download the checkpoint to resume from (about 80 GB at 7B on a fresh
    node), and so may the first rank of every other node. None of that may sit inside a collective:
    a collective gives up after the process group's timeout (TESSERA_DIST_TIMEOUT, 300 s), which is
    sized to notice a lost peer during training. A wait on the store has its own timeout, long
    while setting up and restored afterwards.
    """
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    before = store.timeout
    store.set_timeout(timedelta(seconds=float(os.environ.get("TESSERA_SETUP_TIMEOUT", "21600"))))
    try:
        yield store
    finally:
        store.set_timeout(before)


def post(store, key: str, answer, error: BaseException | None) -> None:
    """Post an answer (JSON: the store is a network service, and what it hands out is never unpickled), or a
    failure every rank re-raises (anything unexpected as retryable)."""
    failure = None
    if error is not None:  # [fatal, message, what a DamagedData names]
        failure = [isinstance(error, FatalError), str(error) or type(error).__name__, getattr(error, "record", None)]
    store.set(key, json.dumps({"answer": answer, "failure": failure}))


def read(store, key: str):
    """The answer posted under `key`; a FatalError or RetryableError posted there is raised here too, so
    no rank is left waiting for one that has already given up.

    Every rank says it has read the answer; global rank 0 hosts the store, so on a failure it leaves
    only once all have, or the others would find the store gone instead of the reason.
    """
    store.wait([key])
    posted = json.loads(store.get(key))
    answer, failure = posted["answer"], posted["failure"]
    store.add(f"{key}/read", 1)
    if failure is not None:
        fatal, message = failure[:2]
        # Decided now, not when the error reaches main(): a peer that read it first may already be
        # gone, and the launcher's SIGTERM for the survivors must not turn this into INTERRUPTED.
        decide_exit(ExitCode.FATAL if fatal else ExitCode.RETRYABLE)
        rank, world_size = world()
        deadline = time.monotonic() + 60
        while rank == 0 and store.add(f"{key}/read", 0) < world_size and time.monotonic() < deadline:
            time.sleep(0.05)
        if len(failure) > 2 and failure[2]:
            damage = DamagedData(failure[2])
            announce(damage)  # now: a peer that leaves first has the launcher SIGTERM this rank before it returns
            raise damage
        raise (FatalError if fatal else RetryableError)(message)
    return answer


def rank0_decides(decide: Callable[[], T]) -> T:
    """`decide()` run on global rank 0, its answer on every rank, through the launch's store (no rank
    reads another node's disk, and a slow decision outlasts no collective's timeout)."""
    rank, world_size = world()
    if world_size == 1:
        return decide()
    with setup_store() as store:
        if rank == 0:
            run_and_post(store, "tessera/plan", decide)
        return read(store, "tessera/plan")


def run_and_post(store, key: str, work: Callable[[], object]) -> None:
    try:
        post(store, key, work(), None)
    except Exception as exc:
        post(store, key, None, exc)
        if not isinstance(exc, (FatalError, RetryableError)):  # those are raised again by read, on every rank
            raise
