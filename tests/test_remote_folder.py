"""trainers/remote.py against a real S3 server (moto): uploads that survive an outage, pins, and what a poll costs.

The outage is a real boto3 client talking to the real server, with its PutObject (and multipart) requests
answered `500 InternalError` by a botocore `before-send` hook from the first checkpoint's upload until a release
file appears: in the trainer's own
process, installed by a sitecustomize.py on its PYTHONPATH (tests/support would be imported by nothing there).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainers.format.checkpoints import CheckpointInfo

ROOT = Path(__file__).resolve().parents[1]

OUTAGE = '''
"""tests/test_remote_folder.py: S3 uploads of this process fail until $TESSERA_TEST_S3_RELEASE exists."""
import json, os, threading, time

import botocore.session
from botocore.awsrequest import AWSResponse

_release, _log = os.environ["TESSERA_TEST_S3_RELEASE"], os.environ["TESSERA_TEST_S3_LOG"]
_lock = threading.Lock()
_BODY = b"<Error><Code>InternalError</Code><Message>injected outage</Message></Error>"


class _Raw:
    def stream(self, **_):
        yield _BODY


_began = []


def _send(request, **_):
    # The outage begins with the first checkpoint's upload: the launch's start (its preflight probe, the stage
    # ledger) needs the store, and fails the launch without it.
    if request.url.split("?")[0].endswith(".pt"):
        _began.append(True)
    failing = bool(_began) and not os.path.exists(_release)
    with _lock, open(_log, "a") as f:
        f.write(json.dumps({"key": request.url.split("?")[0], "failed": failing}) + "\\n")
    return AWSResponse(request.url, 500, {}, _Raw()) if failing else None


_create = botocore.session.Session.create_client


def create_client(self, service_name, *args, **kwargs):
    client = _create(self, service_name, *args, **kwargs)
    if service_name == "s3":
        for op in ("PutObject", "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload"):
            client.meta.events.register(f"before-send.s3.{op}", _send)
    return client


botocore.session.Session.create_client = create_client
'''


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _train_in_an_outage(tmp_path: Path, moto_s3, **train) -> tuple[subprocess.Popen, Path, Path, Path, object]:
    """Stage 0 of a tiny run (checkpoints at 1024, 2048 and 2560 tokens) mirrored to s3://ckpts/runs, started
    with every upload failing; returns (process, release file, request log, stderr file, job)."""
    from tests.support.training import tiny_job, write_job, write_mds
    from trainers.config import StageConfig

    moto_s3.create_bucket(Bucket="ckpts")
    data = write_mds(tmp_path / "a", 120, 32, 256, seed=1)
    stages = [StageConfig(name="warm", tokens=10 * 256, mixture={"a": 1.0})]
    job = tiny_job(
        tmp_path, {"a": str(data)}, stages, checkpoint_every_tokens=1024, save_folder="s3://ckpts/runs", **train
    )
    job_path = write_job(job, tmp_path / "job.json")
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(OUTAGE)
    release, requests, stderr = tmp_path / "release", tmp_path / "requests.jsonl", tmp_path / "stderr.txt"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": str(hooks),
        "TESSERA_TEST_S3_RELEASE": str(release),
        "TESSERA_TEST_S3_LOG": str(requests),
    }
    with open(stderr, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainers.train", "--job", str(job_path), "--stage", "0"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    return proc, release, requests, stderr, job


def _wait_for(path: Path, proc: subprocess.Popen, stderr: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, stderr.read_text()[-3000:]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)


@pytest.mark.slow
def test_training_goes_on_through_an_s3_outage_and_mirrors_every_checkpoint_after_it(tmp_path, moto_s3):
    from trainers.format.checkpoints import list_complete, manifest_path

    proc, release, requests, stderr, job = _train_in_an_outage(tmp_path, moto_s3)
    _wait_for(manifest_path(job.save_folder, 2560), proc, stderr)  # the stage's last checkpoint, saved locally
    deadline = time.monotonic() + 120
    while "failed (attempt 2)" not in stderr.read_text():  # the stage's end waits while the retries back off
        assert proc.poll() is None and time.monotonic() < deadline, stderr.read_text()[-3000:]
        time.sleep(0.2)
    keys = [o["Key"] for o in moto_s3.list_objects_v2(Bucket="ckpts").get("Contents", [])]
    assert not [k for k in keys if k.endswith(".pt") or "/manifests/" in k], keys  # nothing got through meanwhile
    release.touch()  # the outage ends
    assert proc.wait(timeout=300) == 0, stderr.read_text()[-3000:]

    log = stderr.read_text()
    assert "failed (attempt 1), retrying in 1 s" in log and "failed (attempt 2), retrying in 2 s" in log, log[-3000:]
    assert "Traceback" not in log
    # Every checkpoint is whole in the mirror: its bytes are the local file's, and its manifest says so.
    local = list_complete(job.save_folder)
    assert [c.tokens for c in local] == [1024, 2048, 2560]
    for info in local:
        name = Path(info.path).name
        body = moto_s3.get_object(Bucket="ckpts", Key=f"runs/tiny/{name}")["Body"].read()
        assert _sha256(body) == _sha256(Path(info.path).read_bytes()) == info.sha256
        key = f"runs/tiny/manifests/tok-{info.tokens:012d}.json"
        remote = CheckpointInfo.model_validate_json(moto_s3.get_object(Bucket="ckpts", Key=key)["Body"].read())
        assert remote.sha256 == info.sha256 and remote.path == f"s3://ckpts/runs/tiny/{name}"
    # A manifest went up only after its checkpoint's object had.
    through = [r["key"].split("/ckpts/", 1)[1] for r in map(json.loads, requests.read_text().splitlines())]
    failed = [json.loads(r)["failed"] for r in requests.read_text().splitlines()]
    ok = [k for k, f in zip(through, failed) if not f]
    for info in local:
        pt, manifest = f"runs/tiny/{Path(info.path).name}", f"runs/tiny/manifests/tok-{info.tokens:012d}.json"
        assert ok.index(pt) < ok.index(manifest), ok
    assert sum(failed) >= 3
    assert not list((Path(job.save_folder) / ".uploading").rglob("*.pt"))  # staged links released once up


@pytest.mark.slow
def test_uploads_that_never_recover_end_the_stage_in_one_line_after_the_bounded_wait(tmp_path, moto_s3):
    from trainers.config import WatchdogConfig
    from trainers.exit_codes import ExitCode

    proc, _, _, stderr, job = _train_in_an_outage(tmp_path, moto_s3, watchdog=WatchdogConfig(upload_s=5))
    code = proc.wait(timeout=300)
    log = stderr.read_text()
    assert code == ExitCode.INTERRUPTED, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    said = [line for line in log.splitlines() if line.startswith("tessera.train: ")]
    assert len(said) == 1, log[-3000:]
    last = said[0]
    assert last.startswith(
        "tessera.train: s3://ckpts/runs/tiny: checkpoint tiny-s0-tok1024-rank0.pt (1024 tokens) is still not uploaded "
        "after "
    ), last
    assert "attempts in 4 s at the stage's end: " in last and "InternalError" in last, last
    assert "Contents" not in moto_s3.list_objects_v2(Bucket="ckpts", Prefix="runs/tiny/manifests/")


# ---------------------------------------------------------------- pins and rotation, in process


def _checkpoints(tmp_path: Path, tokens: list[int]) -> list[CheckpointInfo]:
    """Local "checkpoints" (a few random bytes each: nothing here loads them), mirrored as the trainer would."""
    found = []
    for t in tokens:
        path = tmp_path / f"tiny-s0-tok{t}-rank0.pt"
        path.write_bytes(os.urandom(256))
        info = CheckpointInfo(path=str(path), tokens=t, batch=t // 256, stage="warm", stage_index=0)
        found.append(info.model_copy(update={"sha256": _sha256(path.read_bytes())}))
    return found


@pytest.fixture()
def mirror(moto_s3, tmp_path):
    from trainers.remote import RemoteFolder

    moto_s3.create_bucket(Bucket="ckpts")
    return RemoteFolder("s3://ckpts/runs/tiny")


def _objects(moto_s3) -> set[str]:
    return {o["Key"].removeprefix("runs/tiny/") for o in moto_s3.list_objects_v2(Bucket="ckpts").get("Contents", [])}


def test_keep_last_leaves_pinned_checkpoints_and_unpinning_lets_rotation_remove_them(mirror, moto_s3, tmp_path):
    ckpts = _checkpoints(tmp_path, [256, 512, 768, 1024, 1280])
    for info in ckpts:
        mirror.publish(info)
    for info in ckpts[:3]:
        assert mirror.pin(info)
    mirror.keep_last(1)
    assert [c.tokens for c in mirror.complete()] == [256, 512, 768, 1280]  # 1024 was the one unpinned old one
    assert "tiny-s0-tok1024-rank0.pt" not in _objects(moto_s3)
    mirror.unpin(ckpts[0])
    mirror.unpin(ckpts[1])
    mirror.keep_last(1)
    assert [c.tokens for c in mirror.complete()] == [768, 1280]
    assert _objects(moto_s3) == {
        "pins/tiny-s0-tok768-rank0.pt",
        "manifests/tok-000000000768.json",
        "tiny-s0-tok768-rank0.pt",
        "manifests/tok-000000001280.json",
        "tiny-s0-tok1280-rank0.pt",
    }


def test_a_pin_and_a_retire_that_cross_never_lose_a_pinned_checkpoint(mirror, moto_s3, tmp_path):
    """The flow pins while the trainer's rotation retires the same checkpoint: whichever goes first, either the
    pin fails (its checkpoint is gone, and no pin is left behind) or the files stay and the manifest comes back."""
    early, late = _checkpoints(tmp_path, [256, 512])
    for info in (early, late):
        mirror.publish(info)
    gone = mirror.complete()[0]
    assert mirror.retire(gone)
    assert not mirror.pin(gone) and mirror.pinned() == set()

    held = mirror.complete()[0]
    moto_s3.put_object(Bucket="ckpts", Key="runs/tiny/pins/tiny-s0-tok512-rank0.pt", Body=b"512\n")
    assert not mirror.retire(held)  # it listed no pin before the flow wrote one: it looks again, and keeps it
    assert mirror.complete() == [held]
    assert "tiny-s0-tok512-rank0.pt" in _objects(moto_s3)


def test_the_queue_in_pods_pins_remotely_drops_stale_pins_and_skips_the_oldest_waiting(
    mirror, moto_s3, tmp_path, monkeypatch
):
    """The flow's side, on Kubernetes: a crashed flow's pin is dropped at start; each new checkpoint in the mirror
    is pinned there; with evaluations busy, only MAX_WAITING wait and the older are skipped and unpinned."""
    from evaluation.config import EvalConfig
    from infra.config import ComputeConfig
    from tasks.tracking_config import TrackingConfig
    from tasks.training import gauntlet_queue
    from tasks.training.gauntlet_queue import MAX_WAITING, GauntletQueue, QueueTarget
    from trainers.format.store import S3Checkpoints

    ckpts = _checkpoints(tmp_path, [256, 512, 768, 1024, 1280])
    for info in ckpts:
        mirror.publish(info)
    moto_s3.put_object(Bucket="ckpts", Key="runs/tiny/pins/tiny-s0-tok128-rank0.pt", Body=b"128\n")
    # What this test is not about: Prefect's run context, MLflow's registrations, the evaluation pods.
    said: list[str] = []
    logger = logging.getLogger("tests.queue")
    logger.setLevel(logging.INFO)
    monkeypatch.setattr(logger, "_log", lambda level, msg, args, **_: said.append(msg % args))
    monkeypatch.setattr(gauntlet_queue, "get_run_logger", lambda: logger)
    monkeypatch.setattr(gauntlet_queue, "existing_registrations", lambda *_: {})
    submitted: list[int] = []
    busy = [True]
    monkeypatch.setattr(GauntletQueue, "_submit", lambda self, ckpt, pinned: submitted.append(ckpt.tokens))
    monkeypatch.setattr(GauntletQueue, "_scoring", lambda self: busy[0])

    target = QueueTarget(
        run_name="tiny",
        run_id="r",
        eval=EvalConfig.model_validate({"every": 256, "tasks": "unused.yaml"}),
        tracking=TrackingConfig.model_validate({"registered_model": "tiny"}),
        compute=ComputeConfig.model_validate({"backend": "kubernetes", "kubernetes": {"image": "tessera:test"}}),
        seq_len=32,
        recipe_hash="h",
    )
    queue = GauntletQueue(target, S3Checkpoints("s3://ckpts/runs/tiny"))
    assert said == [
        "released 1 checkpoint(s) an earlier flow run of this run had kept for evaluation and never released (it was "
        "stopped): tiny-s0-tok128-rank0.pt; each is evaluated again if it has no version yet"
    ]
    queue.sweep()
    waiting = {Path(c.path).name for c in ckpts[-MAX_WAITING:]}
    assert mirror.pinned() == waiting
    for skipped in ckpts[:-MAX_WAITING]:
        assert any(f"skipping the gauntlet for the checkpoint at {skipped.tokens} tokens" in line for line in said)
    mirror.keep_last(1)  # the trainer rotates meanwhile: what waits for the gauntlet stays
    assert [c.tokens for c in mirror.complete()] == [1024, 1280]
    busy[0] = False
    queue.sweep()
    assert submitted == [1024, 1280]


# ---------------------------------------------------------------- what a poll of the mirror costs


def test_a_poll_of_the_mirror_gets_only_the_manifests_it_has_not_read(mirror, moto_s3, tmp_path):
    from trainers.remote import RemoteFolder

    trainer = RemoteFolder("s3://ckpts/runs/tiny")
    ckpts = _checkpoints(tmp_path, [256, 512, 768])
    for info in ckpts[:2]:
        trainer.publish(info)
    calls: list[str] = []
    for op in ("GetObject", "ListObjectsV2"):
        mirror.client.meta.events.register(f"before-send.s3.{op}", lambda op=op, **_: calls.append(op))

    assert [c.tokens for c in mirror.complete()] == [256, 512]
    assert calls.count("GetObject") == 2 and calls.count("ListObjectsV2") == 1
    calls.clear()
    assert [c.tokens for c in mirror.complete()] == [256, 512]
    assert calls == ["ListObjectsV2"]  # nothing new: no manifest read again
    calls.clear()
    trainer.publish(ckpts[2])
    assert [c.tokens for c in mirror.complete()] == [256, 512, 768]
    assert calls.count("GetObject") == 1
    calls.clear()
    trainer.retire(trainer.complete()[0])  # a retired manifest leaves the listing, and the answer
    assert [c.tokens for c in mirror.complete()] == [512, 768]
    assert calls == ["ListObjectsV2"]
