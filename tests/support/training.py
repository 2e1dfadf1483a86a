"""Small fixtures for tests and benches: MDS token data, an HF tokenizer dir, a tiny TrainJob, a real MLflow server.

Nothing here is used by training itself.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

from trainers.config import MlflowTarget, ModelConfig, StageConfig, TrainConfig, TrainJob
from trainers.contract import WARM_MODULES

ROOT = Path(__file__).resolve().parents[2]
NEOX_TOKENIZER = ROOT / "data" / "tokenizers" / "gpt-neox-20b" / "tokenizer.json"


def write_mds(out: str | Path, n_samples: int, seq_len: int, vocab_size: int, seed: int, low: int = 0) -> Path:
    """An MDS directory of `n_samples` random samples (column `tokens`: seq_len uint16 ids)."""
    from streaming import MDSWriter

    rng = np.random.default_rng(seed)
    # Ids of one source come from their own band, so a mixture's samples are recognisable by value.
    with MDSWriter(out=str(out), columns={"tokens": "ndarray:uint16"}, size_limit=1 << 16) as writer:
        for _ in range(n_samples):
            writer.write({"tokens": rng.integers(low, vocab_size, size=seq_len, dtype=np.uint16)})
    return Path(out)


def two_sources(root: str | Path, seq_len: int = 32) -> dict[str, str]:
    """The training tests' two sources, `a` (ids below 256) and `b` (256 to 511), and b's held-out split `b_val`
    beside them: a mixture's samples are recognisable by value."""
    root = Path(root)
    write_mds(root / "b_val", 24, seq_len, 512, seed=9, low=256)
    return {
        "a": str(write_mds(root / "a", 200, seq_len, 256, seed=1)),
        "b": str(write_mds(root / "b", 200, seq_len, 512, seed=2, low=256)),
    }


def write_hf_tokenizer(out: str | Path, vocab_size: int | None = None) -> Path:
    """An HF tokenizer directory: GPT-NeoX's, or a byte-level BPE of `vocab_size` trained on a little Shakespeare
    (small vocabularies keep test models and checkpoints small)."""
    from transformers import PreTrainedTokenizerFast

    if vocab_size is None:
        tok = PreTrainedTokenizerFast(tokenizer_file=str(NEOX_TOKENIZER), eos_token="<|endoftext|>")
    else:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        text = (ROOT / "data" / "corpora" / "tinyshakespeare" / "input.txt").read_text()[:50_000]
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        bpe.train_from_iterator(text.split("\n\n"), trainer)
        tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    tok.save_pretrained(str(out))
    return Path(out)


def tiny_job(
    root: str | Path,
    streams: dict[str, str],
    stages: list[StageConfig],
    *,
    seq_len: int = 32,
    vocab_size: int = 512,
    global_batch_size: int = 8,
    checkpoint_every_tokens: int | None = None,
    tokenizer_dir: str | None = None,
    run_name: str = "tiny",
    model: ModelConfig | None = None,
    mlflow: MlflowTarget | None = None,
    seq_len_streams: dict[int, dict[str, str]] | None = None,
    val_streams: dict[str, str] | None = None,
    **train_overrides,
) -> TrainJob:
    train = TrainConfig(
        global_batch_size=global_batch_size,
        device_microbatch_size=global_batch_size,
        stages=stages,
        **train_overrides,
    )
    return TrainJob(
        run_name=run_name,
        model=model or ModelConfig(),
        train=train,
        vocab_size=vocab_size,
        eos_token_id=0,
        seq_len=seq_len,
        streams=streams,
        seq_len_streams=seq_len_streams or {},
        val_streams=val_streams or {},
        save_folder=str(Path(root) / "ckpt"),
        checkpoint_every_tokens=checkpoint_every_tokens or 4 * global_batch_size * seq_len,
        tokenizer_dir=tokenizer_dir,
        mlflow=mlflow,
    )


def write_job(job: TrainJob, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(job.model_dump_json(indent=1))
    return path


def run_stage(
    job_path: str | Path, stage: int, *, procs: int = 1, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """Run `python -m trainers.train` as the flow would: forked warm, through infra/launcher.py when procs > 1 (no
    restarts in place: each test says what a launch's end is), from this worker's warm process when one rank
    (tests/support/warm_fork.py; a fresh interpreter when the environment rules that out)."""
    from tests.support.warm_fork import run_trainer, trainer_command

    args = ["--job", str(job_path), "--stage", str(stage)]
    if procs == 1:
        cmd = trainer_command(args)
    else:
        logs = Path(job_path).parent / "logs"
        logs.mkdir(exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "infra.launcher",
            "--nproc-per-node",
            str(procs),
            "--log-dir",
            str(logs),
            "--warm",
            ",".join(WARM_MODULES),
            "-m",
            "trainers.train",
            *args,
        ]
    full_env = _trainer_env(env)
    if procs == 1:
        forked = run_trainer(args, full_env, ROOT, timeout)
        if forked is not None:
            return forked
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


# One intra-op thread: tiny matmuls gain nothing from two, and on a shared CI box spinning
# OpenMP workers make every step several times slower. The tests' warm process starts with it too
# (tests/support/warm_fork.py), so their trainers' environments match it.
TRAINER_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}


def _trainer_env(env: dict[str, str] | None) -> dict[str, str]:
    return {**os.environ, **TRAINER_ENV, **(env or {})}


def start_stage(
    job_path: str | Path, stage: int, *, env: dict[str, str] | None = None, stdout: Path | None, stderr: Path | None
):
    """Start one rank of `python -m trainers.train` as run_stage runs it, without waiting: its output in `stdout` and
    `stderr` (None: discarded; the same path: one file). A subprocess.Popen, or a Popen-like ForkedTrainer."""
    from tests.support.warm_fork import start_trainer, trainer_command

    args = ["--job", str(job_path), "--stage", str(stage)]
    full_env = _trainer_env(env)
    forked = start_trainer(args, full_env, ROOT, stdout, stderr)
    if forked is not None:
        return forked
    cmd = trainer_command(args)
    with contextlib.ExitStack() as files:  # the child has its own copies once started
        out = files.enter_context(open(stdout, "wb")) if stdout is not None else subprocess.DEVNULL
        if stderr is not None and stderr == stdout:
            err = subprocess.STDOUT
        else:
            err = files.enter_context(open(stderr, "wb")) if stderr is not None else subprocess.DEVNULL
        return subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=out, stderr=err)


def can_unshare_mounts() -> bool:
    """Whether this process may make a private mount namespace (root, or CAP_SYS_ADMIN), for tests that give a
    process a disk of its own."""
    try:
        probe = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True, timeout=10)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def live_group_members(pgid: int) -> list[int]:
    """Pids of the processes of process group `pgid` that still run (zombies waiting to be reaped do not)."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):  # fields 5 (pgrp) and 3 (state) of proc(5)
            alive.append(int(entry.name))
    return alive


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every live process."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")  # ends in " "
        except OSError:  # exited meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] not in ("Z", "X"):
            out[int(entry.name)] = (int(fields[1]), cmdline)
    return out


def rank_pids(job_path: str | Path) -> list[int]:
    """The rank processes training `job_path`: never its launcher, the launcher's forkserver or a resource tracker.
    A rank forked warm has its forkserver's command line, so ranks are found by parentage: the children of a
    launcher's forkserver (warm), the spawned children of a launcher (cold), or a trainer run on its own."""
    procs = _processes()
    job = f"-m trainers.train --job {job_path} "  # the module's arguments come last, --stage after the job
    launchers = {p for p, (_, cmd) in procs.items() if "-m infra.launcher " in cmd and job in cmd}
    alone = [p for p, (_, cmd) in procs.items() if job in cmd and "infra.launcher" not in cmd]
    children = {p: cmd for p, (parent, cmd) in procs.items() if parent in launchers}
    servers = {p for p, cmd in children.items() if "multiprocessing.forkserver" in cmd}
    spawned = [p for p, cmd in children.items() if "multiprocessing.spawn" in cmd]
    forked = [p for p, (parent, _) in procs.items() if parent in servers]
    return sorted(alone + spawned + forked)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """A real `mlflow server` on 127.0.0.1 over a sqlite store, which can be stopped and started again
    on the same port and store (a tracking-server outage)."""

    def __init__(self, root: str | Path, port: int | None = None, workers: int = 1):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.workers = workers
        self.uri = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 300) -> None:  # a start at load 10 can take minutes
        from tests.support.mlflow_store import sqlite_store

        mlflow = Path(sys.executable).with_name("mlflow")
        cmd = [
            str(mlflow),
            "server",
            "--backend-store-uri",
            sqlite_store(self.root / "mlflow.db"),
            "--default-artifact-root",
            str(self.root / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            str(self.workers),
        ]
        with open(self.root / "server.log", "ab") as log:
            # Its own process group: stopping it must take its uvicorn workers along.
            self.process = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                # as `tessera up` runs it: MLflow's job runner (huey consumers, each a Python importing MLflow,
                # polling while idle) serves GenAI jobs no test submits
                env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
            )
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop(timeout=10)  # a server slower than its deadline must not outlive the test that gave up
                tail = (self.root / "server.log").read_text()[-3000:]
                raise RuntimeError(f"mlflow server on port {self.port} did not come up:\n{tail}")
            time.sleep(0.25)

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM the server's process group, SIGKILL what is left after `timeout`; returns once all are gone."""
        if self.process is None:
            return
        group = self.process.pid
        try:
            os.killpg(group, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + timeout
        while live_group_members(group) and time.monotonic() < deadline:
            time.sleep(0.1)
        if live_group_members(group):
            os.killpg(group, signal.SIGKILL)
        self.process.wait()
        self.process = None

    def __enter__(self) -> MlflowServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def model_tensors(path: str | Path) -> dict:
    """The model's tensors of a checkpoint, a single file or a sharded folder (read whole), by Composer's key."""
    if Path(path).is_dir():
        from trainers.format.sharded import MODEL_PREFIX, read_tensors

        return read_tensors(path, MODEL_PREFIX)
    from trainers.format.safe_load import load

    return load(path)["state"]["model"]
