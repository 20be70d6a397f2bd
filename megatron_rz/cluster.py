"""The recipe's `cluster:` section: where and how `rz submit` runs a recipe on SLURM.

One heterogeneous job with two components: the learner (Megatron ranks under torchrun) and the
rollout (vLLM engines). `gpus_per_node: 0` means CPU-only nodes whose ranks are processes (the
local test cluster of slurm/start_local.sh). The layout planner (megatron_rz.launch.planner) checks these
numbers against the recipe's parallel layout and the model's memory before anything is submitted.

This module imports only pydantic: recipe.py imports it.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

# SLURM names (partition, account, qos, constraint expressions) never need shell metacharacters;
# refusing them keeps the rendered `#SBATCH` lines a single, literal option each.
_NAME = re.compile(r"^[A-Za-z0-9_.,:+\-\[\]|&*!]+$")
# sbatch --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
# Options that `rz submit` itself writes: setting them in sbatch_extra would silently conflict.
_OWNED = ("--output", "--error", "--signal", "--requeue", "--no-requeue", "--time", "--nodes", "--job-name",
          "--open-mode", "--gpus-per-node", "--ntasks-per-node", "--partition", "--account", "--qos",
          "--hetjob", "--het-job", "-N", "-o", "-e", "-t", "-J", "-p", "-A")
# --signal's time argument is capped by SLURM at 0xffff seconds.
MAX_SIGNAL_S = 65535


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def _check_name(v: str | None, what: str) -> str | None:
    if v is not None and not _NAME.match(v):
        raise ValueError(f"{what}={v!r} has characters SLURM names never contain (spaces, quotes, #, ;, $)")
    return v


def time_limit_seconds(text: str) -> int:
    """Seconds in an sbatch --time value; ValueError (with the accepted formats) otherwise."""
    m = _TIME.match(text.strip())
    if not m:
        raise ValueError(
            f"cluster.time_limit={text!r} is not a SLURM time: use MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"
        )
    d, a, b, c = m.groups()
    if d is not None:  # D-H[:M[:S]]
        secs = int(d) * 86400 + int(a) * 3600 + int(b or 0) * 60 + int(c or 0)
    elif c is not None:  # H:M:S
        secs = int(a) * 3600 + int(b) * 60 + int(c)
    elif b is not None:  # M:S
        secs = int(a) * 60 + int(b)
    else:  # M
        secs = int(a) * 60
    if secs <= 0:
        raise ValueError(f"cluster.time_limit={text!r} must be longer than 0")
    return secs


class NodeGroup(_Strict):
    """One component of the heterogeneous job (the learner's nodes or the rollout engines' nodes)."""

    nodes: int = 1
    # 0: CPU-only nodes, ranks are processes (the local test cluster). > 0: GPUs on every node.
    gpus_per_node: int = 0
    # Memory of one GPU in GB, for the memory plan (80: H100, 141: H200). Required with GPUs.
    gpu_memory_gb: float | None = None
    # Learner only, CPU-only nodes: learner ranks per node (default: tp*pp*dp / nodes).
    procs_per_node: int | None = None
    cpus_per_task: int | None = None
    mem: str | None = None  # sbatch --mem for this component, e.g. "0" (all of a node's memory) or "200G"
    partition: str | None = None  # this component's partition, if not cluster.partition
    constraint: str | None = None  # sbatch --constraint (node features), e.g. "h200"

    @field_validator("nodes")
    @classmethod
    def _nodes(cls, v: int) -> int:
        if v < 1:
            raise ValueError("nodes must be >= 1")
        return v

    @field_validator("gpus_per_node")
    @classmethod
    def _gpus(cls, v: int) -> int:
        if v < 0:
            raise ValueError("gpus_per_node must be >= 0 (0 = CPU-only nodes)")
        return v

    @field_validator("gpu_memory_gb")
    @classmethod
    def _gpu_mem(cls, v: float | None) -> float | None:
        if v is not None and v <= 0:
            raise ValueError("gpu_memory_gb must be > 0")
        return v

    @field_validator("procs_per_node", "cpus_per_task")
    @classmethod
    def _pos(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError("must be >= 1")
        return v

    @field_validator("mem")
    @classmethod
    def _mem(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^\d+[KMGT]?$", v):
            raise ValueError(f"mem={v!r} is not an sbatch --mem size (e.g. 0, 200G, 512000M)")
        return v

    @field_validator("partition", "constraint")
    @classmethod
    def _names(cls, v: str | None, info) -> str | None:
        return _check_name(v, info.field_name)

    @model_validator(mode="after")
    def _check(self) -> NodeGroup:
        if self.gpus_per_node > 0 and self.procs_per_node is not None:
            raise ValueError("procs_per_node is for CPU-only nodes; with GPUs there is one rank per GPU")
        return self


class PlanConfig(_Strict):
    """Assumptions of the memory plan (formulas in megatron_rz/launch/planner.py and docs/slurm.md)."""

    # Activation recomputation the plan assumes: none = every layer's activations kept for backward;
    # full = only each layer's input kept, the layer recomputed in backward (Megatron
    # recompute_granularity=full, method=uniform, num_layers=1).
    recompute: Literal["none", "full"] = "none"
    # Tokens per learner sequence and per rollout sequence (default: model.max_position_embeddings,
    # the engines' max_model_len).
    seq_len: int | None = None
    # Per GPU, beyond the counted tensors: CUDA context, NCCL/vLLM buffers, allocator fragmentation.
    overhead_gb: float = 6.0


class ClusterConfig(_Strict):
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_limit: str = "04:00:00"
    job_name: str | None = None  # default: rz-<recipe name>
    learner: NodeGroup = NodeGroup()
    rollout: NodeGroup = NodeGroup()
    # Environment on the nodes: a container image (pyxis/enroot `srun --container-image`) with
    # mounts "SRC:DST[:FLAGS]", and/or shell set-up commands run before each component starts
    # (e.g. "module load cuda/12.8", "source .venv/bin/activate").
    container_image: str | None = None
    mounts: list[str] = []
    setup: list[str] = []
    env: dict[str, str] = {}  # extra environment for both components (e.g. NCCL_SOCKET_IFNAME)
    python: str = "python"  # interpreter on the nodes (relative paths are under workdir)
    workdir: str | None = None  # the repository on the shared filesystem (default: where rz submit runs)
    log_dir: str = "runs/slurm/logs"  # sbatch scripts, resolved recipes, job logs (relative: under workdir)
    run_root: str = "runs/slurm"  # run dirs: <run_root>/<recipe name>-<job id>
    sbatch_extra: list[str] = []  # further #SBATCH options for the whole job, e.g. "--exclusive"
    # Seconds before the time limit (or on preemption notice) that SLURM sends USR1 to the batch
    # script: the learner checkpoints at the next step boundary and the job requeues itself.
    signal_warning_s: int = 300
    requeue: bool = True
    max_restarts: int = 10  # requeues after which a job stops requeueing itself
    plan: PlanConfig = PlanConfig()

    @field_validator("partition", "account", "qos")
    @classmethod
    def _names(cls, v: str | None, info) -> str | None:
        return _check_name(v, f"cluster.{info.field_name}")

    @field_validator("job_name")
    @classmethod
    def _job_name(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^[A-Za-z0-9_.+\-]+$", v):
            raise ValueError(f"cluster.job_name={v!r}: use letters, digits and _ . + -")
        return v

    @field_validator("time_limit", mode="before")
    @classmethod
    def _time_is_text(cls, v):
        if isinstance(v, int):  # YAML 1.1 reads an unquoted 12:00:00 as the number 43200
            raise ValueError(f"cluster.time_limit={v} is a number: quote it in YAML, e.g. \"12:00:00\"")
        return v

    @field_validator("time_limit")
    @classmethod
    def _time(cls, v: str) -> str:
        time_limit_seconds(v)
        return v.strip()

    @field_validator("mounts")
    @classmethod
    def _mounts(cls, v: list[str]) -> list[str]:
        for m in v:
            parts = m.split(":")
            if len(parts) not in (2, 3) or not all(parts[:2]) or any(c in m for c in " ,;'\"$"):
                raise ValueError(f"cluster.mounts entry {m!r} is not SRC:DST[:FLAGS] (no spaces or commas)")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for k in v:
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", k):
                raise ValueError(f"cluster.env key {k!r} is not a shell variable name")
        return {k: str(x) for k, x in v.items()}

    @field_validator("sbatch_extra")
    @classmethod
    def _extra(cls, v: list[str]) -> list[str]:
        for opt in v:
            if not opt.startswith("-") or "\n" in opt:
                raise ValueError(f"cluster.sbatch_extra entry {opt!r} must be one sbatch option, e.g. '--exclusive'")
            name = opt.split("=", 1)[0].split()[0]
            if name in _OWNED:
                raise ValueError(
                    f"cluster.sbatch_extra sets {name}, which rz submit writes itself; use the cluster "
                    "section's own field (time_limit, partition, account, qos, learner/rollout nodes, "
                    "signal_warning_s, requeue, log_dir, job_name)"
                )
        return v

    @field_validator("signal_warning_s")
    @classmethod
    def _signal(cls, v: int) -> int:
        if not 0 < v <= MAX_SIGNAL_S:
            raise ValueError(f"cluster.signal_warning_s must be in 1..{MAX_SIGNAL_S} (SLURM's --signal limit)")
        return v

    @field_validator("max_restarts")
    @classmethod
    def _restarts(cls, v: int) -> int:
        if v < 0:
            raise ValueError("cluster.max_restarts must be >= 0")
        return v

    @model_validator(mode="after")
    def _check(self) -> ClusterConfig:
        limit = time_limit_seconds(self.time_limit)
        if self.signal_warning_s >= limit:
            raise ValueError(
                f"cluster.signal_warning_s={self.signal_warning_s} is not shorter than cluster.time_limit="
                f"{self.time_limit} ({limit} s): the warning would come before the job starts; lower it"
            )
        if self.mounts and not self.container_image:
            raise ValueError("cluster.mounts are container mounts: set cluster.container_image too")
        for name, g in (("learner", self.learner), ("rollout", self.rollout)):
            if g.gpus_per_node > 0 and g.gpu_memory_gb is None:
                raise ValueError(
                    f"cluster.{name}.gpu_memory_gb is needed with GPUs for the memory plan "
                    "(80 for H100 80GB, 141 for H200)"
                )
        if self.rollout.procs_per_node is not None:
            raise ValueError("cluster.rollout.procs_per_node: the rollout side runs one vllm serve per engine (rz submit derives the count)")
        return self
