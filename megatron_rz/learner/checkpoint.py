"""Learner checkpoints through megatron.core.dist_checkpointing: one checkpoint for every layout.

A checkpoint directory (`checkpoints/step_N/`) is a Megatron dist_checkpointing checkpoint in the
`torch_dist` format (PyTorch Distributed Checkpoint files `__<rank>_<i>.distcp` + `.metadata`,
Megatron's `common.pt` and `metadata.json`), written with the fully-parallel save strategy over the
data-parallel group, plus a BLAKE2b digest beside each file and, last, the `COMPLETE` manifest
(megatron_rz.manifest, megatron_rz.loop.resume). Every tensor is stored under its global Megatron name and global shape:

- the model: `GPTModel.sharded_state_dict()` (TP shards, expert-parallel experts as one stacked
  tensor [experts, ...]);
- the optimizer: `optimizer.sharded_state_dict(model_sd)`; the plain optimizer stores Adam's
  exp_avg / exp_avg_sq per parameter in the parameter's sharding; the DistributedOptimizer
  (parallel.distributed_optimizer) uses Megatron's `fully_reshardable` format (fp32 main params and
  moments in model space, gathered over the data-parallel group with gloo on save), so both reshard;
- common state (rank 0): step, version, the saving layout, world size, model config and the
  learner's layer spec (aligned / local / te: a Transformer Engine learner's names differ, so a
  checkpoint loads only into a learner of a spec with the same names, te_spec.checkpoint_refusal);
- the CPU RNG state of every rank (a ShardedObject per rank), restored when the layout is the same.

So a run saved at one (tp, ep, dp) resumes at another: `load` builds the sharded state dict of
the learner it loads into and dist_checkpointing reads each rank's slices. What must match is the
model (architecture and sizes) and the optimizer kind (parallel.distributed_optimizer): a mismatch
is one line naming both. The per-rank `rank00000.pt` files written before this format are refused
with one line (resume them with the rz version that wrote them, or restart from the run's HF export).

megatron-core 0.16.1 needs four workarounds on a CPU host without apex/TE (megatron_patches 2b, 13,
14, init_adam_state / unshare_adam_steps); its default DistributedOptimizer format
(`fully_sharded_model_space`) no longer loads or saves in 0.16.1 ("ShardedTensor.flattened_range is
not supported"), and its fully-parallel LOAD needs CUDA (exchange_utils moves tensors with .cuda()),
so loads use the plain torch_dist load strategy (each rank reads only what it needs).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

FORMAT = "rz-megatron-dist-ckpt-1"
# DistributedOptimizer: the model-space format that reshards over TP/EP/DP; gathered with gloo on
# save (the default all-gather path moves tensors with .cuda()).
OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable",
                    "distrib_optim_fully_reshardable_mem_efficient": True}
LEGACY_FILE = "rank00000.pt"


def _rng_object(world: int, rank: int, state=None):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    data = torch.get_rng_state() if state is None else state
    return ShardedObject(f"rz.torch_rng_state.world{world}", data, (world,), (rank,), replica_id=0)


def _sharded_state(learner, loading: bool) -> dict:
    model_sd = learner.model.sharded_state_dict()
    return {"model": model_sd,
            "optimizer": learner.optimizer.sharded_state_dict(model_sd, is_loading=loading, metadata=OPTIMIZER_FORMAT)}


def _layout(learner) -> dict:
    return {**learner.parallel.model_dump(), "world_size": dist.get_world_size()}


def _save_strategy():
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    # one writer process per rank on a CPU host (Megatron's default of 2 on a GPU)
    threads = 2 if torch.cuda.is_available() else 1
    base = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=threads)
    return FullyParallelSaveStrategyWrapper(base, ps.get_data_parallel_group(with_context_parallel=True))


def save(learner, ckpt_dir, step: int) -> Path:
    """Collective: write the learner's model + optimizer + RNG state to ckpt_dir, each rank's
    files with their digests, then rank 0's COMPLETE manifest (the checkpoint counts from then)."""
    from megatron.core import dist_checkpointing

    from megatron_rz.learner.megatron_patches import init_adam_state
    from megatron_rz.manifest import COMPLETE, mark_complete, write_digest

    d = Path(ckpt_dir)
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        d.mkdir(parents=True, exist_ok=True)
        # re-saving a step: not complete until rewritten; an earlier write's files (maybe of another
        # world size) go, so the manifest lists exactly this checkpoint's files
        (d / COMPLETE).unlink(missing_ok=True)
        for f in d.iterdir():
            if f.is_file():
                f.unlink()
    dist.barrier()
    init_adam_state(learner.optimizer)  # saved before the first update: the state Adam starts from
    state = _sharded_state(learner, loading=False)
    state["rng"] = _rng_object(world, rank)
    state["rz"] = {"format": FORMAT, "step": int(step), "version": int(learner.version), "layout": _layout(learner),
                   "mode": learner.mode, "learner_spec": getattr(learner, "spec", None),
                   "model": learner.model_cfg.model_dump()}
    dist_checkpointing.save(state, str(d), sharded_strategy=_save_strategy())
    mine = sorted(d.glob(f"__{rank}_*.distcp"))
    if rank == 0:
        mine += [d / n for n in (".metadata", "common.pt", "metadata.json")]
    for f in mine:  # each rank hashes what it wrote (in parallel); mark_complete hashes any other file
        write_digest(f)
    dist.barrier()
    if rank == 0:
        mark_complete(d, int(step))
    dist.barrier()
    return d


def read_common(ckpt_dir) -> dict:
    """The checkpoint's common rz state (step, version, layout, model) or a one-line error."""
    from megatron.core import dist_checkpointing

    d = Path(ckpt_dir)
    if (d / LEGACY_FILE).is_file() and not (d / "metadata.json").is_file():
        raise ValueError(
            f"checkpoint {d} is a per-rank torch.save checkpoint ({LEGACY_FILE}, ...) from before rz used "
            "Megatron dist_checkpointing; this version cannot load it: resume it with the rz version that wrote "
            "it, or start a new run from its weights (model.pretrained=<run>/hf_final)")
    if not (d / "metadata.json").is_file() or not (d / "common.pt").is_file():
        raise ValueError(f"checkpoint {d} is not a Megatron dist_checkpointing checkpoint (no metadata.json / "
                         "common.pt); name a checkpoints/step_N directory or use checkpoint.load=latest")
    common = dist_checkpointing.load_common_state_dict(str(d))
    rz = common.get("rz") if isinstance(common, dict) else None
    if not isinstance(rz, dict) or rz.get("format") != FORMAT:
        raise ValueError(f"checkpoint {d} was not written by the rz learner (format {FORMAT} expected)")
    return rz


def load(learner, ckpt_dir) -> int:
    """Collective: restore model, optimizer, version (and RNG when the layout is the same) from a
    checkpoint written by `save` under any layout; returns the stored step."""
    from megatron.core import dist_checkpointing

    from megatron_rz.learner.megatron_patches import init_adam_state, unshare_adam_steps

    d = Path(ckpt_dir)
    rz = read_common(d)
    saved, mine = rz["layout"], _layout(learner)
    if saved.get("distributed_optimizer", False) != mine["distributed_optimizer"]:
        raise ValueError(f"checkpoint {d} holds a {'distributed' if saved.get('distributed_optimizer') else 'plain'} "
                         f"optimizer's state (parallel.distributed_optimizer={saved.get('distributed_optimizer', False)}); "
                         f"this learner has parallel.distributed_optimizer={mine['distributed_optimizer']}: set it back")
    from megatron_rz.learner.te_spec import checkpoint_refusal

    why = checkpoint_refusal(rz.get("learner_spec"), getattr(learner, "spec", "local"))
    if why:  # the layer specs name (and shard) parameters differently
        raise ValueError(f"checkpoint {d}: {why}")
    now = learner.model_cfg.model_dump()
    diff = [k for k in sorted(set(rz["model"]) & set(now)) if k != "pretrained" and rz["model"][k] != now[k]]
    if diff:
        raise ValueError(f"checkpoint {d} holds another model (model.{', model.'.join(diff)} differ from this "
                         "recipe's): resume with the model settings that wrote it")
    same_layout = {k: v for k, v in saved.items() if k != "collective_timeout_s"} == \
        {k: v for k, v in mine.items() if k != "collective_timeout_s"}
    init_adam_state(learner.optimizer)
    state = _sharded_state(learner, loading=True)
    if same_layout:
        state["rng"] = _rng_object(dist.get_world_size(), dist.get_rank())
    loaded = dist_checkpointing.load(state, str(d))
    learner.model.load_state_dict(loaded["model"], strict=True)
    learner.optimizer.load_state_dict(loaded["optimizer"])
    unshare_adam_steps(learner.optimizer)
    learner.version = int(rz["version"])
    if same_layout:
        # Nothing in the forward draws random numbers today (no dropout); restored so that one that
        # does still resumes exactly in the same layout (another layout has other per-rank streams).
        torch.set_rng_state(loaded["rng"])
    return int(rz["step"])
