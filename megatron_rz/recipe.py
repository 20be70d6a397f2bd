"""The one typed description of a run.

A recipe is a YAML file validated by these pydantic models, plus `key.path=value` overrides from
the command line. Everything else reads the `Recipe` object; nothing re-parses YAML. Unknown keys
and impossible values fail here, before any engine starts, with a message naming the key and a fix.

This module imports neither Megatron nor vLLM, so every process (rollout workers included) may
read a recipe.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kernels.families import FAMILIES, NAMES, Family, family
from megatron_rz.cluster import ClusterConfig
from vllm_bridge.weights import refusal as weight_transport_refusal


class RecipeError(ValueError):
    """A recipe that cannot run, with a message that says what to change."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


# Ranges of numeric fields. A value outside one fails in load_recipe with one line naming the key,
# the value, the range and the default (see _format_errors), before anything starts.
Pos = Annotated[int, Field(ge=1)]
NonNeg = Annotated[int, Field(ge=0)]
PosF = Annotated[float, Field(gt=0)]
NonNegF = Annotated[float, Field(ge=0)]
Beta = Annotated[float, Field(ge=0, lt=1)]


class ModelConfig(_Strict):
    """Architecture and sizes. `arch` picks the Hugging Face class both engines load natively."""

    # deepseek_v4: learner megatron_rz/learner/deepseek_v4.py (DP + EP), aligned vLLM class vllm_bridge/aligned/deepseek_v4.py.
    # qwen2: dense Qwen2ForCausalLM (q/k/v biases, no QK-norm; num_experts=0, head_dim = hidden / heads).
    # deepseek_v41: DeepSeek-V4.1 (engram, delayed hc pre-mix, compressed layers of ratio 1 / 2): the V4
    # learner module, kernels/models/dsv41.py, vllm_bridge/aligned/deepseek_v41.py.
    # kimi_k3: Kimi-Linear / K3 class (KDA + NoPE MLA + latent MoE): learner megatron_rz/learner/kimi_k3.py
    # (DP + EP), kernels/models/kimi_k3.py, vllm_bridge/aligned/kimi_k3.py. KDA heads = num_attention_heads of
    # head_dim; MLA sizes as deepseek_v3's keys; the K3 options are set in tiny_models.TINY_KIMI_K3.
    arch: Literal[NAMES] = "qwen3_moe"  # a kernels/families.py entry
    # A Hugging Face checkpoint directory to start from (config.json, *.safetensors, tokenizer; on a
    # filesystem every node sees) instead of the tiny-model warm start. Its config must match this
    # section (megatron_rz/learner/pretrained.py checks it before anything starts).
    pretrained: str | None = None
    hidden_size: Pos = 64
    num_layers: Pos = 2
    num_attention_heads: Pos = 2
    num_kv_heads: Pos = 2
    head_dim: Pos = 32
    vocab_size: Pos = 64
    max_position_embeddings: Annotated[int, Field(ge=2)] = 128
    rope_theta: PosF = 10000.0
    rms_norm_eps: PosF = 1e-6
    dtype: Literal["float32", "bfloat16"] = "float32"
    tie_word_embeddings: bool = False
    # MoE; num_experts=0 (and top_k=0) is a dense model: every layer an MLP of dense_ffn_hidden_size
    num_experts: NonNeg = 8
    top_k: NonNeg = 2
    moe_ffn_hidden_size: Pos = 64
    num_shared_experts: NonNeg = 0
    dense_ffn_hidden_size: Pos = 128  # for the first `first_k_dense` layers (DeepSeek)
    first_k_dense: NonNeg = 0
    router_score: Literal["softmax", "sigmoid", "sqrtsoftplus"] = "softmax"  # sqrtsoftplus: deepseek_v4
    router_expert_bias: bool = False  # DeepSeek-V3 aux-loss-free bias (noaux_tc)
    router_num_groups: Pos = 1
    router_group_topk: Pos = 1
    routed_scaling_factor: PosF = 1.0
    norm_topk_prob: bool = True
    # MLA (deepseek_v3 only)
    q_lora_rank: Pos | None = None
    kv_lora_rank: Pos = 512
    qk_nope_head_dim: Pos = 32
    qk_rope_head_dim: Pos = 64
    v_head_dim: Pos = 32
    # DeepSeek-V4 (deepseek_v4 only; Hugging Face DeepseekV4Config names). head_dim is the single
    # shared KV head's width, q_lora_rank the query low rank, qk_rope_head_dim its rotary part.
    o_groups: Pos = 8
    o_lora_rank: Pos = 1024
    hc_mult: Pos = 4
    index_n_heads: Pos = 64
    index_head_dim: Pos = 128
    sliding_window: Pos = 128
    compress_ratios: list[int] = []  # per layer: 0 sliding window only, 4 compressed sparse, 128 heavily compressed
    # Defaults below: the tiny config vLLM-CPU runs (recipes/tiny_dsv4.yaml); DeepSeek-V4-Flash has 3 hash layers.
    num_hash_layers: NonNeg = 2  # the first N MoE layers route by a fixed token-id -> experts table (tid2eid)
    index_topk: Pos = 512  # compressed entries each query keeps in compressed sparse layers (vLLM-CPU: 512)
    compress_rope_theta: PosF = 160000.0  # RoPE base of the compressed (ratio > 1) layers
    swiglu_limit: PosF = 10.0  # routed experts clamp their gate/up pre-activations to this
    # Blockwise FP8 (DeepSeek-V3 / vLLM block quantisation) inside the models, aligned mode: every
    # attention projection and dense / shared / routed expert linear runs as an e4m3 GEMM with
    # 128x128 weight scales and per-token 1x128 activation scales (kernels/fp8.py); router gate,
    # lm_head, embeddings and norms stay in model.dtype (DeepSeek-V4 / V4.1: the linears of
    # kernels.models.dsv4.FP8_LINEARS; needs o_lora_rank % 128 == 0). The learner fake-quantises its master
    # weights each forward (straight-through gradients); the engine quantises them once per weight
    # sync. Learner parallel.tp > 1: qwen3_moe and deepseek_v3, with the shape rules of fp8_tp_problems
    # (docs/tp.md "FP8").
    fp8: Literal["none", "blockwise"] = "none"

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if (self.num_experts == 0) != (self.top_k == 0):
            raise ValueError(
                f"model.num_experts={self.num_experts} with model.top_k={self.top_k}: a MoE model needs "
                "top_k >= 1, a dense one num_experts=0 and top_k=0")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}; lower model.top_k")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}; pick num_kv_heads dividing it"
            )
        self._family_rules(family(self.arch))
        if self.first_k_dense >= self.num_layers:
            raise ValueError("model.first_k_dense must leave at least one MoE layer (< num_layers)")
        return self

    def _family_rules(self, f: Family) -> None:
        """The recipe rules of model family ``f`` (kernels/families.py holds them as data)."""
        if not f.moe and (self.num_experts or self.top_k):
            raise ValueError(f"model.arch={f.name} is dense: set model.num_experts=0 and model.top_k=0 "
                             f"(got {self.num_experts}, {self.top_k})")
        if f.head_dim_from_hidden and self.head_dim * self.num_attention_heads != self.hidden_size:
            raise ValueError(
                f"model.arch={f.name} has head_dim = hidden_size / num_attention_heads: model.head_dim={self.head_dim} "
                f"x {self.num_attention_heads} heads != hidden_size={self.hidden_size}; set model.head_dim="
                f"{self.hidden_size // self.num_attention_heads}")
        if f.cpu_head_dims and self.head_dim not in f.cpu_head_dims:
            raise ValueError(
                f"head_dim={self.head_dim}: vLLM's CPU attention supports head_dim in "
                f"{{{', '.join(map(str, f.cpu_head_dims))}}}; set model.head_dim=32 or 64")
        if f.vllm_cpu_sizes and any(getattr(self, k) != v for k, v in f.vllm_cpu_sizes):
            raise ValueError(
                f"{f.name} on vLLM-CPU needs " + " and ".join(f"model.{k}={v}" for k, v in f.vllm_cpu_sizes)
                + f" (got {', '.join(str(getattr(self, k)) for k, _ in f.vllm_cpu_sizes)})")
        if f.grouped_router:
            if self.num_experts % self.router_num_groups:
                raise ValueError(
                    f"router_num_groups={self.router_num_groups} must divide num_experts={self.num_experts}")
            if self.router_group_topk > self.router_num_groups:
                raise ValueError("model.router_group_topk cannot exceed model.router_num_groups")
        if f.compress_ratios and (len(self.compress_ratios) != self.num_layers
                                  or set(self.compress_ratios) - set(f.compress_ratios)):
            raise ValueError(f"{f.name} needs model.compress_ratios: one of {', '.join(map(str, f.compress_ratios))} "
                             f"per layer (num_layers entries{f.compress_ratios_note})")
        if f.hash_routing and not 0 <= self.num_hash_layers <= self.num_layers:
            raise ValueError(f"model.num_hash_layers={self.num_hash_layers} must be in [0, num_layers={self.num_layers}]")
        if self.router_score not in f.router_scores:
            raise ValueError(f.router_refusal or f"model.router_score={self.router_score} is not one of "
                             f"{', '.join(f.router_scores)} for model.arch={f.name}")
        if self.fp8 != "none" and f.fp8_refusal:
            raise ValueError(f.fp8_refusal)
        if self.fp8 != "none" and f.fp8_o_lora_block and self.o_lora_rank % _FP8_BLOCK:
            # kernels.models.dsv4.fp8_problems (engine TP > 1 rules: the planner's check_rollout_tp)
            raise ValueError(
                f"model.fp8=blockwise for {f.name} needs model.o_lora_rank a multiple of {_FP8_BLOCK} (wo_a's "
                f"output groups must start on {_FP8_BLOCK}-row weight blocks): got {self.o_lora_rank}; set "
                f"model.o_lora_rank={-(-self.o_lora_rank // _FP8_BLOCK) * _FP8_BLOCK}, or model.fp8=none")


class ParallelConfig(_Strict):
    """Learner layout. world size = tp * pp * dp; experts are split ep ways across tp*dp."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    dp: int = 1
    # Megatron's distributed optimizer (ZeRO-1): fp32 master weights and Adam moments sharded over
    # the data-parallel ranks (expert parameters over the expert-data-parallel ones); gradients
    # reduce-scattered, parameters all-gathered. Same updates as the plain optimizer (to fp32
    # reduction order); the memory plan divides optimizer state accordingly.
    distributed_optimizer: bool = False
    # Seconds a learner collective waits for the other ranks before it raises (a dead or hung rank
    # becomes an error, not a hang); null: torch's defaults (gloo 30 min, NCCL 10 min). Megatron's
    # subgroups take whole minutes (rounded up).
    collective_timeout_s: PosF | None = None

    @field_validator("tp", "pp", "ep", "etp", "dp")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v < 1:
            raise ValueError("parallel sizes must be >= 1")
        return v

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @model_validator(mode="after")
    def _check(self) -> ParallelConfig:
        if (self.tp * self.dp) % (self.ep * self.etp):
            raise ValueError(
                f"ep*etp={self.ep * self.etp} must divide tp*dp={self.tp * self.dp} "
                "(Megatron carves expert parallelism out of the tp x dp ranks); raise parallel.dp or lower parallel.ep"
            )
        if self.pp != 1:
            raise ValueError("parallel.pp > 1 is not supported by the CPU learner yet; set parallel.pp=1")
        return self


class RolloutConfig(_Strict):
    engine: Literal["vllm"] = "vllm"
    num_engines: int = 1
    tensor_parallel_size: int = 1
    # vLLM pipeline parallelism: each engine spans tensor_parallel_size x pipeline_parallel_size GPUs,
    # stage r holding a contiguous block of decoder layers (an engine wider than a node: TP inside a
    # node, PP across nodes). The aligned Qwen3-MoE / Qwen2 / DeepSeek-V3 classes keep the bits.
    pipeline_parallel_size: int = 1
    samples_per_prompt: int = 8
    prompts_per_step: int = 16
    max_new_tokens: int = 8
    # The sampling contract (kernels/sampling.py): the rollout logprob is that of the distribution
    # sampled from (temperature, then top-k, then top-p); the learner computes the same one.
    temperature: float = 1.0
    top_p: float = 1.0  # 1: off
    top_k: int = -1  # -1 / 0: off; ties at the k-th logit go to the lower token id
    # What vLLM also honours but the learner does not compute: refused in mode=aligned (see
    # Recipe._sampling_contract); in mode=fast passed to vLLM as they are (its logprobs then include
    # them and the learner's do not: a mismatch fast mode reports).
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = {}
    min_tokens: int = 0
    max_num_seqs: int = 256
    kv_cache_gb: float = 1.0
    # The engine's dtype; None = model.dtype. mode=fast only: e.g. bf16 rollouts beside an fp32
    # learner, the common deployment whose mismatch aligned mode exists to remove.
    dtype: Literal["float32", "bfloat16"] | None = None
    verify_sync: bool = True  # after each sync, check vLLM's logprobs now follow the new weights
    # How the learner's weights reach the engine (vllm_bridge/weights/select.py has the table): "auto" =
    # for one local engine at max_lag 0 CUDA IPC on a GPU machine and in-process bytes on CPU, bucket
    # files otherwise; "inprocess";
    # "filesystem" (version directories of bucket files the workers read); "nccl" (vLLM's NCCL weight
    # transfer, CUDA, engine on other GPUs); "ipc" (CUDA IPC handles, device to device: learner and
    # engine colocated, max_lag 0, local); "reshard" (every learner rank writes only the engine
    # workers' slices of what it holds, docs/tp.md "Resharding learner -> engine": max_lag 0, local,
    # mode=aligned). Whole tensors otherwise: gathered to learner rank 0, sent to every worker.
    weight_transport: Literal["auto", "inprocess", "filesystem", "nccl", "ipc", "reshard"] = "auto"
    # Asynchronous runs (schedule.max_lag > 0, bucket files for the rollout process): host memory (GB) for
    # weight versions copied off the learner and waiting to be written by a background thread, so the
    # learner's critical path holds only the copy; a model larger than this is partly written inline.
    # 0 = every file written on the critical path.
    background_write_gb: NonNegF = 4.0
    # Verify every parameter's bytes after every verify_every-th sync (1: every sync; the check reads the
    # weights once on each side, ~0.27 s per GB on one CPU core: docs/architecture.md "Reliability").
    verify_every: int = 1
    # Where the engines run: "local" = one in-process vLLM engine on learner rank 0; "servers" = the
    # `vllm serve` processes of an `rz submit` job's rollout nodes (vllm_bridge.server_client.connect;
    # rz submit sets it for the learner), found in RUN_DIR/rollout/servers/.
    where: Literal["local", "servers"] = "local"
    server_wait_s: PosF = 600.0  # how long the learner waits for the servers' records
    # A server that does not answer GET /health for this long is named dead (the bound is 60 s).
    server_dead_after_s: PosF = 30.0
    # A local engine that is alive but makes no engine step (no new token) for this long during a
    # generate is named stuck: it is restarted with the current weights and the step re-run, as a
    # dead one (schedule.engine_restarts). Bounds one engine step (a prefill included), not a call.
    stall_timeout_s: PosF = 300.0

    @field_validator("server_dead_after_s")
    @classmethod
    def _dead_after(cls, v: float) -> float:
        if v > 50:
            raise ValueError("rollout.server_dead_after_s must be <= 50 (a dead server is named within 60 s)")
        return v

    @field_validator("temperature")
    @classmethod
    def _temp(cls, v: float) -> float:
        if v <= 0:
            raise ValueError("rollout.temperature must be > 0 (RL needs sampling); use 1.0")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float) -> float:
        if not 0 < v <= 1:
            raise ValueError("rollout.top_p must be in (0, 1]")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v < -1:
            raise ValueError("rollout.top_k must be -1 or 0 (off) or >= 1")
        return v

    @field_validator("min_p")
    @classmethod
    def _min_p(cls, v: float) -> float:
        if not 0 <= v <= 1:
            raise ValueError("rollout.min_p must be in [0, 1] (0: off)")
        return v

    # field name -> its neutral value (what vLLM does when the field is off)
    OUTSIDE_CONTRACT: ClassVar[dict[str, Any]] = {
        "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
        "logit_bias": {}, "min_tokens": 0,
    }

    def sampling_contract(self) -> dict[str, Any]:
        """The settings both sides compute with (learner logprobs, kernels.sampled_logprobs)."""
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}

    def sampling_kwargs(self) -> dict[str, Any]:
        """Everything the engine's generate() takes: the contract plus any non-neutral extra."""
        extra = {k: getattr(self, k) for k, off in self.OUTSIDE_CONTRACT.items() if getattr(self, k) != off}
        return {**self.sampling_contract(), **extra}

    @field_validator("samples_per_prompt")
    @classmethod
    def _g(cls, v: int) -> int:
        if v < 2:
            raise ValueError("rollout.samples_per_prompt must be >= 2: the group-mean baseline needs a group")
        return v


class AlgoConfig(_Strict):
    """The loss. reinforce_zero is the method; the others are the comparison baselines."""

    name: Literal["reinforce_zero", "dapo", "tis", "icepop", "mis"] = "reinforce_zero"
    # dapo: clip-higher PPO-style ratio clipping, token-level aggregation, dynamic sampling,
    # overlong reward shaping.
    dapo_eps_low: NonNegF = 0.2
    dapo_eps_high: NonNegF = 0.28
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal and refill the batch
    overlong_buffer: NonNeg = 0  # tokens before max_new_tokens where the length penalty ramps in
    overlong_penalty: NonNegF = 1.0
    # tis: truncated IS weight min(w, tis_cap); icepop: tokens with w outside [low, high] masked;
    # mis: whole responses whose sequence-level weight exceeds mis_threshold are dropped.
    tis_cap: PosF = 2.0
    icepop_low: NonNegF = 0.5
    icepop_high: PosF = 2.0
    mis_threshold: PosF = 2.0
    lr: PosF = 1e-4
    weight_decay: NonNegF = 0.0
    adam_beta1: Beta = 0.9
    adam_beta2: Beta = 0.999
    grad_clip: NonNegF = 1.0
    micro_batch_size: Pos = 64  # sequences per learner forward
    # Non-finite guard: an update whose loss or gradient norm is NaN/inf is skipped (not applied;
    # counted in metrics as skipped_updates); this many in a row stop the run with the reason.
    max_bad_updates: Pos = 3

    @model_validator(mode="after")
    def _check(self) -> AlgoConfig:
        if self.icepop_low >= self.icepop_high:
            raise ValueError(f"algo.icepop_low={self.icepop_low} must be < algo.icepop_high={self.icepop_high}")
        return self


class TaskConfig(_Strict):
    """What the policy is trained and evaluated on (megatron_rz/rl/tasks.py and beside it).

    name: the built-in toy tasks ``arithmetic`` / ``chain_sum`` (tiny models), ``dataset`` (local
    jsonl / json / parquet / csv / arrow files through `datasets`: megatron_rz/rl/dataset_task.py),
    ``reasoning_gym`` (a reasoning-gym generator, ``kwargs: {dataset: NAME, ...}``:
    megatron_rz/rl/gym_task.py), or "package.module:factory" for a user task."""

    name: str = "arithmetic"
    digits: Pos = 2
    ops: Annotated[list[Literal["+", "-", "*"]], Field(min_length=1)] = ["+"]
    # Held-out prompts: the toy and reasoning-gym tasks draw this many; a dataset task without
    # task.eval_sets holds this many rows of task.path out of training (after the seeded shuffle).
    eval_prompts: Pos = 200
    seed: int = 1234  # the held-out split and the dataset's shuffle per epoch
    kwargs: dict[str, Any] = {}
    # ---- dataset task (name: dataset)
    path: str | None = None  # the training file (.jsonl, .json, .parquet, .csv, .arrow)
    # Named held-out files (same columns), each evaluated and logged as eval/<name>/...; empty: one
    # set "heldout" split off task.path.
    eval_sets: dict[str, str] = {}
    prompt_key: str = "prompt"  # column holding the question (a string, or a list of chat messages)
    answer_key: str = "answer"  # column holding the reference answer
    # The user message: a Python format string over the row's columns ({prompt} is the prompt column),
    # e.g. "{prompt}\nPut your final answer within \\boxed{{}}."
    prompt_template: str = "{prompt}"
    system_prompt: str | None = None
    # "auto": the tokenizer's own chat template (apply_chat_template) when it has one, else the
    # plain prompt text; "none": always the plain text; anything else: a Jinja chat template used
    # instead of the tokenizer's (e.g. for a tokenizer that has none).
    chat_template: str = "auto"
    # Passes over the training rows (each a fresh seeded shuffle). Set: it decides the run's length,
    # schedule.steps = ceil(epochs * rows / rollout.prompts_per_step) (rz train prints it and replaces
    # any schedule.steps); null: the rows cycle for schedule.steps updates.
    epochs: PosF | None = None
    # ---- rewards (dataset / reasoning_gym)
    # math_verify: the response's final or \\boxed{} answer equivalent to the reference
    # (math-verify's parse + verify); exact: the stripped response equals the stripped answer;
    # "package.module:fn": fn(response, answer, row) -> float. null: the task's own (reasoning_gym:
    # its scorer; dataset: math_verify).
    reward: str | None = None
    # A reward call that raises or runs longer than this scores 0 and is counted (reward_errors,
    # reward_timeouts in metrics.jsonl); the run goes on. Rewards run in a worker process.
    reward_timeout_s: PosF = 10.0
    # ---- evaluation (every schedule.eval_every updates, before and after the run)
    # k samples per held-out prompt at the rollout's sampling settings: avg@k (mean reward), pass@1
    # (share of correct samples, reward >= 1) and pass@k; 0: greedy accuracy only.
    eval_samples: NonNeg = 0
    eval_greedy: bool = True
    # ---- agentic tasks (multi-turn tool use: megatron_rz/rl/agentic.py, docs/agentic.md)
    max_turns: Pos = 4  # model turns per episode (rollout.max_new_tokens is per turn)
    tool_timeout_s: PosF = 5.0  # a tool call running longer is killed; its reply says so (counted)
    tool_output_chars: Pos = 200  # a tool's reply is cut to this many characters (counted)
    tools: list[str] = []  # more tools, "package.module:function" (fn(arg: str) -> str), beside the task's own
    lag_bound: Literal["token", "episode"] = "token"  # schedule.max_lag bounds each model token or each episode

    @model_validator(mode="after")
    def _check(self) -> TaskConfig:
        if self.name == "dataset" and not self.path:
            raise ValueError("task.name=dataset needs task.path: the training file (.jsonl, .json, .parquet, "
                             ".csv or .arrow), e.g. task.path=data/train.jsonl")
        if self.name in ("arithmetic", "chain_sum", "reasoning_gym"):  # (a user factory may read them)
            for key in ("path", "eval_sets"):
                if getattr(self, key):
                    raise ValueError(f"task.{key} is for task.name=dataset (task.name={self.name!r}); drop it "
                                     "or set task.name=dataset")
        if self.name == "reasoning_gym" and not isinstance(self.kwargs.get("dataset"), str):
            raise ValueError("task.name=reasoning_gym needs task.kwargs.dataset: the reasoning-gym dataset name, "
                             "e.g. task.kwargs.dataset=basic_arithmetic")
        if self.reward is not None and self.reward not in ("math_verify", "exact") and ":" not in self.reward:
            raise ValueError(f"task.reward={self.reward!r}: use math_verify, exact or a function "
                             "'package.module:fn' (fn(response, answer, row) -> float)")
        if not self.eval_greedy and not self.eval_samples:
            raise ValueError("task.eval_greedy=false with task.eval_samples=0 leaves nothing to evaluate; "
                             "set task.eval_samples=4 or task.eval_greedy=true")
        for tool in self.tools:
            if ":" not in tool:
                raise ValueError(f"task.tools entry {tool!r}: name a function 'package.module:function'")
        for name in self.eval_sets:
            if not name or not set(name) <= _NAME_CHARS:
                raise ValueError(f"task.eval_sets name {name!r}: use letters, digits and _ . - (it names metrics)")
        return self


class WarmStartConfig(_Strict):
    """Supervised warm start on the task so RL starts with signal (seconds on CPU)."""

    steps: NonNeg = 300
    batch_size: Pos = 64
    lr: PosF = 3e-3
    tokenizer_vocab: Pos = 64
    # Share of warm-start examples whose answer is replaced by the task's distractor (a common
    # mistake, e.g. arithmetic without carrying) where the task has one. Above 0.5 the base model
    # prefers the mistake, so RL (which only sees the exact-match reward) has to overturn its
    # imitation: the embedded demo's stand-in for a base model that is capable but unreliable.
    distractor_rate: float = 0.0
    # Where the warm start trains: "cpu" (the tiny recipes: seconds) or "cuda" (the GPU recipes'
    # ~100M-1B models; fp32 master weights, bf16 autocast).
    device: Literal["cpu", "cuda"] = "cpu"

    @field_validator("distractor_rate")
    @classmethod
    def _rate(cls, v: float) -> float:
        if not 0.0 <= v < 1.0:
            raise ValueError("warm_start.distractor_rate must be in [0, 1)")
        return v


class ScheduleConfig(_Strict):
    steps: Pos = 40
    seed: NonNeg = 0
    # Policy lag bound: the learner may train on samples generated up to max_lag updates ago.
    # 0 = synchronous (rollout, update, sync in turn); k > 0 = rollout and learner run at once.
    max_lag: NonNeg = 0
    eval_every: NonNeg = 0
    # Wall-clock budget of the update loop in seconds (0: none). When an update ends past it, the
    # run finishes there as if `steps` were reached: final checkpoint, evaluation, summary
    # (`stopped_by`), plots; `checkpoint.load=latest` continues it later (a GPU session's runs
    # concatenated, a SLURM job's time limit).
    time_limit_s: NonNegF = 0.0
    # A local vLLM engine that dies (or stalls: rollout.stall_timeout_s) is restarted with the
    # current weights and the interrupted work re-run (same prompts and seeds) this many times per
    # run: the synchronous loop's batch, push or evaluation, the rollout process's unfinished
    # batches (max_lag > 0); then the run stops. 0: the first death stops the run.
    engine_restarts: NonNeg = 2


class LoggingConfig(_Strict):
    run_dir: str = "runs/{name}"
    wandb: bool = True
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    wandb_project: str = "reinforce-zero"
    plots: bool = True
    progress: bool = True
    verbose: bool = False  # also Megatron's import-time fallback warnings and vLLM's INFO log lines


class CheckpointConfig(_Strict):
    every: NonNeg = 0  # 0: only at the end
    # a checkpoint dir to resume from, or "latest": the newest complete one in this run dir (none yet:
    # start fresh), which is what a requeued SLURM job uses
    load: str | None = None
    # How a checkpoint is verified before it is loaded: hash re-reads every file against its BLAKE2b
    # digest; size compares sizes only (no re-read: for very large runs).
    verify: Literal["hash", "size"] = "hash"
    # How many of this run's newest complete checkpoints stay on disk: after each save, older ones
    # (and older unfinished ones) in this run directory's checkpoints/ are deleted. 0 keeps all. A
    # long run (checkpoint.every=25 over 20,000 updates: 800 checkpoints) wants 2 or more: the
    # newest may turn out damaged, and checkpoint.load=latest then falls back to the one before.
    keep: NonNeg = 0


class RuntimeConfig(_Strict):
    """How the run's processes execute; megatron_rz.launch.runtime applies it to this process and, through
    the environment, to the processes it starts (torchrun ranks, vLLM's workers)."""

    # auto: the Triton kernels for CUDA tensors, the exact reference ops elsewhere; reference: the
    # reference ops on every device (slow on a GPU; for diagnosis). CPU runs compute the same either way.
    kernels: Literal["auto", "reference"] = "auto"
    gemm_small_tiles: bool = True  # GPU GEMM: the short-K tile table (same bits either way; speed only)
    # GPU GEMM: the measured per-GPU table of tile picks (kernels/triton/gemm_table.py): auto (the
    # committed table of this GPU model, where there is one), off (heuristic picks), or a table's path
    gemm_table: str = "auto"
    # CPU: the compiled exact kernels (kernels/_native.c; same bits as the torch reference, faster);
    # false: the torch reference code. Read once per process, at the first kernel call.
    native_cpu_kernels: bool = True
    vllm_patches: bool = True  # false: vLLM without vllm_bridge/vllm_patches.py's fixes (diagnosis only)
    # The fast learner's layers (mode=fast; aligned mode builds its own whatever this says):
    # auto: Megatron's Transformer Engine spec where transformer_engine.pytorch imports on a CUDA
    # machine, else its local spec; on: the TE spec, refused before anything starts where TE cannot
    # run; off: the local spec. Which one ran: `learner_spec` in summary.json / check.json
    # (megatron_rz/learner/te_spec.py, docs/gpu.md "Transformer Engine").
    te: Literal["auto", "on", "off"] = "auto"

    @field_validator("gemm_table", mode="before")
    @classmethod
    def _gemm_table_file(cls, v):
        if isinstance(v, bool):  # YAML 1.1 reads a bare off / on as a boolean
            v = "auto" if v else "off"
        if v not in ("auto", "off") and not Path(v).is_file():
            raise ValueError(f"{v!r} is not a file: give auto, off or the path of a table written by "
                             "benchmarks/gpu_kernels.py --sweep --table-out")
        return v

    @field_validator("te", mode="before")
    @classmethod
    def _te_yaml_bool(cls, v):
        # YAML 1.1 reads a bare on / off (also yes / no, true / false) as a boolean
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v


class Recipe(_Strict):
    name: str = "tiny_moe"
    # aligned: learner and vLLM both compute through `kernels` (bitwise-equal logprobs);
    # fast: stock vLLM model classes and stock Megatron layers (the mismatch baseline).
    mode: Literal["aligned", "fast"] = "aligned"
    model: ModelConfig = ModelConfig()
    parallel: ParallelConfig = ParallelConfig()
    rollout: RolloutConfig = RolloutConfig()
    algo: AlgoConfig = AlgoConfig()
    task: TaskConfig = TaskConfig()
    warm_start: WarmStartConfig = WarmStartConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    logging: LoggingConfig = LoggingConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    # Where `rz submit` runs the recipe (SLURM); unused by rz train. See megatron_rz/cluster.py.
    cluster: ClusterConfig = ClusterConfig()

    def engine_kwargs(self) -> dict[str, Any]:
        """RolloutEngine's keyword arguments for this run (besides the checkpoint directory): the one
        place they are written, used by the in-process engine and by the `vllm serve` of each
        rollout node (rz submit renders them into the batch script: vllm_bridge.serve --engine-args)."""
        r = self.rollout
        return dict(dtype=r.dtype or self.model.dtype, seed=self.schedule.seed, max_num_seqs=r.max_num_seqs,
                    kv_cache_gb=r.kv_cache_gb, max_model_len=self.model.max_position_embeddings,
                    aligned=self.mode == "aligned", tensor_parallel_size=r.tensor_parallel_size, fp8=self.model.fp8,
                    # only when > 1: the engine arguments of PP=1 recipes are unchanged
                    **({"pipeline_parallel_size": r.pipeline_parallel_size} if r.pipeline_parallel_size > 1 else {}),
                    # vLLM's NCCL weight-transfer engine in every worker (rollout.weight_transport=nccl)
                    **({"weight_transfer_config": {"backend": "nccl"}} if r.weight_transport == "nccl" else {}))

    @model_validator(mode="after")
    def _sampling_contract(self) -> Recipe:
        """mode=aligned: a rollout sampling field the learner does not compute is refused."""
        if self.mode == "aligned":
            r = self.rollout
            for key, off in r.OUTSIDE_CONTRACT.items():
                if getattr(r, key) != off:
                    raise ValueError(
                        f"rollout.{key}={getattr(r, key)!r} is outside the aligned sampling contract (temperature, "
                        f"top_k, top_p; kernels/sampling.py): vLLM would apply it and the learner would not; set "
                        f"rollout.{key}={off!r} or use mode=fast")
        return self

    @model_validator(mode="after")
    def _cross(self) -> Recipe:
        m, p = self.model, self.parallel
        _check_ranges(self)
        if not self.name or not set(self.name) <= _NAME_CHARS:
            raise ValueError(f"name={self.name!r}: use letters, digits and _ . - (it names the run directory)")
        try:
            self.logging.run_dir.format(name=self.name)
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"logging.run_dir={self.logging.run_dir!r}: only {{name}} may be substituted ({e!r}); "
                             "e.g. logging.run_dir=runs/{name}") from None
        if self.algo.overlong_buffer >= self.rollout.max_new_tokens:
            raise ValueError(
                f"algo.overlong_buffer={self.algo.overlong_buffer} must be < rollout.max_new_tokens="
                f"{self.rollout.max_new_tokens}; lower it (0 disables the length penalty)")
        if self.rollout.max_new_tokens >= m.max_position_embeddings:
            raise ValueError(
                f"rollout.max_new_tokens={self.rollout.max_new_tokens} leaves no room for the prompt in "
                f"model.max_position_embeddings={m.max_position_embeddings}; lower it or raise the context")
        if self.mode == "aligned" and self.rollout.dtype not in (None, m.dtype):
            raise ValueError(
                f"rollout.dtype={self.rollout.dtype} differs from model.dtype={m.dtype}: aligned mode computes "
                "the same numbers on both sides, so it needs one dtype; drop rollout.dtype or use mode=fast"
            )
        if self.mode == "fast" and self.runtime.te == "on" and family(m.arch).learner is not None:
            raise ValueError(
                f"runtime.te=on: model.arch={m.arch} has its own learner, not Megatron's layer specs, so there "
                "are no Transformer Engine layers to build; set runtime.te=auto or off")
        if m.fp8 != "none" and self.mode != "aligned":
            raise ValueError(
                f"model.fp8={m.fp8} runs in the aligned model classes on both sides (the stock vLLM and "
                "Megatron paths have no matching FP8 linears): use mode=aligned, or model.fp8=none")
        if m.fp8 != "none" and p.tp > 1:  # the row-parallel FP8 contract's shape rules (docs/tp.md "FP8")
            bad = fp8_tp_problems(m, p.tp)
            if bad:
                raise ValueError(fp8_tp_message(m, p.tp, bad[0]))
        if m.num_experts % p.ep:
            raise ValueError(f"parallel.ep={p.ep} must divide model.num_experts={m.num_experts}")
        if m.num_attention_heads % p.tp or m.num_kv_heads % p.tp:
            raise ValueError(
                f"parallel.tp={p.tp} must divide model.num_attention_heads={m.num_attention_heads} "
                f"and model.num_kv_heads={m.num_kv_heads}"
            )
        r = self.rollout
        why = weight_transport_refusal(r.weight_transport, where=r.where, max_lag=self.schedule.max_lag, mode=self.mode,
                                       arch=m.arch)
        if why:
            raise ValueError(why)
        if m.pretrained and "task" not in self.model_fields_set:
            raise ValueError(
                f"model.pretrained={m.pretrained!r} with no task: section would train on the built-in toy task "
                f"({self.task.name}); name the task, e.g. task: {{name: dataset, path: /shared/data/math/train.jsonl, "
                "reward: math_verify}")
        if self.warm_start.tokenizer_vocab > m.vocab_size:
            raise ValueError(
                f"warm_start.tokenizer_vocab={self.warm_start.tokenizer_vocab} exceeds "
                f"model.vocab_size={m.vocab_size}; raise model.vocab_size"
            )
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.logging.run_dir.format(name=self.name))


_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")

# Ranges of the fields of sections declared with plain types (the rollout section): (key, min, strict).
_RANGES = [
    ("rollout.num_engines", 1, False), ("rollout.tensor_parallel_size", 1, False),
    ("rollout.pipeline_parallel_size", 1, False),
    ("rollout.prompts_per_step", 1, False), ("rollout.max_new_tokens", 1, False),
    ("rollout.max_num_seqs", 1, False), ("rollout.verify_every", 1, False), ("rollout.kv_cache_gb", 0, True),
]


def _check_ranges(recipe: Recipe) -> None:
    for key, low, strict in _RANGES:
        section, _, field = key.partition(".")
        v = getattr(getattr(recipe, section), field, None)
        if v is None or (v > low if strict else v >= low):
            continue
        default = type(getattr(recipe, section)).model_fields[field].default
        raise ValueError(f"{key}={v}: must be {'>' if strict else '>='} {low}; e.g. {key}={default} (the default)")


# ---------------------------------------------------------------- loading and overrides


class DuplicateKeyError(yaml.MarkedYAMLError):
    """A YAML mapping that names one key twice (YAML keeps the last value silently; we refuse)."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping with a repeated key, at any depth."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:  # the keys written here (a key over a `<<: *anchor` merge is no repeat)
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: the base class names it
                    continue
                if first is not None:
                    raise DuplicateKeyError(None, None, f"duplicate key {key!r} (first at line {first})",
                                            key_node.start_mark)
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """yaml.safe_load, but a mapping naming one key twice (any depth) raises DuplicateKeyError."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)


def _parse_value(text: str, key: str = "override") -> Any:
    # YAML scalars: 3e-5 -> float, true -> bool, [1,2] -> list; keep plain strings as they are
    # (and text YAML cannot parse, e.g. "[+": the schema then names the key and the type it wants).
    try:
        value = load_yaml(text)
    except DuplicateKeyError as e:
        raise RecipeError(f"override {key}={text}: {e.problem} in one mapping; name each key once") from None
    except yaml.YAMLError:
        return text
    return text if value is None and text not in ("null", "~", "") else value


def _section(parts: list[str]) -> type[BaseModel] | None:
    """The schema class at a dotted path (None below a free-form field such as task.kwargs)."""
    model: type[BaseModel] | None = Recipe
    for part in parts:
        if model is None or part not in model.model_fields:
            return None
        ann = model.model_fields[part].annotation
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return model


# Keys that were renamed: the old spelling gets a one-line pointer to the new one.
RENAMED = {"rollout.weight_sync": "rollout.weight_transport (full: auto; reshard: reshard)"}


def _has_keys(ann) -> bool:
    """A field holding keys below it: a section, or a free-form mapping such as task.kwargs."""
    import typing

    return (isinstance(ann, type) and issubclass(ann, (BaseModel, dict))) or typing.get_origin(ann) is dict


def apply_override(data: dict, dotted: str) -> None:
    if "=" not in dotted:
        raise RecipeError(f"override {dotted!r} is not key.path=value (e.g. algo.lr=3e-5)")
    key, _, raw = dotted.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not all(parts):
        raise RecipeError(f"override {dotted!r}: {key!r} is not a key path (e.g. algo.lr=3e-5)")
    node: Any = data
    model: type[BaseModel] | None = Recipe
    for i, part in enumerate(parts):
        fields = model.model_fields if model is not None else {}
        if model is not None and part not in fields:
            if ".".join(parts[:i + 1]) in RENAMED:
                raise RecipeError(f"{'.'.join(parts[:i + 1])} is now {RENAMED['.'.join(parts[:i + 1])]}")
            where = ".".join(parts[:i]) or "the recipe"
            close = difflib.get_close_matches(part, list(fields), n=1)
            hint = f"; did you mean {'.'.join(parts[:i] + close)!r}?" if close else f"; valid keys: {', '.join(fields)}"
            raise RecipeError(f"unknown key {key!r}: {where} has no {part!r}{hint}")
        ann = fields[part].annotation if model is not None else None
        if model is not None and i < len(parts) - 1 and not _has_keys(ann):
            raise RecipeError(
                f"override {dotted!r}: {'.'.join(parts[: i + 1])} is a value, not a section with keys; "
                f"set it as {'.'.join(parts[: i + 1])}=VALUE")
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
        if i == len(parts) - 1:
            node[part] = _parse_value(raw, key)
        else:
            child = node.setdefault(part, {})
            if child is None:  # `model:` with nothing under it in the YAML
                child = node[part] = {}
            if not isinstance(child, dict):
                raise RecipeError(
                    f"override {dotted!r}: {'.'.join(parts[: i + 1])} is the value {child!r}, not a section "
                    "with keys; override it whole or drop the extra key path")
            node = child


_OPS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
_LIMIT = {"greater_than": "gt", "greater_than_equal": "ge", "less_than": "lt", "less_than_equal": "le"}


def _one_error(e: dict) -> str:
    loc = ".".join(str(x) for x in e["loc"]) or "(recipe)"
    msg = e["msg"].removeprefix("Value error, ")
    parent = _section([str(x) for x in e["loc"][:-1]])
    leaf = str(e["loc"][-1]) if e["loc"] else ""
    field = parent.model_fields.get(leaf) if parent is not None else None
    if e["type"] == "extra_forbidden":
        if loc in RENAMED:
            return f"{loc} is now {RENAMED[loc]}"
        known = list(parent.model_fields) if parent else []
        close = difflib.get_close_matches(leaf, known, n=1)
        return f"{loc}: unknown key; " + (f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(known)}")
    section = field is not None and _has_keys(field.annotation)
    if e["type"] in ("model_type", "dict_type"):
        return f"{loc}={e.get('input')!r}: must be a section of `key: value` lines, not a single value"
    if e["type"].startswith("model_") or e["type"] == "value_error" and (field is None or section):
        return f"{loc}: {msg}" if loc != "(recipe)" else msg  # cross-field checks name their keys
    value = e.get("input")
    shown = repr(value) if isinstance(value, str) else value
    fix = ""
    if e["type"] in _OPS:
        msg = f"must be {_OPS[e['type']]} {e['ctx'][_LIMIT[e['type']]]}"
    if e["type"] == "finite_number":  # nan, inf, -inf (allow_inf_nan=False on every section)
        msg = "must be a finite number (nan and inf are refused)"
    if field is not None and not isinstance(field.default, BaseModel):
        fix = f"; e.g. {loc}={'null' if field.default is None else field.default} (the default)"
    if isinstance(value, (dict, list)) and len(repr(value)) > 60:
        shown = type(value).__name__
    return f"{loc}={shown}: {msg}{fix}"


def _format_errors(err: ValidationError, source: str) -> str:
    """One line: every problem, each naming its key, its value and what to set instead."""
    problems = [_one_error(e) for e in err.errors()]
    head = f"invalid recipe {source}" + (f" ({len(problems)} problems)" if len(problems) > 1 else "")
    return f"{head}: " + " | ".join(p.replace("\n", " ") for p in problems)


def read_recipe_file(path: str | Path) -> dict:
    """The recipe file as a mapping, or a RecipeError naming what is wrong with the file."""
    p = Path(path)
    fix = "start from one of recipes/*.yaml"
    if p.is_dir():
        raise RecipeError(f"recipe {str(p)!r} is a directory, not a YAML file; {fix}")
    if not p.is_file():
        raise RecipeError(f"recipe file {str(p)!r} not found; the shipped recipes are in recipes/*.yaml")
    try:
        text = p.read_text()
    except UnicodeDecodeError:
        raise RecipeError(f"recipe {p} is not a text file (not UTF-8); {fix}") from None
    except OSError as e:
        raise RecipeError(f"recipe {p} cannot be read ({e.strerror}); check its permissions") from None
    try:
        data = load_yaml(text)
    except DuplicateKeyError as e:
        raise RecipeError(f"recipe {p} line {e.problem_mark.line + 1}: {e.problem} in one mapping; YAML would keep "
                          "the last value silently: keep one of them") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = getattr(e, "problem", None) or type(e).__name__
        raise RecipeError(f"recipe {p} is not valid YAML{where}: {what}; fix the file ({fix})") from None
    if data is None:
        raise RecipeError(f"recipe {p} is empty: an empty file is no recipe (defaults are not guessed); {fix}")
    if not isinstance(data, dict):
        raise RecipeError(f"recipe {p} must be a YAML mapping (key: value) at top level, not a "
                          f"{type(data).__name__}; {fix}")
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise RecipeError(f"recipe {p}: top-level key {bad[0]!r} is not a name; keys are section names such as model, algo")
    return data


def load_recipe(path: str | Path | None, overrides: list[str] = ()) -> Recipe:
    """Read a recipe YAML (or the defaults when path is None) and apply key=value overrides."""
    data: dict = {}
    source = "(defaults)"
    if path is not None:
        data = read_recipe_file(path)
        source = str(path)
    for ov in overrides:
        apply_override(data, ov)
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as err:
        raise RecipeError(_format_errors(err, source)) from None
    # typed float fields refuse nan / inf in pydantic (allow_inf_nan=False); free-form values
    # (task.kwargs, a task's own options) are not typed, so they are walked here
    key = _non_finite(recipe.model_dump())
    if key is not None:
        raise RecipeError(f"invalid recipe {source}: {key[0]}={key[1]}: must be a finite number (nan and inf are "
                          f"refused); set {key[0]} to a finite value or drop it")
    return recipe


def _non_finite(value: Any, path: str = "") -> tuple[str, float] | None:
    """(dotted key, value) of the first nan / inf float anywhere in ``value``, or None."""
    import math

    if isinstance(value, float) and not math.isfinite(value):
        return path, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for k, v in items:
        hit = _non_finite(v, f"{path}.{k}" if path else str(k))
        if hit is not None:
            return hit
    return None


def dump_recipe(recipe: Recipe, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(recipe.model_dump(), sort_keys=False))


# ---------------------------------------------------------------- blockwise FP8 at TP > 1 (learner)

# kernels.ROW_PARALLEL_K_SEGMENTS and kernels.fp8.BLOCK (tests/unit/test_kernels_fp8.py checks they agree)
_ROW_PARALLEL_K_SEGMENTS = 8
_FP8_BLOCK = 128


def fp8_tp_problems(m, tp: int) -> list[tuple[str, str]]:
    """(recipe key, what fails) that keep model config ``m`` with model.fp8=blockwise from running
    the learner at parallel.tp=tp (docs/tp.md "FP8"); [] when tp == 1 or it is supported.

    Row-parallel FP8 layers (o_proj, dense-layer down_proj) need K % (8 x 128) == 0 (8 segments of
    whole 128-wide K blocks), column-parallel FP8 shards rows per rank that are multiples of 128 (the
    rank's 128x128 blocks are then the full tensor's): Qwen3-MoE's q / k / v; DeepSeek-V3's MLA q_proj
    (q_b with model.q_lora_rank) and kv_b; a dense layer's gate / up. DeepSeek-V3's replicated kv_a,
    its q_a and its shared experts (q_a and shared experts computed whole on every rank from the
    all-gathered shards, the single chain, as the engine's replicated ones) add no rule. Implemented
    for qwen3_moe and deepseek_v3."""
    if tp == 1:
        return []
    seg = _ROW_PARALLEL_K_SEGMENTS * _FP8_BLOCK
    out: list[tuple[str, str]] = []
    f = family(m.arch)
    if not f.learner_fp8_tp:
        fp8_tp = " and ".join(g.name for g in FAMILIES if g.learner_fp8_tp)
        out.append(("model.arch", f"is {m.arch}: learner FP8 at parallel.tp > 1 is implemented for {fp8_tp} only"))
        return out
    dense = not m.num_experts or m.first_k_dense
    H = m.num_attention_heads
    if f.mla:
        o_key, o_k = "model.num_attention_heads * model.v_head_dim", H * m.v_head_dim
        cols = {"model.num_attention_heads * (model.qk_nope_head_dim + model.qk_rope_head_dim)":
                H * (m.qk_nope_head_dim + m.qk_rope_head_dim),  # q_proj, or q_b with q_lora_rank
                "model.num_attention_heads * (model.qk_nope_head_dim + model.v_head_dim)":
                H * (m.qk_nope_head_dim + m.v_head_dim)}  # kv_b
    else:
        o_key, o_k = "model.num_attention_heads * model.head_dim", H * m.head_dim
        cols = {"model.num_attention_heads * model.head_dim": H * m.head_dim,
                "model.num_kv_heads * model.head_dim": m.num_kv_heads * m.head_dim}
    rows = {o_key: o_k}
    if dense:
        rows["model.dense_ffn_hidden_size"] = m.dense_ffn_hidden_size
        cols["model.dense_ffn_hidden_size"] = m.dense_ffn_hidden_size
    for key, K in rows.items():  # the row-parallel K of o_proj / dense down_proj
        if K % seg:
            out.append((key, f"= {K} (a row-parallel K) must be a multiple of {_ROW_PARALLEL_K_SEGMENTS} x "
                             f"{_FP8_BLOCK} = {seg} ({_ROW_PARALLEL_K_SEGMENTS} segments of whole 128-wide K blocks)"))
    for key, n in cols.items():  # column-parallel rows per rank
        if n % tp or (n // tp) % _FP8_BLOCK:
            out.append((key, f"= {n}: its {n // tp} rows per rank (a column-parallel FP8 shard) must be a "
                             f"multiple of the {_FP8_BLOCK}-row weight block"))
    return out


def fp8_tp_message(m, tp: int, problem: tuple[str, str]) -> str:
    key, why = problem
    return (f"model.fp8={m.fp8} with parallel.tp={tp} needs parallel.tp=1 for this model: {key} {why} "
            "(docs/tp.md \"FP8\"); use parallel.tp=1 with dp/ep, or model.fp8=none")
