"""trainers/: the pod-side contract (job file -> stage -> checkpoints + manifests + metrics + exit code).

The slow tests launch `python -m trainers.train` as subprocesses, exactly as the flow does, on a
2-layer d_model 64 model over 32-token samples. Two sources with disjoint id bands (a: ids < 256,
b: ids >= 256) make the mixture a stage reads visible in the samples themselves.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.training import can_unshare_mounts
from trainers.config import ModelConfig, StageConfig, TrainConfig
from trainers.exit_codes import FATAL, INTERRUPTED, RETRYABLE, ExitCode, FatalError, classify
from trainers.schedule import lr_multiplier, stage_bounds

ROOT = Path(__file__).resolve().parents[1]
SEQ, BATCH = 32, 8
STEP = SEQ * BATCH  # 256 tokens per optimizer step
STAGES = [
    StageConfig(name="warm", tokens=10 * STEP, mixture={"a": 1.0}),
    # Stage 2 doubles the batch: 3 steps of 16 x 32 tokens.
    StageConfig(name="mix", tokens=6 * STEP, mixture={"a": 0.5, "b": 0.5}, lr_scale=0.5, global_batch_size=16),
]
STEPS = [t * STEP for t in range(1, 11)] + [2560 + t * 2 * STEP for t in range(1, 4)]  # token count after each step
CKPT_TOKENS = [1024, 2048, 2560, 3072, 4096]  # on crossing every 1024 tokens, and at each stage end


# ---------------------------------------------------------------- fast, in-process


def test_bad_job_is_one_line_fatal(tmp_path):
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"run_name": "x", "model": {}, "train": {"stages": []}}))
    proc = subprocess.run(
        [sys.executable, "-m", "trainers.train", "--job", str(job), "--stage", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == ExitCode.FATAL and proc.returncode in FATAL
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "train.stages" in proc.stderr and "Traceback" not in proc.stderr


def test_a_job_file_is_held_to_the_recipe_alignment_rule():
    """One rule, one message: a job built by hand is refused as the recipe would be (trainers.config)."""
    from tests.support.training import tiny_job

    stages = [STAGES[0], STAGES[1].model_copy(update={"tokens": 1000})]  # stage 2 steps are 16 x 32 tokens
    with pytest.raises(
        ValueError, match=r"train\.stages\.1\.tokens: 1000 is not a multiple of global_batch_size\*seq_len \(512\)"
    ):
        tiny_job("/nonexistent", {"a": "a", "b": "b"}, stages, seq_len=SEQ, global_batch_size=BATCH)


def test_exit_code_classes():
    assert classify(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer")) in RETRYABLE
    assert classify(RuntimeError("Timed out waiting 1800000ms for send operation to complete")) in RETRYABLE
    assert classify(FatalError("loss is nan")) in FATAL
    assert not set(FATAL) & set(RETRYABLE) and 0 not in FATAL | RETRYABLE


def test_exit_code_classes_go_by_type_before_message():
    """A message match alone once retried these forever: their paths and keys merely contain "store",
    "socket" or "timeout"."""
    import errno

    import torch

    assert classify(FileNotFoundError(2, "No such file or directory", "/mnt/datastore/shards/index.json")) in FATAL
    assert classify(KeyError("socket_timeout")) in FATAL
    assert classify(ValueError("tokenizer store path timeout.json is not a directory")) in FATAL
    assert classify(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")) in FATAL
    assert classify(OSError(errno.ENOSPC, "No space left on device")) in FATAL
    assert classify(torch.distributed.DistNetworkError("recv failed")) in RETRYABLE
    assert classify(torch.distributed.DistStoreError("wait timeout")) in RETRYABLE
    assert classify(ConnectionResetError(errno.ECONNRESET, "reset")) in RETRYABLE


def test_presets_param_count_and_flops():
    from trainers.model import PRESETS, build_model, flops_per_token, matmul_params

    tiny = build_model(PRESETS["tiny"], 50277, 128, 0, seed=0)
    assert tiny.get_input_embeddings().weight.shape[0] == 50304  # padded to a multiple of 128
    assert sum(p.numel() for p in tiny.parameters()) == PRESETS["tiny"].total_params(50277)
    f = flops_per_token(PRESETS["tiny"], 50277, 128)
    # FLOPs count useful work: the head's 27 padded rows multiply every token too, but no token needs them
    assert f.dense == 6 * (matmul_params(tiny) - 27 * 64)
    assert f.attention == 12 * 2 * 128 * 64
    # The GPT-3-style names are honest about size (tied NeoX vocabulary).
    for name, low, high in [("125m", 115e6, 135e6), ("350m", 330e6, 370e6), ("1b", 1.2e9, 1.4e9), ("7b", 6.5e9, 7.0e9)]:
        assert low < PRESETS[name].total_params(50277) < high, name


def test_lr_schedule_is_global_across_stages():
    train = TrainConfig(
        stages=STAGES,
        optim={"lr": 1.0, "warmup_tokens": 2 * STEP, "schedule": "cosine", "min_lr_ratio": 0.1},
    )
    lrs = [lr_multiplier(train, t, STEP) for t in range(0, 16 * STEP, STEP)]
    assert lrs[0] == pytest.approx(0.5) and lrs[1] == pytest.approx(1.0)  # warmup ends at step 2
    base = [lr / (0.5 if t >= 10 * STEP else 1.0) for lr, t in zip(lrs, range(0, 16 * STEP, STEP))]
    assert all(a >= b for a, b in zip(base[1:], base[2:]))  # one monotone decay, no restart at stage 2
    assert lrs[-1] == pytest.approx(0.5 * 0.1)  # reaches min_lr_ratio (x stage scale) at the last step
    assert stage_bounds(train) == [(0, 10 * STEP), (10 * STEP, 16 * STEP)]


def test_anneal_stage_decays_to_min_from_where_the_schedule_was():
    stages = [
        StageConfig(name="main", tokens=8 * STEP, mixture={"a": 1.0}),
        StageConfig(name="anneal", tokens=4 * STEP, mixture={"b": 1.0}, anneal=True),
    ]
    train = TrainConfig(stages=stages, optim={"lr": 1.0, "schedule": "constant", "min_lr_ratio": 0.1})
    lrs = [lr_multiplier(train, t, STEP) for t in range(0, 12 * STEP, STEP)]
    assert lrs[:8] == [1.0] * 8
    assert lrs[8:] == pytest.approx([1 - 0.9 * k / 4 for k in (1, 2, 3, 4)])


def test_init_from_copies_weights_and_refuses_a_mismatch(tmp_path):
    import torch

    from trainers.model import build_model, load_weights_from

    build_model(ModelConfig(), 512, 32, 0, seed=1).save_pretrained(tmp_path / "hf")
    fresh = load_weights_from(build_model(ModelConfig(), 512, 32, 0, seed=2), str(tmp_path / "hf"))
    source = build_model(ModelConfig(), 512, 32, 0, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), source.state_dict().values()))
    with pytest.raises(FatalError, match=r"model\.init_from: .* num_hidden_layers=2 .* n_layers=3"):
        load_weights_from(build_model(ModelConfig(n_layers=3), 512, 32, 0, seed=2), str(tmp_path / "hf"))


def test_a_model_a_checkpoint_will_overwrite_is_allocated_without_an_init():
    import torch

    from tests.conftest import TensorOps
    from trainers.model import build_model, build_model_to_load

    with TensorOps() as initialised:
        reference = build_model(ModelConfig(), 512, 32, 0, seed=1)
    assert {"normal_", "uniform_"} & initialised.ops  # the check sees an init when there is one
    with TensorOps() as allocated:
        model = build_model_to_load(ModelConfig(), 512, 32, 0)
    assert not {"normal_", "uniform_", "fill_", "zero_"} & allocated.ops, sorted(allocated.ops)
    assert not any(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # RoPE's inverse frequencies are never saved: they must be computed, not left uninitialised.
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    model.load_state_dict(reference.state_dict())
    ids = torch.randint(0, 512, (2, 16))
    assert torch.equal(model(ids).logits, reference(ids).logits)


def test_loss_guard_flags_nan_and_spikes_with_the_rollback_point():
    from types import SimpleNamespace

    from trainers.callbacks import LossGuard
    from trainers.config import LossGuardConfig
    from trainers.exit_codes import LossAnomaly

    saver = SimpleNamespace(last_saved_tokens=None)
    guard = LossGuard(LossGuardConfig(spike_factor=2.0, warmup_steps=3), 1, 1000, 8, saver, vocab_size=512)

    def step(loss, tokens):
        guard.batch_end(
            SimpleNamespace(total_loss_dict={"loss/train/total": loss}, timestamp=SimpleNamespace(token=tokens)), None
        )

    for k, loss in enumerate([4.0, 4.1, 3.9, 4.0, 7.9]):  # 7.9 < 2x the running mean: no spike
        step(loss, 1000 + 100 * (k + 1))
    saver.last_saved_tokens = 1400  # a checkpoint this launch saved: the rollback point moves, skip resets
    with pytest.raises(LossAnomaly) as spike:
        step(9.5, 1600)
    assert (spike.value.tokens, spike.value.resume_tokens, spike.value.already_skipped) == (1600, 1400, 0)
    with pytest.raises(LossAnomaly, match="loss is nan at 1700 tokens"):
        step(float("nan"), 1700)


def test_the_default_loss_guard_stops_a_loss_no_training_state_reaches():
    """A flipped byte in an optimizer moment once sent the loss from 7.8 to 3e8 and the default guard (NaN/inf
    only) let every later checkpoint be published from the ruined run."""
    import math
    from types import SimpleNamespace

    from trainers.callbacks import LossGuard
    from trainers.config import LossGuardConfig
    from trainers.exit_codes import LossAnomaly

    guard = LossGuard(LossGuardConfig(), 0, 0, 0, SimpleNamespace(last_saved_tokens=None), vocab_size=50304)
    state = lambda loss: SimpleNamespace(total_loss_dict={"loss": loss}, timestamp=SimpleNamespace(token=2048))  # noqa: E731
    guard.batch_end(state(10.9), None)  # a fresh model's loss is about ln(50304) = 10.8: fine
    guard.batch_end(state(7.8), None)
    with pytest.raises(LossAnomaly, match=r"loss is 3e\+08 at 2048 tokens, above the ceiling 32\.48"):
        guard.batch_end(state(3e8), None)
    assert guard.ceiling == pytest.approx(3 * math.log(50304))
    off = LossGuard(LossGuardConfig(ceiling=None), 0, 0, 0, SimpleNamespace(last_saved_tokens=None), vocab_size=512)
    off.batch_end(state(3e8), None)  # turned off: only NaN/inf (and spike_factor, if set) stop it


@pytest.mark.parametrize("sharding", ["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"])
def test_sharding_settings_parse_as_composer_fsdp2_config(monkeypatch, sharding):
    """What Composer's own parser makes of each recipe setting (the runs themselves are the end-to-end tests)."""
    import torch
    from composer import Trainer
    from composer.utils.parallelism import FSDP2Config

    from tests.support.training import tiny_job
    from trainers.model import build_model_on_meta
    from trainers.sharding import parallelism_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # HYBRID_SHARD needs NCCL; the rest run on CPU
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    job = tiny_job(
        "/unused", {"a": "unused"}, STAGES[:1], parallelism={"sharding": sharding, "activation_checkpointing": True}
    )
    model = build_model_on_meta(job.model, 512, SEQ, 0)
    config = parallelism_config(job.train.parallelism, model, 4, "tiny-s0-tok{token}")
    if sharding == "NO_SHARD":
        assert config is None  # Composer wraps the model in DDP
        return
    parsed = Trainer._parse_parallelism_config(None, config).fsdp2
    assert isinstance(parsed, FSDP2Config)
    assert (parsed.state_dict_type, parsed.activation_checkpointing, parsed.mixed_precision) == (
        "sharded",
        True,
        "DEFAULT",
    )
    assert parsed.reshard_after_forward == (sharding != "SHARD_GRAD_OP")
    assert parsed.sharded_ckpt_prefix_dir == "tiny-s0-tok{token}"  # the run's own names, not ep{epoch}-ba{batch}
    assert (parsed.data_parallel_replicate_degree, parsed.data_parallel_shard_degree) == (
        (2, 2) if sharding == "HYBRID_SHARD" else (None, -1)
    )
    assert all(layer._fsdp_wrap and layer._activation_checkpointing for layer in model.model.layers)
    assert all(p.is_meta for p in model.parameters())  # nothing allocated before sharding


def test_hybrid_sharding_on_cpu_ranks_is_one_line_fatal():
    from tests.support.training import tiny_job
    from trainers.model import build_model_on_meta
    from trainers.sharding import parallelism_config

    job = tiny_job("/unused", {"a": "unused"}, STAGES[:1], parallelism={"sharding": "HYBRID_SHARD"})
    with pytest.raises(FatalError, match=r"HYBRID_SHARD needs GPUs .*use FULL_SHARD on CPU ranks"):
        parallelism_config(job.train.parallelism, build_model_on_meta(job.model, 512, SEQ, 0), 4, "x")


def test_init_is_the_same_whole_and_as_shards():
    """init_weights draws each parameter whole from its own seed: a rank that holds a slice holds exactly that
    slice of what one process draws, whatever the number of ranks."""
    import torch

    from trainers.config import ModelConfig
    from trainers.model import build_model, build_model_to_load, init_weights

    whole = build_model(ModelConfig(), 512, 32, 0, seed=5)
    again = build_model_to_load(ModelConfig(), 512, 32, 0)
    init_weights(again, 0.02, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), again.state_dict().values()))
    other = build_model(ModelConfig(), 512, 32, 0, seed=6)
    assert not torch.equal(whole.model.embed_tokens.weight, other.model.embed_tokens.weight)
    weight = whole.model.layers[0].mlp.up_proj.weight
    assert abs(float(weight.std()) - 0.02) < 0.002 and torch.equal(whole.model.norm.weight, torch.ones(64))


def test_a_manifest_is_written_only_after_its_checkpoint_reached_the_disk(tmp_path, monkeypatch):
    """Power loss or a node crash must not leave a manifest naming bytes still in the page cache: the
    checkpoint and its directory are fsynced before the manifest exists, the manifest folder after."""
    import os

    from trainers.format.checkpoints import CheckpointInfo, manifest_path, publish

    synced: list[tuple[str, bool]] = []  # (what was fsynced, did the manifest exist yet)
    real_fsync = os.fsync
    target = manifest_path(tmp_path, 1024)

    def recording_fsync(fd):
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), target.exists()))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    ckpt = tmp_path / "tiny-s0-tok1024-rank0.pt"
    ckpt.write_bytes(b"x" * 1000)
    publish(tmp_path, CheckpointInfo(path=str(ckpt), tokens=1024, batch=1, stage="warm", stage_index=0))
    assert synced[:2] == [(str(ckpt), False), (str(tmp_path), False)]
    assert synced[-1] == (str(target.parent), True)


def test_a_checkpoint_swapped_for_another_valid_one_fails_its_published_sha256(tmp_path):
    import hashlib

    import torch

    from trainers.format.checkpoints import CheckpointInfo, damage, list_complete, publish

    mine, other = tmp_path / "tiny-s0-tok1024-rank0.pt", tmp_path / "other.pt"
    torch.save({"w": torch.zeros(64)}, mine)
    torch.save({"w": torch.ones(64)}, other)
    published = publish(tmp_path, CheckpointInfo(path=str(mine), tokens=1024, batch=1, stage="warm", stage_index=0))
    assert published.sha256 == hashlib.sha256(mine.read_bytes()).hexdigest() == list_complete(tmp_path)[0].sha256
    assert damage(mine, published.sha256) is None
    mine.write_bytes(other.read_bytes())  # a complete, valid checkpoint: just not the one published
    assert damage(mine) is None  # every zip CRC is right
    assert damage(mine, published.sha256).startswith("SHA-256 ")


def test_keep_last_k_removes_oldest_complete_checkpoints(tmp_path):
    from tests.support.training import tiny_job
    from trainers.format.checkpoints import CheckpointInfo, list_complete, publish
    from trainers.saver import PublishingCheckpointSaver

    job = tiny_job(
        tmp_path, {"a": "unused", "b": "unused"}, STAGES, seq_len=SEQ, global_batch_size=BATCH, keep_checkpoints=2
    )
    Path(job.save_folder).mkdir(parents=True)
    for tokens in (1024, 2048, 2560):
        path = Path(job.save_folder) / f"tiny-s0-tok{tokens}-rank0.pt"
        path.write_bytes(b"x")
        publish(
            job.save_folder,
            CheckpointInfo(path=str(path), tokens=tokens, batch=tokens // STEP, stage="warm", stage_index=0),
        )
    other = Path(job.save_folder) / "other-s0-tok512-rank0.pt"  # another run sharing the folder keeps its own
    other.write_bytes(b"x")
    publish(job.save_folder, CheckpointInfo(path=str(other), tokens=512, batch=1, stage="warm", stage_index=0))
    saver = PublishingCheckpointSaver(job, 0)
    saver.run_folder.keep_last(saver.keep_last_k)
    assert [c.tokens for c in list_complete(job.save_folder)] == [512, 2048, 2560]
    assert not (Path(job.save_folder) / "tiny-s0-tok1024-rank0.pt").exists()


def test_keep_last_k_retires_sharded_folders_whole_and_a_withdrawn_one_is_kept_aside(tmp_path):
    from trainers.format.checkpoints import CheckpointInfo, list_complete, publish, shard_files
    from trainers.layout import RunFolder

    folder = RunFolder(tmp_path, "tiny")
    for tokens in (1024, 2048, 2560):
        ckpt = tmp_path / f"tiny-s0-tok{tokens}"
        ckpt.mkdir()
        for name in (".metadata", "__0_0.distcp", "__1_0.distcp"):
            (ckpt / name).write_bytes(name.encode() * tokens)
        files = shard_files(ckpt, [".metadata", "__0_0.distcp", "__1_0.distcp"])
        info = CheckpointInfo(path=str(ckpt), tokens=tokens, batch=tokens // STEP, stage="warm", stage_index=0)
        publish(tmp_path, info.model_copy(update={"files": files}))
    sizes = [sum(f.stat().st_size for f in Path(c.path).iterdir()) for c in folder.complete()]
    assert [c.size for c in folder.complete()] == sizes and sizes[0] == 1024 * (9 + 12 + 12)
    folder.keep_last(2)
    assert [c.tokens for c in list_complete(tmp_path)] == [2048, 2560]
    assert not (tmp_path / "tiny-s0-tok1024").exists() and not list(tmp_path.glob(".removing-*"))
    newest = list_complete(tmp_path)[-1]
    folder.withdraw(newest, "test")
    assert [c.tokens for c in list_complete(tmp_path)] == [2048]
    assert sorted(p.name for p in (tmp_path / "tiny-s0-tok2560.corrupt").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    assert [t for _, t, _ in folder.files()] == [2048]  # the set-aside folder is no checkpoint of the run


# ---------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    from tests.support.training import two_sources

    return two_sources(tmp_path_factory.mktemp("data"), SEQ)  # b_val: 3 batches held out from b, scored at checkpoints


def _job(root: Path, sources, **kw):
    from tests.support.training import tiny_job, write_job

    # Every run also scores b's held-out split at each checkpoint, so the exactness tests cover evaluation too.
    kw.setdefault("val_streams", {"b": str(Path(sources["b"]).parent / "b_val")})
    kw.setdefault("val_batches", 3)
    job = tiny_job(
        root,
        sources,
        kw.pop("stages", STAGES),
        seq_len=SEQ,
        global_batch_size=BATCH,
        checkpoint_every_tokens=4 * STEP,
        **kw,
    )
    return job, write_job(job, root / "job.json")


def _launch(job_path, stage, log, fault=None, procs=1, fault_rank=None, env=None):
    from tests.support.training import run_stage

    env = {"TESSERA_SAMPLE_LOG": str(log), **(env or {})}
    if fault:
        env["TESSERA_FAULT"] = fault
    if fault_rank is not None:
        env["TESSERA_FAULT_RANK"] = str(fault_rank)
    return run_stage(job_path, stage, procs=procs, env=env)


def _ok(proc, logs: Path | None = None):
    ranks = "".join(f"\n--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(logs.glob("*.err"))) if logs else ""
    assert proc.returncode == 0, proc.stderr[-3000:] + ranks


def _killed(proc):
    assert proc.returncode == -9, proc.stderr[-3000:]


def _same_samples_once_each(reference, log: Path) -> None:
    """The effective history equals the uninterrupted reference's, and each stage used every sample once."""
    from trainers.faults import read_sample_log

    effective = read_sample_log(log)
    assert effective == read_sample_log(reference[1] / "samples.jsonl")
    for lo, hi, n in [(0, 2560, 80), (2560, 4096, 48)]:
        seen = [i for t, r in effective.items() if lo < t <= hi for i in r["samples"][0]]
        assert len(seen) == len(set(seen)) == n


def _matches_one_process_stage_1(reference, log: Path) -> None:
    """Stage 1 of a multi-rank run: each step drew the reference's samples (split over ranks), same loss."""
    from trainers.faults import read_sample_log

    _, ref_root = reference
    ref = {t: r for t, r in read_sample_log(ref_root / "samples.jsonl").items() if t <= 2560}
    two = read_sample_log(log)
    assert list(two) == list(ref)
    for t in ref:
        assert sorted(sum(two[t]["samples"], [])) == sorted(ref[t]["samples"][0])
        assert math.isclose(two[t]["loss"], ref[t]["loss"], rel_tol=1e-5), t


def _model_state(path):
    import torch

    return torch.load(path, map_location="cpu", weights_only=False)["state"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, sources):
    """The two-stage tiny recipe trained without interruption."""
    root = tmp_path_factory.mktemp("ref")
    job, job_path = _job(root, sources)
    for stage in (0, 1):
        _ok(_launch(job_path, stage, root / "samples.jsonl"))
    return job, root


@pytest.mark.slow
def test_stage_saves_publishes_autoresumes_and_exports(tmp_path, sources, mlflow_uri):
    from mlflow.tracking import MlflowClient

    from tests.support.training import write_hf_tokenizer
    from trainers.config import MlflowTarget
    from trainers.format.checkpoints import list_complete
    from trainers.format.export import export_hf

    client = MlflowClient(mlflow_uri)
    run_id = client.create_run(client.create_experiment("t")).info.run_id
    tok = write_hf_tokenizer(tmp_path / "tok", vocab_size=512)
    job, job_path = _job(
        tmp_path,
        sources,
        stages=STAGES[:1],
        tokenizer_dir=str(tok),
        vocab_size=512,
        mlflow=MlflowTarget(tracking_uri=mlflow_uri, run_id=run_id),
    )
    val = job.val_streams["b"]
    log = tmp_path / "samples.jsonl"

    # Metrics reach MLflow every step, so steps 5-7 are logged before the kill and re-trained after it.
    _killed(_launch(job_path, 0, log, fault="step:1792", env={"TESSERA_METRICS_FLUSH_S": "0"}))
    assert [c.tokens for c in list_complete(job.save_folder)] == [1024]

    _ok(_launch(job_path, 0, log))
    done = list_complete(job.save_folder)
    assert [(c.tokens, c.batch, c.stage, c.stage_index) for c in done] == [
        (1024, 4, "warm", 0),
        (2048, 8, "warm", 0),
        (2560, 10, "warm", 0),
    ]
    lines = log.read_text().splitlines()
    # The relaunch resumed at the checkpoint: it re-trained steps 5..10 only, no replay from 0.
    assert [json.loads(x)["tokens"] for x in lines] == [t * STEP for t in range(1, 8)] + [
        t * STEP for t in range(5, 11)
    ]

    again = _launch(job_path, 0, log)  # a finished stage is a no-op
    _ok(again)
    assert [c.tokens for c in list_complete(job.save_folder)] == [1024, 2048, 2560]

    steps = [m.step for m in client.get_metric_history(run_id, "train/loss")]
    assert sorted(steps) == [t * STEP for t in range(1, 11)]  # each step once: the relaunch skipped 5-7
    metrics = client.get_run(run_id).data.metrics
    assert {"train/loss", "train/lr", "throughput/tokens_per_sec"} <= set(metrics)
    assert client.get_run(run_id).data.tags["stage/warm/start_tokens"] == "0"
    assert client.get_run(run_id).data.tags["stage/warm/end_tokens"] == "2560"

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = export_hf(done[-1].path, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(out)

    # Held-out loss at each checkpoint, scored before the save: it is the checkpoint's own loss on b_val.
    val_loss = {m.step: m.value for m in client.get_metric_history(run_id, "val/b/loss")}
    assert sorted(val_loss) == [1024, 2048, 2560]
    import numpy as np
    from streaming import StreamingDataset

    held_out = StreamingDataset(local=str(val), shuffle=False)
    ids = torch.tensor(np.stack([held_out[i]["tokens"] for i in range(24)]).astype(np.int64))
    first = AutoModelForCausalLM.from_pretrained(export_hf(done[0].path, tmp_path / "hf1024"))
    with torch.no_grad():  # mean CE over all 24 x 31 predicted tokens
        expected = {2560: hf(input_ids=ids, labels=ids).loss.item(), 1024: first(input_ids=ids, labels=ids).loss.item()}
    assert val_loss[2560] == pytest.approx(expected[2560], rel=1e-5)
    assert val_loss[1024] == pytest.approx(expected[1024], rel=1e-5)
    assert val_loss[1024] != val_loss[2560]
    assert AutoTokenizer.from_pretrained(out)("hello world")["input_ids"]
    weights = _model_state(done[-1].path)["model"]
    for name, tensor in hf.state_dict().items():
        assert torch.equal(tensor, weights[f"model.{name}"]), name


@pytest.mark.slow
def test_two_stage_curriculum_continues_schedule_and_optimizer(reference):
    from trainers.faults import read_sample_log
    from trainers.format.checkpoints import list_complete

    job, root = reference
    done = list_complete(job.save_folder)
    assert [(c.tokens, c.stage) for c in done] == list(zip(CKPT_TOKENS, ["warm"] * 3 + ["mix"] * 2))

    steps = read_sample_log(root / "samples.jsonl")
    assert list(steps) == STEPS
    warm = [i for t, r in steps.items() if t <= 2560 for i in r["samples"][0]]
    mix = [i for t, r in steps.items() if t > 2560 for i in r["samples"][0]]
    assert len(set(warm)) == len(warm) == 80 and max(warm) < 200  # stage 1 reads only source a
    assert len(set(mix)) == len(mix) == 48 and all(len(r["samples"][0]) == 16 for t, r in steps.items() if t > 2560)
    assert sum(i >= 200 for i in mix) == 24  # 50/50: b's samples follow a's 200 in the index space

    # Optimizer state carried across the stage switch: Adam's step counter did not restart.
    end = _model_state(done[-1].path)
    assert end["timestamp"]["Timestamp"]["batch"] == 13
    assert all(int(s["step"]) == 13 for s in end["optimizers"]["AdamW"]["state"].values())


@pytest.mark.slow
def test_editing_a_trained_stage_is_refused_appending_is_allowed(reference, tmp_path):
    from trainers.plan import plan_start

    job, root = reference
    edited = job.model_copy(
        update={
            "train": job.train.model_copy(
                update={"stages": [STAGES[0].model_copy(update={"tokens": 12 * STEP}), STAGES[1]]}
            )
        }
    )
    with pytest.raises(FatalError, match=r"train\.stages\[0\]\.tokens: stage 'warm' was already trained"):
        plan_start(edited, 1)

    appended = job.model_copy(
        update={
            "train": job.train.model_copy(
                update={"stages": [*STAGES, StageConfig(name="anneal", tokens=2 * STEP, mixture={"b": 1.0})]}
            )
        }
    )
    plan = plan_start(appended, 2)
    assert (plan.kind, plan.tokens) == ("enter", 4096)


@pytest.mark.slow
def test_kill9_anywhere_resumes_bitwise_exact(reference, tmp_path, sources):
    """kill -9 mid-step, mid-save and inside stage 2 (plus a corrupted checkpoint): same weights, same samples."""
    import torch

    from trainers.format.checkpoints import list_complete

    job, job_path = _job(tmp_path, sources)
    log = tmp_path / "samples.jsonl"
    assert _launch(job_path, 0, log, fault="step:1792").returncode == -9
    assert _launch(job_path, 0, log, fault="save:2048").returncode == -9  # file half-written, no manifest
    partial = Path(job.save_folder) / "tiny-s0-tok2048-rank0.pt"
    assert partial.exists() and [c.tokens for c in list_complete(job.save_folder)] == [1024]
    _ok(_launch(job_path, 0, log))
    assert _launch(job_path, 1, log, fault="step:3584").returncode == -9
    # Bit rot in the newest complete checkpoint: the relaunch must notice and fall back.
    newest = Path(list_complete(job.save_folder)[-1].path)
    newest.write_bytes(newest.read_bytes()[:-100])
    _ok(_launch(job_path, 1, log))

    ref_job, _ = reference
    _same_samples_once_each(reference, log)
    assert [c.tokens for c in list_complete(job.save_folder)] == CKPT_TOKENS
    mine = _model_state(list_complete(job.save_folder)[-1].path)
    ref = _model_state(list_complete(ref_job.save_folder)[-1].path)
    for name, tensor in ref["model"].items():
        assert torch.equal(mine["model"][name], tensor), name
    for key, state in ref["optimizers"]["AdamW"]["state"].items():
        assert torch.equal(mine["optimizers"]["AdamW"]["state"][key]["exp_avg_sq"], state["exp_avg_sq"])


@pytest.mark.slow
def test_flipped_bytes_in_a_checkpoint_are_caught_and_the_previous_one_used(reference, tmp_path, sources):
    """64 bytes flipped mid-file (a tensor, which torch.load would load silently), then bytes flipped in the
    pickle (which failed every relaunch): each relaunch withdraws the damaged newest checkpoint, starts
    from the one before, and the run ends with the reference's weights and samples."""
    import zipfile

    import torch

    from trainers.format.checkpoints import list_complete

    def flip(path: Path, offset: int) -> None:
        data = bytearray(path.read_bytes())
        data[offset : offset + 64] = bytes(b ^ 0xFF for b in data[offset : offset + 64])
        path.write_bytes(bytes(data))

    job, job_path = _job(tmp_path, sources)
    log = tmp_path / "samples.jsonl"
    assert _launch(job_path, 0, log, fault="step:2304").returncode == -9  # after the 2048 checkpoint
    newest = Path(list_complete(job.save_folder)[-1].path)
    assert newest.name == "tiny-s0-tok2048-rank0.pt"
    flip(newest, newest.stat().st_size // 2)
    other_run = Path(job.save_folder) / "other-s0-tok1024-rank0.pt.corrupt"  # a run sharing the folder
    other_run.write_bytes(b"kept for its own run's post-mortem")
    _ok(_launch(job_path, 0, log))  # resumed from 1024, retrained 2048
    assert (newest.parent / (newest.name + ".corrupt")).is_file()

    _killed(_launch(job_path, 1, log, fault="step:3584"))  # after the 3072 checkpoint
    newest = Path(list_complete(job.save_folder)[-1].path)
    with zipfile.ZipFile(newest) as zf:
        pickle = next(i for i in zf.infolist() if i.filename.endswith("data.pkl"))
    flip(newest, pickle.header_offset + 30 + len(pickle.filename) + pickle.compress_size // 2)
    _ok(_launch(job_path, 1, log))  # re-entered stage 1 from stage 0's end
    corrupt = sorted(p.name for p in Path(job.save_folder).glob("*.corrupt"))
    assert corrupt == [other_run.name, newest.name + ".corrupt"]  # this run's newest kept, the other run's untouched
    assert [c.tokens for c in list_complete(job.save_folder)] == CKPT_TOKENS

    ref_job, _ = reference
    _same_samples_once_each(reference, log)
    mine = _model_state(list_complete(job.save_folder)[-1].path)
    ref = _model_state(list_complete(ref_job.save_folder)[-1].path)
    assert all(torch.equal(mine["model"][k], v) for k, v in ref["model"].items())


class _OpensAFile:
    """A pickled value that creates a file when it is unpickled."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.slow
def test_a_checkpoint_that_would_run_code_stops_the_trainer_in_one_line(tmp_path, sources):
    """A checkpoint planted in the save folder (its manifest's SHA-256 made to match) is read by Composer's own
    resume through the weights-only unpickler: the trainer exits fatal naming the file; the payload never runs."""
    import json

    import torch

    from trainers.format.checkpoints import file_sha256, list_complete, manifest_path
    from trainers.format.safe_load import load

    job, job_path = _job(tmp_path, sources)
    log = tmp_path / "samples.jsonl"
    assert _launch(job_path, 0, log, fault="step:2304").returncode == -9  # after the 2048 checkpoint
    newest = list_complete(job.save_folder)[-1]
    marker = tmp_path / "payload-ran"
    state = load(newest.path)
    state["state"]["metadata"]["note"] = _OpensAFile(marker)
    torch.save(state, newest.path)
    manifest = manifest_path(job.save_folder, newest.tokens)
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "sha256": file_sha256(newest.path)}))

    proc = _launch(job_path, 0, log)
    assert proc.returncode == 78, proc.stderr[-3000:]
    assert (
        f"tessera.train: fatal: {newest.path}: refused to load: unpickling it needs `io.open`, which can run code "
        "when loaded; pass --trust-checkpoint only for a file you made or trust"
    ) in proc.stderr
    assert not marker.exists()


@pytest.mark.slow
def test_lost_manifests_are_rederived_and_no_good_checkpoint_is_deleted(reference, tmp_path, sources):
    """The manifests/ folder is lost during the second stage: the relaunch used to delete every checkpoint
    (then fail "train stage 0 first"). Now each one that verifies gets its manifest back and the run goes on."""
    import shutil

    import torch

    from trainers.format.checkpoints import MANIFEST_DIR, list_complete

    job, job_path = _job(tmp_path, sources)
    log = tmp_path / "samples.jsonl"
    _ok(_launch(job_path, 0, log))
    _killed(_launch(job_path, 1, log, fault="step:3584"))  # after the 3072 checkpoint
    before = {c.tokens: (c.batch, os.stat(c.path).st_ino) for c in list_complete(job.save_folder)}
    assert list(before) == [1024, 2048, 2560, 3072]
    shutil.rmtree(Path(job.save_folder) / MANIFEST_DIR)

    _ok(_launch(job_path, 1, log))
    after = {c.tokens: c for c in list_complete(job.save_folder)}
    assert list(after) == CKPT_TOKENS
    # the same files, with the step counts they were saved at
    assert all((after[t].batch, os.stat(after[t].path).st_ino) == before[t] for t in before)
    ref_job, _ = reference
    _same_samples_once_each(reference, log)
    mine = _model_state(after[CKPT_TOKENS[-1]].path)
    ref = _model_state(list_complete(ref_job.save_folder)[-1].path)
    assert all(torch.equal(mine["model"][k], v) for k, v in ref["model"].items())


@pytest.mark.slow
def test_a_resume_inside_a_stage_draws_the_random_numbers_it_saved(tmp_path, sources):
    """Dropout on: killed mid-stage and resumed, the run ends bit for bit where an uninterrupted one does.

    Composer restores a checkpoint's RNG state only at an epoch start; without trainers/rng.py the
    resumed steps draw other dropout masks and the weights differ.
    """
    import torch

    from trainers.config import ModelConfig
    from trainers.format.checkpoints import list_complete

    stage_1 = STAGES[:1]  # the LR horizon is the whole curriculum: both runs get the same one
    runs = {}
    for name in ("uninterrupted", "killed"):
        (tmp_path / name).mkdir()
        runs[name] = _job(tmp_path / name, sources, stages=stage_1, model=ModelConfig(attention_dropout=0.2))
    _ok(_launch(runs["uninterrupted"][1], 0, tmp_path / "uninterrupted.jsonl"))
    job, job_path = runs["killed"]
    _killed(_launch(job_path, 0, tmp_path / "killed.jsonl", fault="step:1792"))
    assert [c.tokens for c in list_complete(job.save_folder)] == [1024]  # the resume is inside the stage
    _ok(_launch(job_path, 0, tmp_path / "killed.jsonl"))

    mine = _model_state(list_complete(job.save_folder)[-1].path)["model"]
    ref = _model_state(list_complete(runs["uninterrupted"][0].save_folder)[-1].path)["model"]
    assert mine.keys() == ref.keys()
    assert all(torch.equal(mine[k], ref[k]) for k in ref), [k for k in ref if not torch.equal(mine[k], ref[k])]


@pytest.mark.slow
def test_two_ranks_survive_a_lost_peer_and_match_one_rank(reference, tmp_path, sources):
    """FSDP2 over gloo, 2 processes under the launcher (infra/launcher.py, no restart in place): rank 1 is SIGKILLed
    after step 5; the launcher names rank 1's SIGKILL, not rank 0's answer to it; the relaunch resumes at 1024
    tokens; samples and losses match the 1-process run."""
    import signal

    from infra.launch_outcome import read_records

    job, job_path = _job(tmp_path, sources)  # both stages: the LR horizon must match the reference's
    log = tmp_path / "samples.jsonl"
    lost = _launch(job_path, 0, log, fault="step:1280", procs=2, fault_rank=1)
    # Rank 0 exits RETRYABLE when it saw the lost peer in a collective first, INTERRUPTED when the agent's SIGTERM
    # (sent on seeing rank 1 die) reached it first: either way the cause is rank 1's kill, and the launcher exits as
    # a shell reports a SIGKILL.
    assert lost.returncode == 128 + signal.SIGKILL, lost.stdout[-3000:] + lost.stderr[-3000:]
    _, end = read_records(lost.stdout)
    assert end is not None and (end["rank"], end["code"]) == (1, -signal.SIGKILL), end
    assert end["codes"]["0"] in RETRYABLE | INTERRUPTED, end
    relaunch = _launch(job_path, 0, log, procs=2)
    if relaunch.returncode == ExitCode.RETRYABLE:
        # As the flow would: a retryable exit (on a busy box, the launcher's free-port pick can lose a
        # race and fail the rendezvous) is relaunched. Resumption makes that harmless.
        relaunch = _launch(job_path, 0, log, procs=2)
    _ok(relaunch, tmp_path / "logs")
    _matches_one_process_stage_1(reference, log)


@pytest.mark.slow
def test_nan_loss_rolls_back_and_skips_the_bad_data(reference, tmp_path, sources):
    """A NaN at step 7 (last checkpoint at step 4): exit RETRYABLE, relaunch skips steps 5-7's samples."""
    from trainers.faults import read_sample_log
    from trainers.format.checkpoints import list_complete
    from trainers.layout import RunFolder
    from trainers.rollback import read_rollbacks

    job, job_path = _job(tmp_path, sources, loss_guard={"max_rollbacks": 1})
    log = tmp_path / "samples.jsonl"
    first = _launch(job_path, 0, log, fault="nan:1792")
    assert first.returncode == ExitCode.RETRYABLE, first.stderr[-2000:]
    assert [(r["resume_tokens"], r["skip_samples"], r["bad_tokens"]) for r in read_rollbacks(RunFolder.of(job))] == [
        (1024, 24, 1792)
    ]
    assert [c.tokens for c in list_complete(job.save_folder)] == [1024]  # the NaN step was never saved

    _ok(_launch(job_path, 0, log))
    ours = read_sample_log(log)
    ref = read_sample_log(reference[1] / "samples.jsonl")
    assert [ours[t]["samples"] for t in (256, 512, 768, 1024)] == [ref[t]["samples"] for t in (256, 512, 768, 1024)]
    # After the rollback, step 5 trains what the uninterrupted run saw at step 8: 3 steps of data skipped.
    assert [ours[t]["samples"] for t in (1280, 1536, 1792)] == [ref[t]["samples"] for t in (2048, 2304, 2560)]
    assert all(math.isfinite(r["loss"]) for r in ours.values())
    assert [c.tokens for c in list_complete(job.save_folder)] == [1024, 2048, 2560]

    # The rollback budget is spent: the next anomaly is fatal.
    again = _launch(job_path, 1, log, fault="nan:3584")
    assert again.returncode == ExitCode.FATAL and "max_rollbacks=1" in again.stderr


def test_missing_bucket_is_one_line_fatal(moto_s3):
    from trainers.remote import RemoteFolder

    with pytest.raises(
        FatalError, match=r"^train\.save_folder: s3://nowhere/runs/tiny: bucket 'nowhere' does not exist$"
    ):
        RemoteFolder("s3://nowhere/runs/tiny").complete()


@pytest.mark.slow
def test_s3_save_folder_resumes_on_a_fresh_node_bitwise_exact(reference, tmp_path, sources, moto_s3):
    """Checkpoints mirrored to a real S3 server (moto). Each relaunch after a kill starts with the local
    folder wiped, as on a new node, except one that must upload what a kill left unpublished remotely."""
    import shutil

    import torch

    from trainers.format.checkpoints import list_complete
    from trainers.remote import RemoteFolder

    moto_s3.create_bucket(Bucket="ckpts")
    job, job_path = _job(tmp_path, sources, save_folder="s3://ckpts/runs", keep_checkpoints=2)
    assert job.remote_folder == "s3://ckpts/runs/tiny"
    remote = RemoteFolder(job.remote_folder)
    log = tmp_path / "samples.jsonl"

    def wipe_local():
        shutil.rmtree(job.save_folder)

    # Killed after publishing 2048 locally, before its upload could start.
    _killed(_launch(job_path, 0, log, fault="published:2048"))
    assert 2048 not in [c.tokens for c in remote.complete()]
    # Same node: the relaunch first uploads what the remote lacks, then dies mid stage.
    _killed(_launch(job_path, 0, log, fault="step:2304"))
    assert [c.tokens for c in remote.complete()] == [1024, 2048]
    wipe_local()
    resumed = _launch(job_path, 0, log)  # a new node: downloads 2048, finishes the stage, uploads 2560
    _ok(resumed)
    assert "stage warm (0): resume at 2048 tokens" in resumed.stderr
    assert [c.tokens for c in remote.complete()] == [2048, 2560]  # keep_checkpoints=2, remotely too
    wipe_local()
    entered = _launch(job_path, 1, log, fault="step:3584")
    _killed(entered)
    assert "stage mix (1): enter at 2560 tokens" in entered.stderr
    # Same node again (whether 3072's upload beat the kill is timing; the relaunch makes sure it is up).
    resumed = _launch(job_path, 1, log)
    _ok(resumed)
    assert "stage mix (1): resume at 3072 tokens" in resumed.stderr

    done = remote.complete()
    assert [(c.tokens, c.stage) for c in done] == [(3072, "mix"), (4096, "mix")]
    assert all(c.path == f"s3://ckpts/runs/tiny/tiny-s1-tok{c.tokens}-rank0.pt" for c in done)
    names = {o["Key"] for o in moto_s3.list_objects_v2(Bucket="ckpts")["Contents"]}
    assert names == {
        "runs/tiny/tiny-stages.json",
        "runs/tiny/manifests/tok-000000003072.json",
        "runs/tiny/tiny-s1-tok3072-rank0.pt",
        "runs/tiny/manifests/tok-000000004096.json",
        "runs/tiny/tiny-s1-tok4096-rank0.pt",
    }
    assert [s["name"] for s in json.loads(remote.read_text("tiny-stages.json"))] == ["warm", "mix"]

    ref_job, _ = reference
    _same_samples_once_each(reference, log)
    wipe_local()
    remote.download(done[-1], Path(job.save_folder))
    mine = _model_state(list_complete(job.save_folder)[-1].path)
    ref = _model_state(list_complete(ref_job.save_folder)[-1].path)
    for name, tensor in ref["model"].items():
        assert torch.equal(mine["model"][name], tensor), name


@pytest.mark.slow
def test_a_stage_with_its_own_seq_len_reads_its_own_packing(tmp_path, sources):
    """Stage 2 trains on 64-token samples (data packed at 64) after 32-token stage 1; a kill inside it resumes."""
    from tests.support.training import write_mds
    from trainers.faults import read_sample_log
    from trainers.format.checkpoints import list_complete
    from trainers.format.export import export_hf

    long_a = str(write_mds(tmp_path / "a64", 60, 2 * SEQ, 256, seed=3))
    stages = [STAGES[0], StageConfig(name="long", tokens=4 * 2 * STEP, mixture={"a": 1.0}, seq_len=2 * SEQ)]
    job, job_path = _job(tmp_path, sources, stages=stages, seq_len_streams={2 * SEQ: {"a": long_a}})
    assert (job.stage(1).seq_len, job.max_seq_len, job.stage(1).tokens_per_batch) == (64, 64, 512)
    log = tmp_path / "samples.jsonl"
    _ok(_launch(job_path, 0, log))
    _killed(_launch(job_path, 1, log, fault="step:3584"))  # after the 3072 checkpoint
    _ok(_launch(job_path, 1, log))

    steps = read_sample_log(log)
    assert list(steps) == [t * STEP for t in range(1, 11)] + [2560 + k * 512 for k in range(1, 5)]
    long = [i for t, r in steps.items() if t > 2560 for i in r["samples"][0]]
    assert len(long) == len(set(long)) == 32 and max(long) < 60  # 2048 tokens of 64-token samples, once each
    assert [c.tokens for c in list_complete(job.save_folder)] == [1024, 2048, 2560, 3072, 4096, 4608]
    hf = export_hf(list_complete(job.save_folder)[-1].path, tmp_path / "hf")
    assert json.loads((Path(hf) / "config.json").read_text())["max_position_embeddings"] == 64

    missing = job.model_dump()
    missing["seq_len_streams"] = {}
    with pytest.raises(ValueError, match="stage 'long' mixes unknown sources at seq_len 64: a"):
        type(job).model_validate(missing)


def _launch_two_nodes(job, job_path, node1_disk: Path, log: Path, env: dict[str, str]) -> tuple[int, int]:
    """One rank per "node", two launchers (infra/launcher.py) meeting at node 0's rendezvous. Node 1 runs in its own
    mount namespace where the job's save folder is another directory and /dev/shm is its own: like pods on two
    hosts, the nodes share no checkpoint folder and no shared memory."""
    import os
    import shlex
    import socket

    from trainers.contract import WARM_MODULES

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TESSERA_SAMPLE_LOG": str(log), **env}
    procs = []
    for node in (0, 1):
        logs = Path(job_path).parent / f"node{node}"
        logs.mkdir(exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "infra.launcher",
            "--nproc-per-node",
            "1",
            "--nnodes",
            "2",
            "--node-rank",
            str(node),
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--local-addr",
            "127.0.0.1",
            "--log-dir",
            str(logs),
            "--warm",
            ",".join(WARM_MODULES),
            "-m",
            "trainers.train",
            "--job",
            str(job_path),
            "--stage",
            "0",
        ]
        if node == 1:
            folder = shlex.quote(job.save_folder)
            # Its own save folder, and its own /dev/shm: Streaming's shared memory is per host.
            mount = (
                f"mkdir -p {folder} && mount --bind {shlex.quote(str(node1_disk))} {folder} "
                "&& mount -t tmpfs tmpfs /dev/shm"
            )
            cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c", f"{mount} && exec {shlex.join(cmd)}"]
        with open(logs / "launcher.log", "ab") as out:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=out, stderr=subprocess.STDOUT))
    # a ceiling for a hung launch, not a speed bound: at load 10-15 one launch took over 300 s
    return tuple(p.wait(timeout=900) for p in procs)


@pytest.mark.slow
@pytest.mark.skipif(
    not can_unshare_mounts(), reason="needs `unshare -m` (a private mount namespace) to give node 1 its own disk"
)
@pytest.mark.timeout(2400)  # three two-node launches; each bounded above, the whole is not a speed claim
def test_two_nodes_without_a_shared_folder_resume_through_s3(reference, tmp_path, sources, moto_s3):
    """Rank 1 lives on "node 1", whose disk never sees rank 0's checkpoints. It is SIGKILLed after step 7;
    the relaunch plans on rank 0, hands the plan over the launch's store, node 1 fetches the checkpoint from
    s3 (slower than the process group's timeout), and the run finishes with the samples and losses of the one-process
    reference."""
    import os

    from trainers.remote import RemoteFolder

    moto_s3.create_bucket(Bucket="ckpts")
    job, job_path = _job(tmp_path, sources, stages=STAGES, save_folder="s3://ckpts/runs")
    node1_disk = tmp_path / "node1-disk"
    node1_disk.mkdir()
    log = tmp_path / "samples.jsonl"

    codes = _launch_two_nodes(job, job_path, node1_disk, log, {"TESSERA_FAULT": "step:1792", "TESSERA_FAULT_RANK": "1"})
    assert codes[0] == ExitCode.RETRYABLE, (codes, [p.read_text()[-3000:] for p in sorted(tmp_path.glob("node*/*"))])
    # FSDP2: each node's disk holds only what its own rank wrote; the s3 mirror is the one whole copy.
    assert sorted(p.name for p in node1_disk.glob("tiny-s0-tok1024/*")) == ["__1_0.distcp"]
    assert sorted(p.name for p in Path(job.save_folder).glob("tiny-s0-tok1024/*")) == [".metadata", "__0_0.distcp"]
    # Node 1's fetch outlasts the process group's timeout (a large checkpoint): setting up waits on the
    # launch's store, not in a collective, so nobody gives up.
    slow = {"TESSERA_DIST_TIMEOUT": "20", "TESSERA_FAULT": "stall-node:30", "TESSERA_FAULT_RANK": "1"}
    codes = _launch_two_nodes(job, job_path, node1_disk, log, slow)
    if codes[0] == ExitCode.RETRYABLE:  # as the flow would: a lost rendezvous race on a busy box is retried
        codes = _launch_two_nodes(job, job_path, node1_disk, log, slow)
    err = "".join(
        p.read_text()[-2000:] for p in sorted(tmp_path.glob("node*/*.err")) + sorted(tmp_path.glob("node*/*.log"))
    )
    assert codes == (0, 0), err

    # Node 1 resumed from the checkpoint whose other files it downloaded into its own disk.
    fetched = node1_disk / "tiny-s0-tok1024"
    assert sorted(p.name for p in fetched.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert os.readlink(node1_disk / "latest-tiny-s0-rank0.pt") == fetched.name
    assert [c.tokens for c in RemoteFolder(job.remote_folder).complete()] == [1024, 2048, 2560]

    _matches_one_process_stage_1(reference, log)
