"""A launch cleans the shared memory a killed launch left, and never a live dataset's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

# A real StreamingDataset in its own process: it says ready, then reads a sample whenever asked.
DATASET = """
import sys
from streaming import StreamingDataset
ds = StreamingDataset(local=sys.argv[1], batch_size=1, shuffle=False)
print("ready", flush=True)
for line in sys.stdin:
    print(len(ds[int(line)]["tokens"]), flush=True)
"""


def _segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir()}


def _start(folder: Path) -> subprocess.Popen:
    # Its own session: killing the group also kills multiprocessing's resource tracker, which would
    # otherwise unlink the segments itself (as after a plain kill of one rank; not after a whole launch
    # is killed, or a pod or node dies).
    proc = subprocess.Popen([sys.executable, "-c", DATASET, str(folder)], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    assert proc.stdout.readline() == "ready\n"
    return proc


def test_only_segments_no_live_process_maps_are_removed(tmp_path):
    from trainers.shm import clean_stale_streaming_shm
    from trainers.testing import write_mds

    live_data, dead_data = write_mds(tmp_path / "live", 10, 16, 512, seed=1), write_mds(tmp_path / "dead", 10, 16, 512, seed=2)
    before = _segments()
    live = _start(live_data)
    try:
        live_segments = _segments() - before
        dead = _start(dead_data)
        dead_segments = _segments() - before - live_segments
        os.killpg(dead.pid, signal.SIGKILL)  # a killed launch: its segments stay behind
        dead.wait()
        assert live_segments and dead_segments and dead_segments <= _segments()

        removed = clean_stale_streaming_shm()
        assert dead_segments <= set(removed) and not dead_segments & _segments()  # the killed one's are gone
        assert live_segments <= _segments() and not live_segments & set(removed)  # the live one's stay
        live.stdin.write("3\n")
        live.stdin.flush()
        assert live.stdout.readline() == "16\n"  # and it still reads
    finally:
        os.killpg(live.pid, signal.SIGKILL)
        live.wait()
    clean_stale_streaming_shm()
    assert not live_segments & _segments()  # once its process is gone, the next launch clears them too
