"""Assemble a Composer Trainer for one stage of a TrainJob. train.py calls this; benches reuse it."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import tempfile
from pathlib import Path

import torch
from composer import Trainer
from composer.algorithms import GradientClipping
from composer.core import Event
from composer.models import HuggingFaceModel

from trainers import compile as compile_lib
from trainers import heartbeat, preflight
from trainers import model as model_lib
from trainers.callbacks import Heartbeat, LossGuard, MlflowMetrics, Progress
from trainers.config import MlflowTarget, ModelConfig, OptimConfig, Stage, TrainJob
from trainers.contract import DIST_TIMEOUT_ENV, DIST_TIMEOUT_S
from trainers.data import (
    build_stage_data,
    build_val_evaluators,
    cache_dir_for,
)
from trainers.exit_codes import FatalError
from trainers.faults import Probe
from trainers.format.mlflow_model import download_model
from trainers.format.safe_load import refusal
from trainers.layout import RunFolder
from trainers.lm_loss import use_fused_loss
from trainers.metrics_journal import RemoteCopy, remote_copy
from trainers.optimizer_seed import seed_optimizer
from trainers.plan import StartPlan, drop_dataset_state
from trainers.rank_timing import RankTiming
from trainers.remote import fetch_folder
from trainers.rendezvous import world
from trainers.rng import RestoreRng
from trainers.rollback import apply_skip
from trainers.saver import PublishingCheckpointSaver, checkpoint_due
from trainers.schedule import GlobalLRSchedule
from trainers.sharding import average_gradients_over_gloo, is_sharded, parallelism_config, shard_initialised
from trainers.start import checkpoint_bytes, start

log = logging.getLogger("tessera.train")


def optimizer_for(model: torch.nn.Module, optim: OptimConfig) -> torch.optim.Optimizer:
    """AdamW; no weight decay on norms (1-D gains), which decay would just pull toward zero.

    On CUDA the fused kernel (one launch for every parameter's update, not several per tensor group), else
    foreach. Either is deterministic, so a resume on the same kind of device stays bitwise; their state
    dicts are the same, so a checkpoint moves between them."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    fused = torch.cuda.is_available()
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=optim.lr,
        betas=optim.betas,
        eps=optim.eps,
        fused=fused,
        foreach=not fused,
    )


def _wrap(hf_model, tokenizer, guard: compile_lib.Guard | None = None) -> HuggingFaceModel:
    """Composer's HuggingFaceModel around the decoder, whose training loss never holds the logits
    (trainers/lm_loss.py), without HuggingFaceModel's causal-LM registry probe.

    Composer's probe resolves every causal-LM class in transformers, importing each modeling
    file (and torch inductor through one of them): ~5 s idle, over 10 s on a busy node, on
    every launch. We know the answer: LlamaForCausalLM is a causal LM and wants shifted labels.
    """
    import composer.models.huggingface as hf_module

    probe = hf_module._is_registered_causal_lm
    hf_module._is_registered_causal_lm = lambda model: True
    try:
        from composer.metrics.nlp import LanguageCrossEntropy

        wrapped = HuggingFaceModel(
            hf_model, tokenizer=tokenizer, use_logits=True, shift_labels=True, eval_metrics=[LanguageCrossEntropy()]
        )
        use_fused_loss(hf_model, guard)  # after: HuggingFaceModel reads the forward's signature
        return wrapped
    finally:
        hf_module._is_registered_causal_lm = probe


def _resolve_model_uri(uri: str, tracking: MlflowTarget | None, download_to: str) -> str:
    """A local HF directory for `model.init_from`; MLflow registry URIs are downloaded first."""
    if not uri.startswith("models:/"):
        return uri
    if tracking is None:
        raise FatalError(f"model.init_from: {uri} is a registry URI but the job has no mlflow tracking target")
    return download_model(uri, tracking.tracking_uri, download_to)


def build_trainer(job: TrainJob, stage_index: int) -> Trainer | None:
    """The Trainer for stage `stage_index`, resumed as plan_start decides; None if the stage is already done."""
    if not 0 <= stage_index < len(job.train.stages):
        raise FatalError(f"--stage: {stage_index} is out of range, the job has {len(job.train.stages)} stage(s)")
    stage = job.stage(stage_index)
    plan, skip = start(job, stage_index)
    copy = remote_copy(job) if world()[0] == 0 else None  # global rank 0 alone sends metrics
    if copy is not None:
        # A fresh pod's disk has no journal or marker: before anything reads them, and before a finished
        # stage's launch delivers what the journal holds.
        copy.restore(job.save_folder, job.run_name)
    if plan.tokens >= stage.end:
        log.info("stage %s is already complete", stage.name)
        return None
    checked = preflight.run(job, _probe_device(), *world())  # before the model costs memory and time
    compiled = compile_lib.wanted(job.train.compile, torch.cuda.is_available())
    hf_model, model, init_source, guard = _model(job, plan, compiled)
    callbacks, metrics, rng = _callbacks(job, stage_index, plan, skip, copy, compiled)
    if guard is not None:
        metrics.start_tags["tessera.compile"] = f"compiled ({job.train.compile_backend})"
        guard.on_fallback = lambda reason: metrics.note(None, {}, tags={"tessera.compile": f"fallback ({reason})"})
    if checked is not None:
        metrics.note_launch(plan.tokens, preflight.metrics(checked))
    optimizer = optimizer_for(hf_model, job.train.optim)
    args = {**_data_args(job, stage), **_run_args(job, stage, plan, hf_model)}
    heartbeat.phase("load", hint_bytes=checkpoint_bytes(job) if plan.kind != "fresh" else 0)
    _cpu_model_without_a_child_python()
    with _refused_as_fatal(plan), shard_initialised(job.model.init_std, job.train.seed, init_source):
        trainer = Trainer(model=model, optimizers=optimizer, callbacks=callbacks, **args)
    if is_sharded(job.train.parallelism, world()[1], plan.checkpoint):
        average_gradients_over_gloo(trainer.state.model)
    if plan.kind == "enter":
        # Composer checkpoints the data position as timestamp.sample_in_epoch, and this stage's
        # dataset starts at sample 0: restart the epoch counters, keep the run-wide token count.
        trainer.state.timestamp = trainer.state.timestamp.to_next_epoch()
    rng.take_from(trainer)  # a resume inside the stage: Composer would not restore the RNG state
    if skip:
        log.info("skipping %d samples after a loss anomaly (see %s-rollbacks.json)", skip, job.run_name)
        apply_skip(trainer, skip)
    if job.train.init_optimizer_from and plan.kind == "fresh":  # later launches restore their own
        outcome = seed_optimizer(
            trainer.state.model,
            trainer.state.optimizers[0],
            job.train.init_optimizer_from,
            trust=job.train.trust_checkpoints,
        )
        log.info("optimizer state: %s", outcome)
        metrics.start_tags["tessera.optimizer_state"] = outcome
    trainer.tessera_metrics = metrics  # type: ignore[attr-defined]  # benches read the in-memory history
    return trainer


def _cpu_model_without_a_child_python() -> None:
    """Composer's Trainer logs its version through `collect_env.get_composer_env_dict()`, which also asks
    py-cpuinfo for the CPU's name, and py-cpuinfo answers by running a second Python interpreter: a second of CPU
    in every rank at every launch, for a field the Trainer never logs. The name comes from /proc/cpuinfo (or
    platform) instead; everything else Composer collects is unchanged."""
    import platform

    from composer.utils import collect_env

    def cpu_model() -> str:
        with contextlib.suppress(OSError):
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
        return platform.processor() or "CPU"

    collect_env.get_cpu_model = cpu_model


def _probe_device() -> torch.device:
    """The device this rank trains on, for the preflight probes (Composer picks the same)."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


@contextlib.contextmanager
def _refused_as_fatal(plan: StartPlan):
    """A checkpoint the weights-only unpickler refuses (trainers/format/safe_load.py) is refused on every
    relaunch: one fatal line naming it, not a retry."""
    try:
        yield
    except BaseException as exc:  # a sharded index's refusal comes wrapped in DCP's CheckpointException
        from torch.distributed.checkpoint.api import CheckpointException

        if not isinstance(exc, (pickle.UnpicklingError, CheckpointException)) or "weights only" not in str(exc).lower():
            raise
        raise FatalError(refusal((plan.checkpoint or {}).get("path") or plan.load_path, exc)) from None


def _model(
    job: TrainJob, plan: StartPlan, compiled: bool
) -> tuple[torch.nn.Module, HuggingFaceModel, dict[str, torch.Tensor] | None, compile_lib.Guard | None]:
    """The HF model, Composer's wrapper with the tokenizer, (sharded continued pretraining only) the
    weights each rank's shards are filled from, and the guard a compiled model's failure to compile meets.

    One process or DDP: the whole model, initialised only when nothing will overwrite it. Sharded: on the
    meta device; Composer shards it and trainers/sharding.py fills each rank's shards as it is built.
    `compiled`: each block's forward is compiled (trainers/compile.py), before Composer wraps anything.
    """
    sharded = is_sharded(job.train.parallelism, world()[1], plan.checkpoint)
    build = (_model_config(job, plan), job.vocab_size, job.max_seq_len, job.eos_token_id)
    init_source = None
    if sharded:
        hf_model = model_lib.build_model_on_meta(*build)
    elif plan.kind == "fresh" and not job.model.init_from:
        hf_model = model_lib.build_model(*build, job.train.seed)
    else:  # every weight is about to be overwritten (a checkpoint, or init_from's): allocate, skip the init
        hf_model = model_lib.build_model_to_load(*build)
    if job.model.init_from and plan.kind == "fresh":  # later launches load the run's own checkpoints
        with tempfile.TemporaryDirectory(prefix="tessera-init-") as tmp:  # the weights end up in memory
            source_dir = _resolve_model_uri(job.model.init_from, job.mlflow, tmp)
            if sharded:
                init_source = model_lib.read_weights_from(
                    hf_model, source_dir, trust=job.train.trust_checkpoints, vocab_size=job.vocab_size
                )
            else:
                model_lib.load_weights_from(
                    hf_model, source_dir, trust=job.train.trust_checkpoints, vocab_size=job.vocab_size
                )
    tokenizer = None
    if job.tokenizer_dir:
        from transformers import AutoTokenizer

        local = job.tokenizer_dir
        if "://" in local:  # published beside the data under an s3:// data root (a pod has no flow disk)
            local = str(fetch_folder(local, cache_dir_for(local, job.run_name)))
        tokenizer = AutoTokenizer.from_pretrained(local, trust_remote_code=False)  # prepare's copy, never code
    guard = None
    if compiled:
        folder = compile_lib.use_cache(job.compile_cache_dir)
        compile_lib.watch()
        guard = compile_lib.Guard(fatal=job.train.compile is True)
        blocks = compile_lib.compile_blocks(hf_model, job.train.compile_backend, guard)
        log.info(
            "compiling %d decoder blocks (%s); compiled kernels cached in %s", blocks, job.train.compile_backend, folder
        )
    return hf_model, _wrap(hf_model, tokenizer, guard), init_source, guard


def _model_config(job: TrainJob, plan: StartPlan) -> ModelConfig:
    """The recipe's model, with the vocabulary rows of the checkpoint the launch loads.

    A checkpoint written before vocabulary padding (or with model.vocab_multiple 1) has exactly the tokenizer's
    rows: the run keeps them, so it resumes as it began. Any other difference from the recipe's rows is another
    tokenizer or another padding, and stops the launch in one line naming both shapes."""
    rows, wanted = plan.vocab_rows, job.model.vocab_rows(job.vocab_size)
    if rows is None or rows == wanted:
        return job.model
    if rows == job.vocab_size:
        log.info("run %s began without vocabulary padding: it keeps its %d rows", job.run_name, rows)
        return job.model.model_copy(update={"vocab_multiple": 1})
    raise FatalError(
        f"{(plan.checkpoint or {}).get('path')}: the checkpoint has {rows} vocabulary rows but the recipe builds "
        f"{wanted} (the tokenizer's {job.vocab_size} ids padded to a multiple of model.vocab_multiple "
        f"{job.model.vocab_multiple}); resume it with the tokenizer and model.vocab_multiple it was trained with, "
        "or start a new run name"
    )


def _callbacks(
    job: TrainJob, stage_index: int, plan: StartPlan, skip: int, copy: RemoteCopy | None, compiled: bool
) -> tuple[list, MlflowMetrics, RestoreRng]:
    """The callbacks in the order they must run, and the two build_trainer talks to after the Trainer exists."""
    stage = job.stage(stage_index)
    schedule = GlobalLRSchedule(job.train, stage.tokens_per_batch)
    flops = model_lib.flops_per_token(job.model, job.vocab_size, stage.seq_len).total
    metrics = MlflowMetrics(
        job.mlflow,
        schedule,
        flops,
        stage.name,
        stage.start,
        job.checkpoint_every_tokens,
        stage.tokens_per_batch,
        state_folder=Path(job.save_folder),
        run_name=job.run_name,
        # After a rollback the re-trained steps see other data: their metrics differ and are logged again.
        relog=bool(skip),
        copy=copy,
    )
    saver = PublishingCheckpointSaver(job, stage_index)
    rng = RestoreRng()
    callbacks = [
        rng,  # first: nothing may draw random numbers before a resumed run has its saved state back
        Heartbeat(stage.name),  # before the saver: the stage's end is "close" while the last uploads finish
        RankTiming(job.train.watchdog.slow_rank_every_steps, job.train.watchdog.slow_rank_factor, metrics),
        schedule,
        # Before the saver: a bad step must never be checkpointed.
        LossGuard(job.train.loss_guard, stage_index, plan.tokens, skip, saver, job.vocab_size),
        metrics,
        Progress(stage.name, stage_index, stage.start, stage.end),
        Probe(),
        saver,
    ]
    if compiled:
        callbacks.insert(2, compile_lib.CompileReport())  # before the test probes: a killed step still says it
    return callbacks, metrics, rng


def _data_args(job: TrainJob, stage: Stage) -> dict:
    """The Trainer's data: the stage's mixture, and the held-out batches scored before each checkpoint."""
    _, world_size = world()
    train = build_stage_data(stage, job.train, world_size, run=job.run_name)
    # Scored at BATCH_END, before the checkpoint event: each saved checkpoint has its val loss.
    due = checkpoint_due(job.checkpoint_every_tokens, stage, Event.BATCH_END)
    evaluators = build_val_evaluators(job.val_streams, job.seq_len, job.train, world_size, due, run=job.run_name)
    return {"train_dataloader": train, "eval_dataloader": evaluators or None}


def _run_args(job: TrainJob, stage: Stage, plan: StartPlan, hf_model: torch.nn.Module) -> dict:
    """How the Trainer runs: duration, batch split, precision, parallelism, and where it resumes from."""
    _, world_size = world()
    on_gpu = torch.cuda.is_available()
    precision = job.train.precision if job.train.precision != "auto" else ("amp_bf16" if on_gpu else "fp32")
    microbatch = job.train.device_microbatch_size
    device_batch = stage.batch_size // world_size
    if microbatch == "auto" and (not on_gpu or is_sharded(job.train.parallelism, world_size, plan.checkpoint)):
        # Composer's auto search works by catching CUDA OOMs, and its FSDP2 path has none
        microbatch = device_batch
    elif microbatch != "auto":
        microbatch = min(microbatch, device_batch)
    algorithms = []
    if job.train.optim.grad_clip_norm:
        algorithms.append(GradientClipping(clipping_type="norm", clipping_threshold=job.train.optim.grad_clip_norm))
    return {
        "max_duration": f"{stage.end}tok",
        "device_train_microbatch_size": microbatch,
        "precision": precision,
        "parallelism_config": parallelism_config(
            job.train.parallelism,
            hf_model,
            world_size,
            RunFolder.of(job).sharded_template(stage.index),
            plan.checkpoint,
        ),
        "algorithms": algorithms,
        "run_name": job.run_name,
        "seed": job.train.seed,
        "autoresume": True,
        "load_path": plan.load_path,
        "load_ignore_keys": drop_dataset_state if plan.kind == "enter" else None,
        # The data position comes from StreamingDataset state; never replay batches to get there.
        "spin_dataloaders": False,
        "progress_bar": False,
        "log_to_console": False,
        "load_progress_bar": False,
        "dist_timeout": float(os.environ.get(DIST_TIMEOUT_ENV, DIST_TIMEOUT_S)),
    }
