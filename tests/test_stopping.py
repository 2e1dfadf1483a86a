"""A `tessera` command stopped at any moment leaves nothing behind and says so in one line (cli/stopping.py,
cli/guardian.py).

Each test starts the real `tessera` script (`python -m cli.main`, as the console script runs it) with a tag of its
own in the environment, which every process the command starts inherits; "nothing left" is a walk of /proc for
that tag, and of the listening sockets for the ports the command's processes held."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from tests.conftest import ROOT, tiny_recipe

TAG = "TESSERA_TEST_TAG"


def _tagged(tag: str) -> dict[int, str]:
    """pid -> command line of every live process started with `tag` in its environment."""
    needle = f"{TAG}={tag}".encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            found[int(entry)] = cmdline
    return found


def _listening(pids) -> set[int]:
    return {c.laddr.port for c in psutil.net_connections("inet") if c.status == "LISTEN" and c.pid in set(pids)}


def tessera(*args: str) -> list[str]:
    return [sys.executable, "-m", "cli.main", *args]  # as the console script runs it: supervised (cli/entry.py)


class Command:
    """One `tessera` command under test, in a session of its own (as a terminal's job is its own process group)."""

    def __init__(self, tmp_path: Path, argv: list[str], preexec_fn=None):
        self.tag = uuid.uuid4().hex
        self.output = tmp_path / f"out-{self.tag[:8]}.txt"
        self.ports: set[int] = set()
        with open(self.output, "wb") as out:
            self.process = subprocess.Popen(
                argv,
                cwd=ROOT,
                env={**os.environ, TAG: self.tag},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=preexec_fn,
            )

    def wait_for(self, *needles: str, timeout: float = 300) -> dict[int, str]:
        """Until one of the command's processes has a needle in its command line; its processes then."""
        deadline = time.monotonic() + timeout
        while True:
            procs = _tagged(self.tag)
            if any(n in cmd for cmd in procs.values() for n in needles):
                self.ports |= _listening(procs)
                return procs
            assert self.process.poll() is None, self.text()
            assert time.monotonic() < deadline, f"no {needles} after {timeout} s: {self.text()}"
            time.sleep(0.05)

    def stop(self, sig: int, terminal: bool = False, timeout: float = 120) -> int:
        """Send `sig` to the command, or to its whole process group as a terminal's Ctrl-C is; its exit code."""
        self.ports |= _listening(_tagged(self.tag))
        (os.killpg if terminal else os.kill)(self.process.pid, sig)
        return self.process.wait(timeout=timeout)

    def text(self) -> str:
        return self.output.read_text(errors="replace")

    def assert_nothing_left(self) -> None:
        deadline = time.monotonic() + 5  # the guard's own exit, a moment after the command's
        while _tagged(self.tag) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _tagged(self.tag) == {}, self.text()
        assert not self.ports & {c.laddr.port for c in psutil.net_connections("inet") if c.status == "LISTEN"}

    def last_line(self) -> str:
        return self.text().strip().splitlines()[-1]

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for pid in _tagged(self.tag):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def commands():
    started: list[Command] = []
    yield started
    for command in started:
        command.kill()


_SUPERVISED = """
import subprocess, sys, time
from cli import stopping
stopping.supervise()
subprocess.Popen(["sleep", "600"])
# a grandchild whose parent exits at once: re-parented away from the command, in a session of its own
subprocess.Popen(["sh", "-c", "sleep 600 & exit 0"], start_new_session=True).wait()
print("ready", flush=True)
try:
    time.sleep(600)
except stopping.Stopped as stop:  # as cli/main.main ends on a stop
    stopping.say_last(f"tessera: {stopping.stop_line(stop.signum)}")
    sys.exit(stop.exit_code)
"""


def _supervised(tmp_path: Path, commands: list, hup_ignored: bool = False) -> Command:
    # as `nohup` starts a command: SIGHUP ignored
    ignore_hup = (lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)) if hup_ignored else None
    command = Command(tmp_path, [sys.executable, "-c", _SUPERVISED], preexec_fn=ignore_hup)
    commands.append(command)
    deadline = time.monotonic() + 60
    while "ready" not in command.text():
        assert time.monotonic() < deadline and command.process.poll() is None, command.text()
        time.sleep(0.05)
    # `sh` exits right after forking its background child, which may not have exec'd `sleep` yet on a busy
    # machine (CI once saw it still as `sh -c ...`): wait for the exec, so the count below is of what ran
    while sum(c.startswith("sleep 600") for c in _tagged(command.tag).values()) < 2:
        assert time.monotonic() < deadline and command.process.poll() is None, command.text()
        time.sleep(0.05)
    return command


def test_the_guard_ends_what_a_command_started_when_the_command_is_killed(tmp_path, commands):
    """SIGKILL leaves the command no last word: its guard, in a session of its own, ends the child and the
    grandchild that had been re-parented away."""
    command = _supervised(tmp_path, commands)
    procs = _tagged(command.tag)
    assert sum(cmd.startswith("sleep 600") for cmd in procs.values()) == 2 and any(
        "guardian" in c for c in procs.values()
    )
    command.process.kill()
    command.process.wait()
    command.assert_nothing_left()


def test_a_stop_signal_ends_the_command_with_its_children_and_one_line_and_nohup_is_kept(tmp_path, commands):
    command = _supervised(tmp_path, commands)
    assert command.stop(signal.SIGTERM, timeout=30) == 143
    assert _tagged(command.tag) == {}  # gone when the command exited, its guard too (reaped, no zombie)
    command.assert_nothing_left()
    assert "Traceback" not in command.text()
    assert command.last_line().startswith("tessera: stopped by SIGTERM")

    kept = _supervised(tmp_path, commands, hup_ignored=True)  # `nohup`: the terminal closing must not stop it
    os.kill(kept.process.pid, signal.SIGHUP)
    time.sleep(1)
    assert kept.process.poll() is None and sum(c.startswith("sleep 600") for c in _tagged(kept.tag).values()) == 2
    assert kept.stop(signal.SIGINT, timeout=30) == 130
    kept.assert_nothing_left()


START = ("prefect.server.api.server", "prefect server start")  # Prefect's temporary server, or `tessera up`'s


@pytest.mark.parametrize(
    ("command", "sig", "terminal", "code"),
    [
        ("run", signal.SIGTERM, False, 143),
        ("run", signal.SIGINT, True, 130),  # Ctrl-C in a terminal: the whole foreground group gets it
        ("prepare", signal.SIGHUP, False, 129),
        ("eval", signal.SIGINT, False, 130),
        ("continue", signal.SIGTERM, False, 143),
        ("up", signal.SIGTERM, False, 0),  # `tessera up` exits 0 after any stop
    ],
)
def test_a_command_stopped_while_its_prefect_server_starts_leaves_nothing(
    tmp_path, commands, command, sig, terminal, code
):
    """The moment of issue 43: the temporary server starting, before any flow runs, when SIGTERM used to orphan it
    and Ctrl-C printed a KeyboardInterrupt traceback."""
    recipe = str(tiny_recipe(tmp_path))
    new = tmp_path / "new"
    new.mkdir()
    (new / "week1.txt").write_text("Once upon a time there was a small model.\n" * 50)
    argv = {
        "run": ["run", recipe],
        "prepare": ["prepare", recipe],
        "eval": [
            "eval",
            "--model",
            "models:/tiny@champion",
            "--tasks",
            str(ROOT / "configs/gauntlet/tiny_tasks.yaml"),
            "--work-dir",
            str(tmp_path / "work"),
        ],  # fmt: skip
        "continue": ["continue", recipe, "--new-data", str(new)],
        "up": ["up", recipe, "--work-dir", str(tmp_path / "up"), "--prefect-port", "0", "--mlflow-port", "0"],
    }[command]
    if command == "up":
        from tests.conftest import free_port

        argv[-3], argv[-1] = str(free_port()), str(free_port())
    started = Command(tmp_path, tessera(*argv))
    commands.append(started)
    started.wait_for(*START)
    assert started.stop(sig, terminal=terminal) == code, started.text()
    started.assert_nothing_left()
    assert "Traceback" not in started.text()
    if command == "up":
        assert started.last_line() == "tessera up: stopped", started.text()
    else:
        name = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C (SIGINT)", signal.SIGHUP: "SIGHUP"}[sig]
        assert started.last_line().startswith(f"tessera: stopped by {name}"), started.text()


def _versions(store: Path) -> int:
    """Model versions in the run's MLflow store (sqlite), 0 before it exists."""
    import sqlite3

    try:
        with sqlite3.connect(f"file:{store}?mode=ro", uri=True) as db:
            return db.execute("SELECT count(*) FROM model_versions").fetchone()[0]
    except sqlite3.Error:
        return 0


def test_a_run_stopped_while_it_trains_or_registers_ends_cancelled_and_the_rerun_finishes(tmp_path, commands):
    """SIGTERM while the first stage trains; Ctrl-C (SIGINT) once the first checkpoint is registered, while the
    next is scored or registered and the stage trains on. Each: the flow run Cancelled saying what the run keeps,
    nothing left. The third run finishes with each checkpoint registered once."""
    recipe = str(tiny_recipe(tmp_path))
    first = Command(tmp_path, tessera("run", recipe))
    commands.append(first)
    first.wait_for("trainers.", "infra.launcher")
    assert first.stop(signal.SIGTERM) == 143, first.text()
    first.assert_nothing_left()
    assert first.last_line().startswith("tessera: stopped by SIGTERM: cancelled: every rank of run 'tiny' was stopped")
    assert "Traceback" not in first.text()

    second = Command(tmp_path, tessera("run", recipe))
    commands.append(second)
    deadline = time.monotonic() + 600
    while _versions(tmp_path / "mlflow.db") < 1:
        assert second.process.poll() is None and time.monotonic() < deadline, second.text()
        time.sleep(0.1)
    assert second.stop(signal.SIGINT) == 130, second.text()
    second.assert_nothing_left()
    assert second.last_line().startswith(
        "tessera: stopped by Ctrl-C (SIGINT): cancelled: every rank of run 'tiny' was stopped; its checkpoint at "
    ), second.text()
    assert "Traceback" not in second.text()

    again = Command(tmp_path, tessera("run", recipe))
    commands.append(again)
    assert again.process.wait(timeout=600) == 0, again.text()
    assert any(line.startswith("run tiny: 3 model versions") for line in again.text().splitlines()), again.text()
    assert _versions(tmp_path / "mlflow.db") == 3
    again.assert_nothing_left()


def test_a_prepare_stopped_while_it_tokenizes_leaves_nothing_and_the_rerun_finishes(tmp_path, commands):
    recipe = str(tiny_recipe(tmp_path))
    first = Command(tmp_path, tessera("prepare", recipe))
    commands.append(first)
    first.wait_for("spawn_main")  # the tokenizer pool's workers
    assert first.stop(signal.SIGINT) == 130, first.text()
    first.assert_nothing_left()
    assert "Traceback" not in first.text()
    assert "interrupted by SIGINT" in first.last_line()

    again = Command(tmp_path, tessera("prepare", recipe))
    commands.append(again)
    assert again.process.wait(timeout=600) == 0, again.text()
    again.assert_nothing_left()
