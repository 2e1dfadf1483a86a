"""Concurrent prepares of one output: the second waits and reuses; a live run's staging is never deleted,
on this host or another sharing the data root; a dead host's lease is taken over once stale."""

from __future__ import annotations

import glob
import json
import os
import time

import pytest

from tasks.data import outputs, pipeline, tokenizer
from tests.test_data_helpers import SHAKESPEARE, expected_tokens, make_config, prov, spawn_prepare


def _setup(tmp_path, copies: int):
    text = SHAKESPEARE.read_text() * copies
    (tmp_path / "in.txt").write_text(text)
    data = make_config(
        tmp_path / "data", [{"name": "s", "paths": [str(tmp_path / "in.txt")], "separator": "\n\n"}], seq_len=128
    )
    tok = tokenizer.resolve(data.tokenizer, data.root, data.sources, data.chunk_bytes)
    cfg = tmp_path / "data.json"
    cfg.write_text(data.model_dump_json())
    docs = [d for d in text.split("\n\n") if d.strip()]
    return data, cfg, docs, pipeline.plan(data.sources[0], data, tok).out


def _foreign_run(out: str, heartbeat_age_s: float) -> str:
    """What a run on another host leaves on the shared root: a partition's staging (a pid meaningless here) inside
    the output, and the output's lease beside it."""
    parent, base = os.path.split(out)
    staging = os.path.join(out, ".tmp-00000-424242-feedbeef")
    os.makedirs(os.path.join(staging, "train"))
    with open(os.path.join(staging, "train", "shard.00000.mds"), "wb") as f:
        f.write(b"half a shard")
    lease = os.path.join(parent, f".{base}.lease")
    with open(lease, "w") as f:
        json.dump({"owner": "elsewhere", "host": "other-host.example", "pid": 424242}, f)
    beat = time.time() - heartbeat_age_s
    os.utime(lease, (beat, beat))
    return staging


def _check_output(data, out, docs):
    assert outputs.is_done(out)
    assert prov(out)["counts"]["train"]["tokens"] == expected_tokens(docs)
    assert glob.glob(os.path.join(data.root, ".s-*")) == []  # no staging, no lease left behind


LEASE_S = 20


@pytest.mark.slow  # two child interpreters
def test_two_prepares_of_one_output_and_a_live_run_on_another_host(tmp_path):
    data, cfg, docs, out = _setup(tmp_path, copies=3)
    foreign = _foreign_run(out, heartbeat_age_s=0)  # alive: its heartbeat is fresh
    # Short, for the takeover of the foreign lease to come soon, but not 6 s: the holder's heartbeat (every quarter of
    # it) once missed 6 s in CI on 2 loaded cores, the other prepare took over its live lease, and the holder rightly
    # refused to publish (LeaseLost). A stall of 20 s is a frozen process, which a takeover is for.
    env = {"TESSERA_LEASE_SECONDS": str(LEASE_S)}
    a, b = spawn_prepare(cfg, **env), spawn_prepare(cfg, **env)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 3:  # the other host's run is live: nobody touches its work
        assert os.path.isfile(os.path.join(foreign, "train", "shard.00000.mds"))
        assert os.listdir(out) == [os.path.basename(foreign)]  # not even a plan file: nobody else holds the lease
        assert a.poll() is None and b.poll() is None
        time.sleep(0.1)
    # Its heartbeat stops (the test never refreshes it): after the lease's LEASE_S one of the two takes
    # over, clears the dead staging and prepares; the other waits for it and reuses its output.
    said = []
    for p in (a, b):
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-3000:]
        said.append(stdout.split()[-1])
    assert sorted(said) == ["cached", "written"]
    assert time.monotonic() - t0 >= LEASE_S
    assert not os.path.exists(foreign)
    _check_output(data, out, docs)


@pytest.mark.slow
def test_a_dead_hosts_stale_lease_is_taken_over_at_once(tmp_path):
    data, cfg, docs, out = _setup(tmp_path, copies=1)
    foreign = _foreign_run(out, heartbeat_age_s=3600)  # a host that died an hour ago
    t0 = time.monotonic()
    p = spawn_prepare(cfg)  # the default lease time (120 s): stale long since
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 0, stderr[-3000:]
    assert stdout.split()[-1] == "written" and time.monotonic() - t0 < 100
    assert not os.path.exists(foreign)
    _check_output(data, out, docs)
