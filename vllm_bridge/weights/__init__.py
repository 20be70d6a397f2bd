"""Weight sync: how a learner's new weights reach the rollout engines. The one home of it.

What travels is a *bucketed stream* of (Hugging Face name, tensor) plus one version number: the
learner (megatron_rz.loop.weights.hf_buckets) yields buckets of about ``bucket_bytes`` on its rank 0,
so no rank ever holds more than one bucket beyond its own shards. A transport moves the stream to an
engine; the engine applies it with its one staging protocol (RolloutEngine.apply_weights: abort ->
stage every bucket -> commit (one in-place reload) -> version -> prefix-cache reset); every
parameter of every worker is then checked against the learner's bytes (verify.SyncCheck).

    select.py      rollout.weight_transport -> the transport (one compatibility table, one factory)
    buckets.py     the stream, WeightUpdate, version directories, WeightTransport, stage_and_commit
    inprocess.py   safetensors bytes over collective_rpc into an engine of this process
    filesystem.py  version directories of bucket files the workers read themselves
    nccl.py        vLLM's NCCL weight-transfer API (GPU)
    ipc.py         CUDA IPC handles, device to device (GPU; learner and engine colocated)
    reshard.py     every learner rank writes only its slices of each engine worker's shard
    verify.py      the every-parameter check after a sync (and the older readable-tensor one)

Every transport: ``push(buckets, version) -> WeightUpdate`` on the sending side, ``apply(update,
engine)`` where the engine runs, ``release(update)`` once applied or superseded, ``deliver(buckets,
version, engine)`` for the whole trip where the sender reaches the engine. Runs on both sides;
never imports megatron. This package's __init__ stays torch-free (the recipe validates with
``select``); import the modules for the rest.
"""

from vllm_bridge.weights.select import RESHARD_ARCHS, TRANSPORTS, WEIGHTS_DIR, make_transport, refusal, resolve

__all__ = ["RESHARD_ARCHS", "TRANSPORTS", "WEIGHTS_DIR", "make_transport", "refusal", "resolve"]
