"""How several ranks share the model: Composer's FSDP2 (torch's `fully_shard`, DTensor parameters), on CPU
ranks over gloo as on GPUs over NCCL.

- Each decoder block is one FSDP unit (its all-gather overlaps the previous block's compute) and, when
  asked, one activation-checkpointing unit; the root holds the embeddings, the final norm and the head.
- FULL_SHARD frees a block's gathered parameters after its forward; SHARD_GRAD_OP keeps them until the
  backward (more memory, one all-gather fewer); HYBRID_SHARD is a 2-D mesh that shards inside a node and
  replicates across nodes; NO_SHARD is plain DDP (Composer's, when no FSDP config is given).
- Mixed precision follows the Trainer's precision: amp_bf16 computes in bf16 and reduces gradients in
  fp32 (Composer's DEFAULT policy); fp32 stays fp32.
- The model is built on the meta device and sharded before any memory exists (trainers/model.py); each
  rank then allocates only its shards and fills them (`init_weights`: the same values a single process
  draws), or a checkpoint does. No rank ever holds the whole fp32 model.
- Checkpoints are sharded: each rank writes its own shard of the parameters and optimizer moments
  (torch.distributed.checkpoint, through Composer) into one folder per checkpoint, named as the run's
  file checkpoints are (trainers/layout.py) without the `-rank0.pt`. A later launch may have another
  number of ranks: the checkpoint is resharded as it loads.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from composer.utils.parallelism import FSDP2Config

from trainers.config import ParallelismConfig
from trainers.exit_codes import FatalError
from trainers.model import init_weights


class ShardedConfig(FSDP2Config):
    """FSDP2Config with the two things Composer 0.32 reads from FSDP1's config but fixes in FSDP2's:
    the checkpoint folder's name (FSDP2Config says `ep{epoch}-ba{batch}`: one name for every run sharing
    a save folder) and the mesh of a hybrid run (FSDP2Config says one flat dimension)."""

    def __init__(self, folder_template: str, replicate: int | None, shard: int, **kwargs):
        super().__init__(**kwargs)
        self._folder_template, self._replicate, self._shard = folder_template, replicate, shard

    @property
    def sharded_ckpt_prefix_dir(self) -> str:
        return self._folder_template

    @property
    def data_parallel_shard_degree(self) -> int:
        return self._shard

    @property
    def data_parallel_replicate_degree(self) -> int | None:
        return self._replicate


def is_sharded(par: ParallelismConfig, world_size: int, loads: dict | None = None) -> bool:
    """Whether a launch of `world_size` ranks trains sharded (else: one process, or DDP).

    `loads` is the checkpoint the launch resumes from (a CheckpointInfo dict): a sharded one is loaded
    sharded whatever the launch's size, so a run that trained on N ranks resumes on one (a 1-rank mesh)."""
    return bool((loads or {}).get("files")) or (world_size > 1 and par.sharding != "NO_SHARD")


def parallelism_config(
    par: ParallelismConfig, hf_model, world_size: int, folder_template: str, loads: dict | None = None
) -> dict | None:
    """Composer's parallelism_config for a launch; None for one rank or NO_SHARD (Composer then uses DDP).

    A launch that resumes from a single-file checkpoint (a run begun on one rank, now on several) loads it
    whole and keeps saving single files (Composer's FSDP2 saves in the form it loads); only a run that
    starts sharded writes sharded folders."""
    if not is_sharded(par, world_size, loads):
        return None
    for layer in hf_model.model.layers:
        layer._fsdp_wrap = True
        layer._activation_checkpointing = par.activation_checkpointing
    replicate, shard = None, -1
    if par.sharding == "HYBRID_SHARD":  # shard within a node, replicate across nodes
        if not torch.cuda.is_available():
            raise FatalError(
                "train.parallelism.sharding: HYBRID_SHARD needs GPUs (NCCL): FSDP2 averages the replicas' "
                "gradients with an all-reduce gloo cannot do (ReduceOp.AVG); use FULL_SHARD on CPU ranks"
            )
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        replicate, shard = world_size // per_node, per_node
    config = ShardedConfig(
        folder_template,
        replicate,
        shard,
        reshard_after_forward=par.sharding != "SHARD_GRAD_OP",
        activation_checkpointing=par.activation_checkpointing,
        state_dict_type="full" if loads is not None and not loads.get("files") else "sharded",
        mixed_precision="DEFAULT",
    )
    return {"fsdp": config}


def average_gradients_over_gloo(model: torch.nn.Module) -> int:
    """Make FSDP2's gradient reduce-scatter an average on gloo, as it is on NCCL; returns the units fixed.

    FSDP2 (torch 2.7) reduce-scatters fp32 gradients with ReduceOp.AVG, and gloo's reduce_scatter_tensor
    silently sums instead (2 ranks: 2x the gradient). AdamW hides a uniform scale, but gradient clipping
    does not: the norm is N times too large and every clipped step differs from one rank's. Each FSDP
    unit's hook divides its reduced shard by the group's size, right after the reduce-scatter.
    """
    from torch.distributed.fsdp import FSDPModule

    fixed = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        if group is None:  # a unit that holds no parameters of its own
            continue
        mesh_group = group.mesh_info.shard_process_group
        if torch.distributed.get_backend(mesh_group) != "gloo":
            continue
        size = mesh_group.size()
        module.set_all_reduce_hook(lambda grads, size=size: grads.div_(size))
        fixed += 1
    return fixed


def _allocate_shards(model: torch.nn.Module, device: torch.device) -> None:
    """Give every meta parameter (an FSDP2 shard, now) real, uninitialised memory on `device`. Buffers are
    kept: they were built real (RoPE's inv_freq is computed, never saved) and to_empty would blank them."""
    for module in model.modules():
        if not any(p.is_meta for p in module.parameters(recurse=False)):
            continue
        buffers = {name: b for name, b in module._buffers.items() if b is not None and not b.is_meta}
        module.to_empty(device=device, recurse=False)
        for name, buffer in buffers.items():
            module._buffers[name] = buffer.to(device)


@contextlib.contextmanager
def shard_initialised(std: float, seed: int, source: dict[str, torch.Tensor] | None = None) -> Iterator[None]:
    """While the Trainer is built, Composer's FSDP2 initialises the sharded meta model with `init_weights`.

    Composer's own `meta_init` allocates on CUDA and calls each module's reset_parameters, whose draws depend
    on the shard; ours allocates on the rank's device and draws what one process would. A resumed launch
    initialises too and the checkpoint then overwrites every shard (cheap next to the load itself).
    """
    import composer.distributed.prepare_distributed as prepare

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def initialise(composer_model: torch.nn.Module) -> None:
        hf_model = composer_model.model  # HuggingFaceModel keeps the decoder as .model: init names are its own
        _allocate_shards(composer_model, device)
        init_weights(hf_model, std, seed, source)

    original = prepare.meta_init
    prepare.meta_init = initialise
    try:
        yield
    finally:
        prepare.meta_init = original
