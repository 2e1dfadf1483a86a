"""Start a launch's ranks on one node with torch's elastic agent: `python -m infra.launcher [options] -m MODULE ARGS`.

One launcher per node (a local job, a pod). It is torch's own (torch.distributed.launcher.api's agent and c10d
rendezvous), with what tessera adds around it:

- Warm ranks (infra/warm.py): the ranks fork from a forkserver that imported `--warm` modules once, instead of
  each rank importing the trainer's dependency chain again; `--cold` starts fresh interpreters (spawn).
- Restarts in place: a rank that crashes, or that the watchdog finds hung, restarts the node's ranks from the last
  complete checkpoint, in the same launcher (and pod), up to `--max-restarts` times; the agent's rendezvous makes
  every node restart together. A fatal exit (78) never restarts, nor a rank stopped from outside (76). Each
  restart is a `tessera.launcher.record` line.
- The watchdog (infra/watchdog.py) judges this node's heartbeats in the agent's monitor loop when the launch's
  environment carries budgets (TESSERA_WATCHDOG); on a hang it writes every rank's stacks to the log and kills the
  ranks, which is a restart while the budget lasts; when it is spent the launcher exits HUNG (79).
- The exit code is that of the rank that failed first (a peer's answer to the agent's SIGTERM says nothing), as a
  shell reports it (128+N for signal N); SIGTERM and SIGINT stop the ranks (they exit 76) and the launcher exits 76.
- The last line is a `tessera.launcher.record` of kind "end" (infra/launch_outcome.py reads them), and in a pod
  the termination message says how it ended.

Rank 0's output goes where the launcher's does (the job log); other ranks' to `rank<N>.stdout.log` and
`rank<N>.stderr.log` in `--log-dir` (`.restart<K>` before `.stdout` for the K-th restart's).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import multiprocessing
import os
import signal
import socket
import sys
import time
from pathlib import Path

from infra.launch_outcome import RECORD_PREFIX, Restart
from infra.watchdog import Budgets, Hang, Watchdog, fresh_folder, report_then_kill
from trainers.contract import (
    FATAL,
    HEARTBEAT_DIR_ENV,
    HUNG,
    INTERRUPTED,
    RETRYABLE,
    TERMINATION_LOG,
    TERMINATION_LOG_ENV,
    WATCHDOG_ENV,
)

VERDICT_ENV = "TESSERA_WARM_VERDICT"  # where the warm process writes its verdict (infra/warm_seal.py)
# The pod's own scratch for heartbeats when the environment names none: they live only as long as the launch.
HEARTBEAT_DIR = "/tmp/tessera-heartbeats"
MONITOR_S = 0.5  # how often the agent looks at its ranks: a crash is seen, and the group restarted, this soon


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m infra.launcher")
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--rdzv-endpoint", default="127.0.0.1:0", help="HOST:PORT of node 0's rendezvous store")
    p.add_argument("--local-addr", default=None, help="this node's address that the others reach (rank 0's store)")
    p.add_argument("--run-id", default="tessera")
    p.add_argument("--max-restarts", type=int, default=0)
    p.add_argument("--log-dir", default=".")
    p.add_argument("--warm", default="", help="comma-separated modules the ranks' forkserver imports once")
    p.add_argument("--cold", action="store_true", help="start each rank as a fresh interpreter")
    p.add_argument("-m", dest="module", required=True, help="the ranks' module; every argument after it is its own")
    # Everything after `-m MODULE` is the module's, options included (argparse would claim those it knows).
    split = argv.index("-m") + 2 if "-m" in argv[:-1] else len(argv)
    ns = p.parse_args(argv[:split])
    ns.args = argv[split:]
    return ns


def _say(text: str) -> None:
    _say_raw(text + "\n")


def _say_raw(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _record(kind: str, **fields) -> None:
    _say(RECORD_PREFIX + json.dumps({"kind": kind, "at": round(time.time(), 3), **fields}, sort_keys=True))


def _terminate(text: str) -> None:
    """The pod's termination message: what the flow reads from the pod's status (none outside a container)."""
    try:
        with open(os.environ.get(TERMINATION_LOG_ENV, TERMINATION_LOG), "w") as f:
            f.write(text[:4000])  # the kubelet keeps at most 4096 bytes
    except OSError:
        pass


def _logs_specs(log_dir: Path):
    from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

    class RankFiles(LogsSpecs):
        """Local rank 0 writes where the launcher does; the others to files of their own, one per attempt."""

        def __init__(self) -> None:
            super().__init__(log_dir=str(log_dir))

        @property
        def root_log_dir(self) -> str:
            return str(log_dir)

        def reify(self, envs):
            dest = LogsDest()
            for local_rank, env in envs.items():
                if local_rank == 0:
                    dest.stdouts[0] = dest.stderrs[0] = ""
                    continue
                attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
                name = f"rank{env['RANK']}" + (f".restart{attempt}" if attempt else "")
                dest.stdouts[local_rank] = str(log_dir / f"{name}.stdout.log")
                dest.stderrs[local_rank] = str(log_dir / f"{name}.stderr.log")
                dest.error_files[local_rank] = str(log_dir / f"{name}.error.json")
            dest.error_files.setdefault(0, str(log_dir / "rank0.error.json"))
            return dest

    return RankFiles()


def _agent_class():
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class Agent(LocalElasticAgent):
        """torch's agent, with the watchdog in its monitor loop, fatal exits that never restart, and a record of
        each restart's cause."""

        def __init__(
            self,
            *args,
            verdict: Path | None,
            node_rank: int,
            local_addr: str | None,
            watchdog: Watchdog | None,
            beats: Path | None,
            **kwargs,
        ):
            super().__init__(*args, **kwargs)
            self.verdict = verdict
            self.node_rank, self.local_addr = node_rank, local_addr
            self.watchdog, self.beats = watchdog, beats
            self.hang: Hang | None = None  # what the watchdog found in the attempt now ending
            self.restarts: list[Restart] = []
            self.last_failure: tuple[int, int] | None = None  # (global rank, exit code) that failed first

        def _rendezvous(self, worker_group) -> None:
            """torch's rendezvous, with two things fixed by the node's own rank (a pod's completion index) instead of
            the order torch's rendezvous sorts nodes in: the ranks on this node (node k holds ranks k*G...), which
            the checkpoints on each node's disk and the node's heartbeats follow; and where rank 0's training store
            listens (node 0's address, a port free there), so rank 0 and the address every rank is given agree."""
            from torch.distributed.elastic.utils.distributed import get_free_port

            spec = worker_group.spec
            info = spec.rdzv_handler.next_rendezvous()
            store = info.store  # this rendezvous round's own
            if self.node_rank == 0:
                store.set("tessera/master", f"{self.local_addr or socket.getfqdn()} {get_free_port()}")
            addr, port = store.get("tessera/master").decode().split()
            self._store = store
            worker_group.workers = self._assign_worker_ranks(store, self.node_rank, info.world_size, spec)
            worker_group.store = store
            worker_group.group_rank, worker_group.group_world_size = self.node_rank, info.world_size
            worker_group.master_addr, worker_group.master_port = addr, int(port)
            if self.watchdog is not None:
                self.watchdog.ranks = [w.global_rank for w in worker_group.workers]

        def _start_workers(self, worker_group):
            if self.verdict is not None:  # the first start: the ranks fork warm only from a server that kept the rules
                problem, self.verdict = _read_verdict(self.verdict), None
                if problem:
                    from infra.warm import run_cold

                    _say(f"tessera.launcher: {problem}; ranks start as fresh interpreters")
                    self._start_method, worker_group.spec.entrypoint = "spawn", run_cold
            if self.watchdog is not None and self.beats is not None:
                fresh_folder(self.beats)
                self.watchdog.started, self.watchdog._last = time.time(), {}
            self.hang = None
            return super()._start_workers(worker_group)

        def _monitor_workers(self, worker_group) -> RunResult:
            result = super()._monitor_workers(worker_group)
            if result.state == WorkerState.HEALTHY and self.watchdog is not None and self.hang is None:
                hang = self.watchdog.check()
                if hang is not None:
                    self._kill_hung(hang, [w.id for w in worker_group.workers])
            if result.state == WorkerState.FAILED and result.failures:
                self.last_failure = _cause(self._exit_codes(worker_group)) or next(
                    (rank, f.exitcode) for rank, f in result.failures.items()
                )
                # 78: the input is wrong, a restart reproduces it. 76: stopped from outside (a SIGTERM, the flow
                # that launched it gone, a node that failed its preflight): where it runs next is the flow's or the
                # cluster's to decide, not this node's.
                if self.last_failure[1] in (FATAL, INTERRUPTED):
                    self._remaining_restarts = 0
            return result

        def _exit_codes(self, worker_group) -> dict[int, int]:
            """Each ended rank's exit code, by global rank. torch reports the first failed rank its poll happened to
            look at; a rank killed -9 and its peer's answer (75, a lost peer) often both ended by then."""
            processes = getattr(getattr(self._pcontext, "_pc", None), "processes", [])  # torch's ProcessContext
            ranks = {w.local_rank: w.global_rank for w in worker_group.workers}
            return {ranks[i]: p.exitcode for i, p in enumerate(processes) if p.exitcode not in (None, 0)}

        def _kill_hung(self, hang: Hang, pids: list[int]) -> None:
            assert self.watchdog is not None
            self.hang = hang

            def kill() -> None:
                for pid in pids:
                    for sig in (signal.SIGCONT, signal.SIGKILL):
                        try:
                            os.kill(pid, sig)
                        except ProcessLookupError:
                            pass

            report_then_kill(self.watchdog, hang, _say_raw, kill, "the ranks are killed")

        def _restart_workers(self, worker_group) -> None:
            attempt = len(self.restarts) + 1
            if worker_group.state == WorkerState.HEALTHY:  # another node's ranks failed: all restart together
                cause, rank, code = "peer", None, None
            elif self.hang is not None:
                cause, rank, code = "hung", self.hang.rank, -signal.SIGKILL
            else:
                cause, (rank, code) = "crashed", self.last_failure or (None, None)
            restart = Restart(
                attempt=attempt,
                cause=cause,
                rank=rank,
                code=code,
                at=time.time(),
                hung=self.hang.to_json() if self.hang is not None else None,
            )
            self.restarts.append(restart)
            _say(f"tessera.launcher: {restart.line()}; restarting the ranks in place from the last checkpoint")
            _record("restart", **restart.to_json())
            super()._restart_workers(worker_group)

    return Agent


def _cause(codes: dict[int, int]) -> tuple[int, int] | None:
    """(rank, code) of the failure that explains the others: a fatal exit first, then a kill (a signal other than
    the agent's own SIGTERM) or a crash, and only then a lost peer's 75 or a stopped rank's 76; the lowest rank of
    the same kind."""

    def consequence(code: int) -> int:
        if code == FATAL:
            return 0
        if code in (RETRYABLE, INTERRUPTED, -signal.SIGTERM):
            return 2
        return 1

    return min(codes.items(), key=lambda kv: (consequence(kv[1]), kv[0]), default=None)


def _warm_up(modules: list[str], log_dir: Path) -> Path:
    """The forkserver imports `modules` now, while the agent meets its peers: a rank forks from it later. Returns
    the file where it will write its verdict on infra/warm.py's rules (empty: kept them)."""
    from multiprocessing import forkserver

    verdict = log_dir / f".warm-verdict-{os.getpid()}"
    verdict.unlink(missing_ok=True)
    os.environ[VERDICT_ENV] = str(verdict)  # the server inherits the environment it starts with
    multiprocessing.set_forkserver_preload(["infra.warm_open", "infra.warm", *modules, "infra.warm_seal"])
    forkserver.ensure_running()
    return verdict


def _read_verdict(path: Path, timeout_s: float = 900) -> str:
    """The warm process's verdict, once its preloads are in (as long as the imports take, at most `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            return f"the warm process said nothing of its imports in {timeout_s:.0f} s"
        time.sleep(0.05)
    text = path.read_text().strip()
    path.unlink(missing_ok=True)
    return text


def run(ns: argparse.Namespace) -> int:
    log_dir = Path(ns.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    warm = [m for m in ns.warm.split(",") if m] and not ns.cold
    # First, before this process imports torch: the server's imports (most of a launch's start) overlap its own.
    verdict = _warm_up(ns.warm.split(","), log_dir) if warm else None

    gc.disable()  # torch's agent imports faster without the collector walking them (infra/warm_open.py); frozen after
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry

    import infra.warm  # noqa: F401 -- PYTORCH_NVML_BASED_CUDA_CHECK for the forkserver too, before torch sees a GPU

    gc.freeze()
    gc.enable()

    # Each launch's rank 0 hosts the training store itself (trainers/rendezvous.py binds it where it must listen),
    # on a port rank 0's agent picks: the agent's rendezvous store stays the agent's.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    # torch's agent logs each failure with a traceback of its own polling; the launcher's lines say what happened
    for name in ("torch.distributed.elastic", "torch.multiprocessing"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    if not warm:
        _say("tessera.launcher: ranks start as fresh interpreters (no warm modules asked for)")
    budgets = Budgets.from_json(os.environ.get(WATCHDOG_ENV))
    watchdog = beats = None
    if budgets is not None:
        beats = Path(os.environ.get(HEARTBEAT_DIR_ENV) or HEARTBEAT_DIR)
        os.environ[HEARTBEAT_DIR_ENV] = str(beats)
        first = ns.node_rank * ns.nproc_per_node
        watchdog = Watchdog(beats, budgets, list(range(first, first + ns.nproc_per_node)))
    host = ns.rdzv_endpoint.rsplit(":", 1)[0]
    params = RendezvousParameters(
        backend="c10d",
        endpoint=ns.rdzv_endpoint,
        run_id=ns.run_id,
        min_nodes=ns.nnodes,
        max_nodes=ns.nnodes,
        local_addr=ns.local_addr or (host if ns.nnodes == 1 else None),
        is_host=ns.node_rank == 0,
        join_timeout=900,  # nodes scheduled minutes apart still meet
    )
    from infra.warm import run_cold, run_rank

    entry = run_rank if warm else run_cold
    spec = WorkerSpec(
        role="trainer",
        local_world_size=ns.nproc_per_node,
        entrypoint=entry,
        # torch gives every worker these, `${local_rank}` replaced: local rank 0 says which start was used
        args=(ns.module, list(ns.args), "${local_rank}"),
        rdzv_handler=rdzv_registry.get_rendezvous_handler(params),
        max_restarts=ns.max_restarts,
        monitor_interval=MONITOR_S,
        local_addr=ns.local_addr,
    )
    agent = _agent_class()(
        spec=spec,
        logs_specs=_logs_specs(log_dir),
        start_method="forkserver" if warm else "spawn",
        verdict=verdict,
        node_rank=ns.node_rank,
        local_addr=ns.local_addr or (host if ns.nnodes == 1 else None),
        watchdog=watchdog,
        beats=beats,
    )
    try:
        result = agent.run()
    except SignalException as exc:
        _say(f"tessera.launcher: stopped by {signal.Signals(exc.sigval).name}; the ranks were stopped")
        codes = {str(r): c for r, c in sorted(agent._exit_codes(agent._worker_group).items())}
        _record("end", code=INTERRUPTED, restarts=len(agent.restarts), hung=None, rank=None, codes=codes)
        return INTERRUPTED
    finally:
        spec.rdzv_handler.shutdown()
    return _end(agent, result)


def _end(agent, result) -> int:
    restarts = len(agent.restarts)
    # every rank of the last attempt that did not succeed, by global rank, once the agent has stopped them all
    codes = {str(r): c for r, c in sorted(agent._exit_codes(agent._worker_group).items())}
    if not result.is_failed():
        _record("end", code=0, restarts=restarts, hung=None, rank=None, codes=codes)
        return 0
    if agent.hang is not None:
        line = f"the watchdog found {agent.hang.line()}"
        _say(f"tessera.launcher: {line}; restarts spent ({restarts}), exiting {HUNG}")
        _record("end", code=HUNG, restarts=restarts, hung=agent.hang.to_json(), rank=agent.hang.rank, codes=codes)
        _terminate(line)
        return HUNG
    rank, code = agent.last_failure or (None, 1)
    # Killed by signal N reads as -N here; a process exits 128+N, as a shell reports it.
    exit_code = 128 - code if code < 0 else code
    _say(
        f"tessera.launcher: rank {rank} failed first with exit code {code} (every rank: "
        f"{', '.join(f'{r}: {c}' for r, c in codes.items()) or 'none recorded'}); {restarts} restart(s) in place spent"
    )
    _record("end", code=code, restarts=restarts, hung=None, rank=rank, codes=codes)
    return exit_code


def main(argv: list[str]) -> int:
    return run(parse(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
