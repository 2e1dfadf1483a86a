"""Sharded training for real: FSDP2 on CPU ranks over gloo, sharded checkpoint folders, resharding on resume.

The tiny two-stage recipe of tests/test_train.py, trained by 2 ranks with FSDP2 (the default for more than one
rank), is the reference here; every test compares against it or against the 1-rank run.

Tolerance of "equal within fp32": 1e-6 relative on each step's loss. Ranks reduce the same gradients in another
order than one process sums them, which changes the last bits of a float32 (about 1e-7 relative); AdamW's
normalised update does not amplify that over these 13 steps (the largest seen is 2.3e-7). A real difference is
orders of magnitude larger: gloo's summed (not averaged) gradients changed every clipped step by 1e-5 to 7e-5.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from tests.test_train import SEQ, STEP, _job, _launch, _ok
from trainers.exit_codes import INTERRUPTED, RETRYABLE, ExitCode

pytestmark = pytest.mark.slow
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    from tests.support.training import two_sources

    return two_sources(tmp_path_factory.mktemp("data"), SEQ)


def _run(job_path, stage, log, procs, **kw):
    """A launch, relaunched once if it is retryable (as the flow would: a launcher's port race on a busy box)."""
    proc = _launch(job_path, stage, log, procs=procs, **kw)
    if proc.returncode == ExitCode.RETRYABLE and not kw.get("fault"):
        proc = _launch(job_path, stage, log, procs=procs, **kw)
    return proc


@pytest.fixture(scope="module")
def sharded_reference(tmp_path_factory, sources):
    """Both stages trained by 2 FSDP2 ranks without interruption."""
    root = tmp_path_factory.mktemp("fsdp-ref")
    job, job_path = _job(root, sources)
    for stage in (0, 1):
        _ok(_run(job_path, stage, root / "samples.jsonl", procs=2), root / "logs")
    return job, root


def _tensors(folder: str | Path) -> dict:
    """Every tensor of a sharded checkpoint (model and optimizer), read whole."""
    from trainers.format.sharded import read_tensors

    return read_tensors(folder, "")


def _final(job) -> Path:
    from trainers.format.checkpoints import list_complete

    return Path(list_complete(job.save_folder)[-1].path)


def _assert_bitwise(mine: Path, reference: Path) -> None:
    import torch

    a, b = _tensors(mine), _tensors(reference)
    assert a.keys() == b.keys()
    assert any(".exp_avg_sq" in k for k in a)  # the optimizer's moments are compared too
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different[:5]


def _losses(log: Path) -> dict[int, float]:
    from trainers.faults import read_sample_log

    return {t: r["loss"] for t, r in read_sample_log(log).items()}


def test_fsdp2_writes_sharded_folders_each_file_published(sharded_reference):
    job, _ = sharded_reference
    from trainers.format.checkpoints import damage_of, list_complete

    done = list_complete(job.save_folder)
    assert [c.tokens for c in done] == [1024, 2048, 2560, 3072, 4096]
    for info in done:
        assert Path(info.path).is_dir() and Path(info.path).name == f"tiny-s{info.stage_index}-tok{info.tokens}"
        names = [f.name for f in info.files]
        assert names == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # each rank's shard, nothing gathered
        assert [f.size for f in info.files] == [(Path(info.path) / n).stat().st_size for n in names]
        assert damage_of(info) is None
    # Each rank holds about half the parameters: the two shards are of similar size.
    sizes = [f.size for f in done[-1].files if f.name.endswith(".distcp")]
    assert max(sizes) < 1.3 * min(sizes)


def test_fsdp2_and_ddp_losses_equal_one_rank_within_fp32(sharded_reference, tmp_path, sources):
    """Stage 0 on 1 rank, on 2 DDP ranks (eager and compiled) and on 2 FSDP2 ranks with activation checkpointing;
    each step's loss against the FSDP2 reference."""
    _, ref_root = sharded_reference
    sharded = _losses(ref_root / "samples.jsonl")
    runs = [
        ("one", 1, {}),
        ("ddp", 2, {"parallelism": {"sharding": "NO_SHARD"}}),
        # each block recomputed in backward (a checkpoint wrapper renames its parameters): same init, same losses
        ("fsdp2-ac", 2, {"parallelism": {"activation_checkpointing": True}}),
        # DDP with each block compiled (train.compile): within tests/test_compile.py's compiled tolerance
        ("ddp-compiled", 2, {"parallelism": {"sharding": "NO_SHARD"}, "compile": True}),
    ]
    for name, procs, kw in runs:
        (tmp_path / name).mkdir()
        job, job_path = _job(tmp_path / name, sources, **kw)
        _ok(_run(job_path, 0, tmp_path / name / "samples.jsonl", procs=procs), tmp_path / name / "logs")
        other = _losses(tmp_path / name / "samples.jsonl")
        assert list(other) == [t * STEP for t in range(1, 11)]
        worst = max(abs(other[t] - sharded[t]) / sharded[t] for t in other)
        assert worst <= (1e-5 if kw.get("compile") else TOLERANCE), (name, worst)
        if name.startswith("ddp"):  # DDP writes the single file, FSDP2 the folders
            assert Path(_final(job)).is_file()


def test_fsdp2_compiled_per_block_with_activation_checkpointing_resumes_and_matches(
    sharded_reference, tmp_path, sources
):
    """train.compile on 2 FSDP2 ranks with activation checkpointing: each block's forward compiled (inductor) inside
    FSDP2's and the checkpoint wrapper's hooks. Killed with -9 after its first checkpoint and relaunched, stage 0
    ends with the eager reference's steps: each loss within 1e-5 (tests/test_compile.py says why compiled and eager
    differ in the last bits), and sharded checkpoints like the eager run's."""
    _, ref_root = sharded_reference
    job, job_path = _job(tmp_path, sources, compile=True, parallelism={"activation_checkpointing": True})
    log = tmp_path / "samples.jsonl"
    proc = _launch(job_path, 0, log, fault=f"step:{6 * STEP}", procs=2)
    assert proc.returncode in {-9, 137} | RETRYABLE | INTERRUPTED, proc.stderr[-3000:]  # 137: 128 + SIGKILL
    resumed = _run(job_path, 0, log, procs=2)
    _ok(resumed, tmp_path / "logs")
    rank0 = resumed.stdout + resumed.stderr  # rank 0 writes to the launcher's own streams
    assert "compiling 2 decoder blocks (inductor)" in rank0 and "resume at 1024 tokens" in rank0
    mine, reference = _losses(log), _losses(ref_root / "samples.jsonl")
    assert list(mine) == [t * STEP for t in range(1, 11)]
    worst = max(abs(mine[t] - reference[t]) / reference[t] for t in mine)
    assert worst <= 1e-5, worst
    from trainers.format.checkpoints import list_complete

    assert [c.tokens for c in list_complete(job.save_folder)] == [1024, 2048, 2560]
    assert all(Path(c.path).is_dir() for c in list_complete(job.save_folder))


def test_kill9_of_the_group_anywhere_resumes_bitwise_exact(sharded_reference, tmp_path, sources):
    """SIGKILL of every rank at points spread over both stages: mid-step, mid-write of a shard (cut to half),
    after the manifest. The run ends with weights and optimizer moments bitwise equal to the uninterrupted
    FSDP2 run's, and each stage used every sample once."""
    ref_job, ref_root = sharded_reference
    job, job_path = _job(tmp_path, sources)
    log = tmp_path / "samples.jsonl"
    kills = {0: ["step:768", "save:2048", "step:2304"], 1: ["published:3072", "step:3584"]}
    for stage, faults in kills.items():
        for fault in faults:
            proc = _launch(job_path, stage, log, fault=fault, procs=2)
            # 137: the launcher exits 128 + 9, as a shell reports it, when the rank that failed first died of SIGKILL
            assert proc.returncode in {-9, 137} | RETRYABLE | INTERRUPTED, (fault, proc.stderr[-3000:])
        _ok(_run(job_path, stage, log, procs=2), tmp_path / "logs")
    _assert_bitwise(_final(job), _final(ref_job))
    from trainers.faults import read_sample_log

    effective = read_sample_log(log)
    assert effective == read_sample_log(ref_root / "samples.jsonl")  # samples and losses, step by step
    for lo, hi, n in [(0, 2560, 80), (2560, 4096, 48)]:
        seen = [i for t, r in effective.items() if lo < t <= hi for i in sum(r["samples"], [])]
        assert len(seen) == len(set(seen)) == n
    assert not list(Path(job.save_folder).glob(".removing-*")) and not list(Path(job.save_folder).glob("*.unpublished"))


def _copy_until(ref_job, dest: Path, tokens: int) -> Path:
    """The reference's save folder as it stood at `tokens`: later checkpoints and their manifests removed."""
    shutil.copytree(ref_job.save_folder, dest, symlinks=True)
    for manifest in (dest / "manifests").glob("tok-*.json"):
        info = json.loads(manifest.read_text())
        if info["tokens"] > tokens:
            manifest.unlink()
            shutil.rmtree(dest / Path(info["path"]).name)
    for link in dest.glob("latest-*"):
        link.unlink()  # the plan re-derives it; copied, it would point into the reference's folder
    for manifest in (dest / "manifests").glob("tok-*.json"):  # paths now name this copy
        info = json.loads(manifest.read_text())
        info["path"] = str(dest / Path(info["path"]).name)
        manifest.write_text(json.dumps(info))
    return dest


@pytest.mark.parametrize("procs", [1, 4])
def test_a_two_rank_checkpoint_resumes_on_another_number_of_ranks(sharded_reference, tmp_path, sources, procs):
    """The 2-rank checkpoint at 1024 tokens resumed by `procs` ranks (DCP reshards as it loads): the stage
    finishes, Streaming's fixed canonical nodes give each sample once, and the loss goes on where it was."""
    ref_job, ref_root = sharded_reference
    job, job_path = _job(tmp_path, sources)
    _copy_until(ref_job, Path(job.save_folder), 1024)
    log = tmp_path / "samples.jsonl"
    _ok(_run(job_path, 0, log, procs=procs), tmp_path / "logs")
    from trainers.faults import read_sample_log

    reference = read_sample_log(ref_root / "samples.jsonl")
    resumed = read_sample_log(log)
    assert list(resumed) == [t * STEP for t in range(5, 11)]  # from the checkpoint on, no step replayed
    before = [i for t, r in reference.items() if t <= 1024 for i in sum(r["samples"], [])]
    after = [i for r in resumed.values() for i in sum(r["samples"], [])]
    assert len(before + after) == len(set(before + after)) == 80  # each sample of the stage once
    for t, r in resumed.items():  # the same samples per step, split over another number of ranks
        assert sorted(sum(r["samples"], [])) == sorted(sum(reference[t]["samples"], []))
        assert math.isclose(r["loss"], reference[t]["loss"], rel_tol=TOLERANCE), t
    final = _final(job)
    assert final.is_dir() and len(list(final.glob("*.distcp"))) == procs  # it goes on sharded, `procs` shards


def test_a_damaged_shard_withdraws_its_checkpoint_and_the_run_ends_bitwise_equal(sharded_reference, tmp_path, sources):
    ref_job, _ = sharded_reference
    job, job_path = _job(tmp_path, sources)
    folder = _copy_until(ref_job, Path(job.save_folder), 2048)
    shard = folder / "tiny-s0-tok2048" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit in rank 1's shard, inside a tensor
    shard.write_bytes(bytes(data))
    proc = _run(job_path, 0, tmp_path / "samples.jsonl", procs=2)
    _ok(proc, tmp_path / "logs")
    assert "tiny-s0-tok2048" in proc.stderr and "__1_0.distcp" in proc.stderr  # the withdrawal names the shard
    assert (folder / "tiny-s0-tok2048.corrupt" / "__1_0.distcp").is_file()  # kept for a look
    from trainers.faults import read_sample_log

    assert list(read_sample_log(tmp_path / "samples.jsonl")) == [t * STEP for t in range(5, 11)]  # from 1024
    _assert_bitwise(folder / "tiny-s0-tok2560", Path(ref_job.save_folder) / "tiny-s0-tok2560")


def test_a_missing_shard_is_damage_and_a_folder_without_metadata_is_cut_short(sharded_reference, tmp_path):
    from trainers.format.checkpoints import CheckpointInfo, damage_of, is_intact, missing

    ref_job, _ = sharded_reference
    info = CheckpointInfo.model_validate_json(
        (Path(ref_job.save_folder) / "manifests" / f"tok-{1024:012d}.json").read_text()
    )
    copy = tmp_path / Path(info.path).name
    shutil.copytree(info.path, copy)
    info = info.model_copy(update={"path": str(copy)})
    assert damage_of(info) is None and missing(info) == [] and is_intact(copy)
    (copy / "__0_0.distcp").unlink()
    assert damage_of(info) == "__0_0.distcp is missing" and missing(info) == ["__0_0.distcp"]
    (copy / ".metadata").unlink()
    assert not is_intact(copy)


def test_export_of_a_sharded_checkpoint_equals_the_export_of_the_same_state_as_one_file(sharded_reference, tmp_path):
    """The sharded folder consolidated into one torch.save file (DCP's own converter: the layout of Composer's
    single-file checkpoint); both exported to HF safetensors: tensor for tensor equal."""
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from trainers.format.export import export_hf

    ref_job, _ = sharded_reference
    folder = _final(ref_job)
    whole = tmp_path / "whole.pt"
    dcp_to_torch_save(str(folder), str(whole))
    a = load_file(export_hf(folder, tmp_path / "from-shards") / "model.safetensors")
    b = load_file(export_hf(whole, tmp_path / "from-file", trust=True) / "model.safetensors")
    assert a.keys() == b.keys() and len(a) > 10
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_sharded_index_that_would_run_code_is_refused(sharded_reference, tmp_path):
    """DCP reads `.metadata` with plain pickle: a planted one would run code in evaluation or a resume."""
    import pickle

    from trainers.format.export import load_hf

    ref_job, _ = sharded_reference
    copy = tmp_path / "planted"
    shutil.copytree(_final(ref_job), copy)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (copy / ".metadata").write_bytes(pickle.dumps(Payload()))
    from trainers.format.safe_load import UnsafeCheckpoint

    with pytest.raises(UnsafeCheckpoint, match=r"planted: refused to load: unpickling it needs `io.open`"):
        load_hf(copy)
    assert not marker.exists()


def test_continued_pretraining_reads_weights_and_optimizer_state_from_a_sharded_checkpoint(sharded_reference, tmp_path):
    """`model.init_from` and `train.init_optimizer_from` naming a sharded folder: the weights and AdamW's
    moments come from the shards, into a model of one process; a copy with one byte of a shard flipped is one
    fatal line on both paths, naming the shard and both hashes, and nothing of it is loaded."""
    import torch

    from trainers.build import _wrap, optimizer_for
    from trainers.config import OptimConfig
    from trainers.model import build_model, read_weights_from
    from trainers.optimizer_seed import seed_optimizer

    ref_job, _ = sharded_reference
    folder = _final(ref_job)
    stored = _tensors(folder)
    model = build_model(ref_job.model, ref_job.vocab_size, ref_job.max_seq_len, ref_job.eos_token_id, seed=1)
    weights = read_weights_from(model, str(folder))
    assert all(torch.equal(weights[k], stored[f"state.model.model.{k}"]) for k in model.state_dict())
    wrapped = _wrap(model, None)  # as the trainer holds it: Composer names parameters model.<hf name>
    optimizer = optimizer_for(wrapped, OptimConfig())
    assert seed_optimizer(wrapped, optimizer, str(folder)) == f"restored from {folder}"
    up = model.model.layers[0].mlp.up_proj.weight
    saved = stored["state.optimizers.AdamW.state.model.model.layers.0.mlp.up_proj.weight.exp_avg_sq"]
    assert torch.equal(optimizer.state[up]["exp_avg_sq"], saved)

    import shutil

    from trainers.exit_codes import FatalError
    from trainers.format.checkpoints import MANIFEST_DIR, manifest_of

    copy = tmp_path / "save" / folder.name
    shutil.copytree(folder, copy)
    shutil.copytree(folder.parent / MANIFEST_DIR, copy.parent / MANIFEST_DIR)
    published = manifest_of(copy)
    assert published is not None and published.files is not None
    shard = next(f for f in published.files if f.name.endswith(".distcp"))
    with open(copy / shard.name, "r+b") as f:  # one byte in the middle of the shard's tensors
        f.seek(shard.size // 2)
        byte = f.read(1)
        f.seek(shard.size // 2)
        f.write(bytes([byte[0] ^ 0x01]))
    fresh = build_model(ref_job.model, ref_job.vocab_size, ref_job.max_seq_len, ref_job.eos_token_id, seed=1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(FatalError) as refused:
        read_weights_from(fresh, str(copy))
    line = str(refused.value)
    assert line.startswith(f"model.init_from: {copy}: damaged checkpoint, not loaded: {shard.name}: SHA-256 "), line
    assert f"is not the {shard.sha256} published" in line and "\n" not in line
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())
    wrapped = _wrap(fresh, None)
    optimizer = optimizer_for(wrapped, OptimConfig())
    with pytest.raises(FatalError, match=rf"^train.init_optimizer_from: {copy}: damaged checkpoint, not loaded: "):
        seed_optimizer(wrapped, optimizer, str(copy))
    assert optimizer.state_dict()["state"] == {}
