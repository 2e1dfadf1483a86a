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

import datetime
import errno
import os
import socket

from trainers.contract import STORE_BIND_ENV
from trainers.exit_codes import FatalError, RetryableError


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
