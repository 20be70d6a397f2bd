"""RolloutEngine: the rollout side of reinforce-zero, a thin layer over vLLM's offline LLM (V1).

* generate(): G samples per prompt with the sampled tokens' *processed* logprobs
  (logprobs_mode="processed_logprobs": log_softmax(logits / T), after top-p/top-k masking when
  those are active), so the rollout logprob is the probability the token was really drawn with.
  In aligned engines that processing is kernels.sampling's (vllm_bridge/sampler_patch.py), the
  function the learner calls.
* score(): vLLM's own logprob of every token of given sequences (prompt logprobs), for weight-sync
  checks and learner/rollout parity.
* apply_weights(): the one weight-staging protocol (abort -> stage buckets -> commit with one
  in-place reload -> version -> prefix-cache reset) that every weight transport ends in
  (vllm_bridge/weights/: in-process, filesystem, NCCL, resharded); update_weights() pushes HF-named
  tensors through it.

In-place weights on CPU: vLLM 0.32's own RL API (LLM.init_weight_transfer_engine /
start_weight_update / update_weights / finish_weight_update) has GPU-only backends (nccl, ipc,
...), so the CPU transports stage safetensors buckets (bytes, or files the worker reads) through
a worker extension driven by ``collective_rpc`` and apply them with one
``Worker.reload_weights(weights_iterator=...)``; the NCCL transport drives vLLM's API itself and
then calls set_weight_version().

Must not import megatron: the worker extension and plugin run inside vLLM processes.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from kernels.families import FAMILIES, Family
from vllm_bridge.samples import Sample
from vllm_bridge.weights.buckets import (DEFAULT_BUCKET_BYTES, WeightSyncError, iter_buckets, stage_and_commit,
                                        to_safetensors)
from vllm_bridge.weights.verify import check_weights, readable

logger = logging.getLogger("vllm_bridge.engine")

WORKER_EXTENSION = "vllm_bridge.worker_ext.WeightSyncExtension"
__all__ = ["RolloutEngine", "RolloutEngineError", "aligned_model_runner", "cpu_onednn_isa_refusal", "WeightSyncError", "check_weights", "DEFAULT_BUCKET_BYTES",
           "stock_deepseek_v4_cpu_refusal"]

# Environment of a torchrun / SLURM learner process. vLLM's engine core and workers would read
# these (torch.distributed env:// rendezvous, LOCAL_RANK for the device, ...) and try to join
# the learner's process group; they are removed while the engine is constructed (the engine-core
# process inherits the environment at start) and restored afterwards.
DIST_ENV_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS_SET_BY_TORCHRUN", "DISTRIBUTED_BACKEND",
)


class RolloutEngineError(RuntimeError):
    """The rollout engine is unusable (engine-core process died, start-up failed, ...)."""


@contextlib.contextmanager
def clean_dist_env(extra: Iterable[str] = ()) -> Iterator[dict[str, str]]:
    """Hide the learner's torch.distributed environment from vLLM while it starts.

    The engine-core process inherits os.environ when it is spawned (vLLM's CPU platform always
    spawns), so the variables are removed for the duration of the LLM constructor. Afterwards
    these variables (and LD_PRELOAD, which vLLM's CPU platform rewrites in the calling process to
    preload tcmalloc/iomp) are put back exactly as they were, including removing values vLLM
    added (it sets LOCAL_WORLD_SIZE to its own TP size), so the learner's process is unaffected.
    If a torch.distributed group is already initialised here, spawn is also forced explicitly
    (a forked child would inherit the group and vLLM would skip creating its own world).
    """
    keys = [*DIST_ENV_VARS, *extra, "LD_PRELOAD", "VLLM_WORKER_MULTIPROC_METHOD"]
    saved = {k: os.environ.get(k) for k in keys}
    removed = {k: os.environ.pop(k) for k in [*DIST_ENV_VARS, *extra] if k in os.environ}
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    try:
        yield removed
    finally:
        for k, v in saved.items():
            if k == "VLLM_WORKER_MULTIPROC_METHOD" and v is None:
                continue  # vLLM's own choice (spawn on CPU); harmless to keep
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables while the engine spawns its processes, then restore them."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def cpu_threads_bind(workers: int) -> str | None:
    """A VLLM_CPU_OMP_THREADS_BIND value for ``workers`` vLLM-CPU workers on this process's allowed
    CPUs (os.sched_getaffinity), or None when one is set already (non-empty) or workers <= 1.

    vLLM-CPU's default ("auto") binds worker r to the r-th NUMA node and refuses more workers than
    allowed NUMA nodes ("Not enough allowed NUMA nodes to bind threads of 4 local CPUWorkers").
    Here each worker gets a contiguous share of the allowed CPUs ("0-1|2-3" written as id lists),
    cycling over them one CPU per worker when there are fewer CPUs than workers ("0|1|0|1")."""
    if workers <= 1 or os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    n = len(cpus)
    if n >= workers:
        shares = [cpus[i * n // workers:(i + 1) * n // workers] for i in range(workers)]
    else:
        shares = [[cpus[i % n]] for i in range(workers)]
    return "|".join(",".join(map(str, share)) for share in shares)


# a checkpoint's config.json class -> its model family (kernels.families: Kimi-Linear and K3 share
# vLLM's kimi_linear schema)
_FAMILY_OF_HF_CLASS = {f.hf_class: f for f in FAMILIES}
ALIGNED_CLASSES = {name: f.aligned_class for name, f in _FAMILY_OF_HF_CLASS.items()}


def _config(model_dir: str) -> dict:
    """The checkpoint's config.json ({} when unreadable: vLLM then reports the real problem)."""
    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except Exception:
        return {}


def fp8_checkpoint(model_dir: str | os.PathLike, fp8: str, view_dir: str | os.PathLike) -> str:
    """A checkpoint dir whose config.json declares ``fp8`` (key ``rz_fp8``, read by the aligned
    model classes): ``model_dir`` itself when it already does, else ``view_dir`` refreshed as a view
    of ``model_dir`` (a symlink per file, config.json rewritten). The weights stay the high-precision
    ones; the engine quantises them at load, as it re-quantises every in-place weight update."""
    model_dir = Path(model_dir)
    cfg = _config(str(model_dir))
    if cfg.get("rz_fp8", "none") == fp8:
        return str(model_dir)
    view = Path(view_dir)
    view.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.name == "config.json" or not f.is_file():
            continue
        link = view / f.name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(f.resolve())
    cfg["rz_fp8"] = fp8
    tmp = view / "config.json.tmp"
    tmp.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tmp.replace(view / "config.json")
    return str(view)


def _family(model_dir: str) -> Family | None:
    """The model family of the checkpoint's first ``architectures`` entry that names one."""
    for a in _config(model_dir).get("architectures") or []:
        if a in _FAMILY_OF_HF_CLASS:
            return _FAMILY_OF_HF_CLASS[a]
    return None


def _aligned_architecture(model_dir: str) -> str:
    f = _family(model_dir)
    if f is None:
        raise RolloutEngineError(
            f"no aligned model class for architectures {_config(model_dir).get('architectures') or []} in "
            f"{model_dir}; aligned mode supports {sorted(ALIGNED_CLASSES)} (use mode=fast for others)")
    return f.aligned_class


def aligned_model_runner(model_dir: str, cuda: bool) -> str:
    """vLLM's model runner for an aligned engine when the caller does not set
    VLLM_USE_V2_MODEL_RUNNER: "v2" where stock vLLM 0.26 picks its V2 GPU runner for the
    checkpoint's own class (dense attention models; not MoE, not hybrid), "v1" otherwise and on
    CPU (vLLM-CPU 0.32 runs V1).

    Why follow stock: the V2 runner's host cost per step is what kept the aligned dense engine
    behind stock at small batches (H100, Qwen2 at R1-Distill-1.5B shapes, aligned / stock seeded:
    V1 runner 0.96-1.25, V2 runner 0.85-1.10, same machine); on MoE checkpoints stock itself runs
    V1. The aligned sampler and prompt logprobs have a V2 half (sampler_patch.apply_v2,
    vllm_patches), GPU-tested bitwise (batch invariance, decode == prefill, == the learner, after
    an in-place update: tests/gpu/test_aligned_cuda_engine.py). DeepSeek-V3 (MLA) and V4 keep V1:
    their aligned caches are written for it."""
    f = _family(model_dir)
    if not cuda or f is None or f.moe or f.attention != "gqa":
        return "v1"
    return "v2"


def cpu_onednn_isa_refusal(dtype: str, aligned: bool) -> str | None:
    """Why a stock (fast-mode) vLLM-CPU engine in bf16 / fp16 cannot run under this process's
    ONEDNN_MAX_CPU_ISA, or None. vLLM-CPU 0.32 packs its bf16 linears for torch's brgemm, which on
    an AMX CPU needs oneDNN's AMX code paths; a cap below them (ONEDNN_MAX_CPU_ISA=AVX2, what
    reproducible CPU runs pin) makes the worker abort on its first forward (measured on this
    project's CPU box). The aligned classes never reach those GEMMs."""
    if aligned or dtype not in ("bfloat16", "bf16", "float16", "fp16", "half"):
        return None
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if not isa or isa in ("ALL", "DEFAULT") or "AMX" in isa:
        return None
    import torch

    if not torch.cpu._is_amx_tile_supported():
        return None
    return (f"ONEDNN_MAX_CPU_ISA={os.environ['ONEDNN_MAX_CPU_ISA']}: stock vLLM-CPU's {dtype} GEMMs need oneDNN's AMX "
            "code paths on this CPU and abort without them; unset ONEDNN_MAX_CPU_ISA for this run, or roll out in "
            "float32 (rollout.dtype=float32)")


def _colocated_memory_cap() -> dict[str, Any]:
    """On a CUDA machine whose GPU already holds another process's memory (the colocated learner),
    cap vLLM's `gpu_memory_utilization` at what is free. The KV cache is sized by
    `kv_cache_memory_bytes`; vLLM 0.26 still refuses to start when utilization x total exceeds the
    free memory (default 0.92: an H100 with a 6.6 GiB learner beside it has 0.917 free). The query
    opens a CUDA context in this process (vLLM then starts its engine core by spawn, as it does
    whenever CUDA is initialised); an empty GPU keeps vLLM's default."""
    try:
        import torch

        if not torch.cuda.is_available():
            return {}
        free, total = torch.cuda.mem_get_info()
    except Exception:  # no usable CUDA runtime: vLLM's own default
        return {}
    frac = free / total - 0.02
    return {"gpu_memory_utilization": round(frac, 3)} if frac < 0.92 else {}


def _is_mla_config(model_dir: str) -> bool:
    cfg = _config(model_dir)
    return bool(cfg.get("kv_lora_rank")) or cfg.get("model_type") in ("deepseek_v2", "deepseek_v3")


def _is_deepseek_v4(model_dir: str) -> bool:
    """The checkpoint's architecture is DeepSeek-V4 or V4.1 (vLLM's own class, or ours aligned)."""
    f = _family(model_dir)
    return f is not None and f.dsv4


def stock_deepseek_v4_cpu_refusal() -> str | None:
    """Why vLLM's own DeepSeek-V4 class cannot run on this CPU, or None.

    vLLM-CPU 0.32 ships three builds of its C++ ops and loads one by the CPU's ISA
    (``CpuPlatform.import_kernels``): ``_C`` with AVX-512 BF16, else ``_C_AVX512`` / ``_C_AVX2``. The
    DeepSeek-V4 CPU path's ops (``convert_weight_packed``, ``flash_mla_with_kvcache_cpu``,
    ``save_partial_states_cpu``) are only in ``_C``: on an AVX2-only host (measured: AMD EPYC
    without AVX-512) the engine's workers die at load with ``'_C' object has no attribute
    'convert_weight_packed'``. The aligned DeepSeek-V4 class (kernels/) needs none of them."""
    import platform

    import torch

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    # the test vLLM's import_kernels makes (torch's ISA probes) to pick the build it loads
    if torch.cpu._is_avx512_supported() and torch.cpu._is_avx512_bf16_supported():
        return None
    return ("mode=fast on DeepSeek-V4: vLLM 0.32's own DeepSeek-V4 CPU kernels are only in its AVX-512 BF16 "
            "build and this CPU has no AVX-512 BF16: use mode=aligned (the project's DeepSeek-V4 class runs on "
            "any CPU), or a CPU with AVX-512 BF16, or a CUDA GPU")


def _stock_deepseek_v4_cpu_settings(dtype: str) -> tuple[dict[str, str], dict[str, Any]]:
    """Environment and engine arguments vLLM 0.32's DeepseekV4ForCausalLM needs on CPU.

    - TRITON_INTERPRET=1: the CPU path's attention-metadata builders launch Triton kernels and
      vllm-cpu has no Triton compiler. In the engine's processes it also switches on
      vllm_patches' dsv4_triton_interpreter (those kernels, and only those, run in Triton's
      interpreter) and dsv4_cpu_swa_tile_scheduler (a KeyError in the decode path).
    - VLLM_USE_V2_MODEL_RUNNER=0, enforce_eager: the CPU DeepSeek-V4 path is written for the V1
      CPU model runner, uncompiled (vLLM also picks V1 itself while Triton is off; explicit here).
    - custom_ops "-rotary_embedding": the native torch rotary instead of vLLM-CPU's rotary op,
      which is wrong for 3-D query tensors (DeepSeek-V3 MLA, RolloutEngine.__init__). No effect on the
      tiny DeepSeek-V4 (identical logprobs); kept so its rotary cannot reach that op.
    Its CPU path runs bf16 only (and keeps the KV cache in fp8 "fp8_ds_mla" whatever is asked).
    Measured (tests/integration/test_dsv4_fast.py): without TRITON_INTERPRET the first step fails;
    TORCHDYNAMO_DISABLE is not needed because Triton stays off outside those modules.
    """
    why = stock_deepseek_v4_cpu_refusal()
    if why:
        raise RolloutEngineError(why)
    if dtype not in ("bfloat16", "bf16"):
        raise RolloutEngineError(
            f"vLLM 0.32's DeepSeek-V4 CPU path runs in bfloat16 only (asked for {dtype}); "
            "set rollout.dtype=bfloat16 (mode=fast)"
        )
    env = {"TRITON_INTERPRET": "1", "VLLM_USE_V2_MODEL_RUNNER": "0"}
    kwargs = {"enforce_eager": True, "compilation_config": {"custom_ops": ["all", "-rotary_embedding"]}}
    return env, kwargs


def _proc_start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except Exception:
        return None


def reap_process(pid: int, start: str | None, wait_s: float = 5.0) -> None:
    """Kill worker process ``pid`` (one this engine started) if it outlived its engine core.

    The start time guards against a recycled pid. Zombies (already exited) are left alone.
    """
    import signal

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if start is None or _proc_start_time(pid) != start:
            return
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except Exception:
            return
        if state == "Z":
            return
        time.sleep(0.1)
    if _proc_start_time(pid) == start:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


# Aligned classes that support vLLM pipeline parallelism (vllm_bridge.aligned._model's layer loop)
PP_ALIGNED_ARCHITECTURES = tuple(f.aligned_class for f in FAMILIES if f.aligned_pp)


class RolloutEngine:
    """vLLM V1 offline engine for RL rollouts. Use as a context manager or call close()."""

    def __init__(
        self,
        model_dir: str | os.PathLike,
        *,
        dtype: str = "float32",
        seed: int = 0,
        max_num_seqs: int = 256,
        kv_cache_gb: float = 1.0,
        max_model_len: int = 256,
        enforce_eager: bool | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        rpc_timeout_s: float | None = 600.0,
        stall_timeout_s: float | None = None,
        aligned: bool = False,
        fp8: str | None = None,
        before_start: Callable[[dict, dict], None] | None = None,
        **engine_kwargs: Any,
    ) -> None:
        self.model_dir = str(model_dir)
        self.bucket_bytes = int(bucket_bytes)
        self.rpc_timeout_s = rpc_timeout_s
        # A live engine core that makes no engine step (so no token) for this long during generate,
        # score or a streaming step is named stuck (RolloutEngineError, as a dead one); None: no bound.
        self.stall_timeout_s = stall_timeout_s
        self._stuck: str | None = None
        self._beat = time.monotonic()  # when the engine last returned an engine step's outputs
        self._version = 0
        self._closed = False
        self.last_sync: dict = {}
        self.is_mla = _is_mla_config(self.model_dir)
        kwargs: dict[str, Any] = dict(
            model=self.model_dir,
            dtype=dtype,
            seed=seed,
            max_num_seqs=max_num_seqs,
            kv_cache_memory_bytes=int(kv_cache_gb * (1 << 30)),
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION,
            # vLLM 0.32 CPU: a per-request seed with chunked prefill fails ("CPU Generator does
            # not use offset"); rollouts use per-request seeds, so prefill whole prompts.
            enable_chunked_prefill=False,
            max_num_batched_tokens=max(max_model_len, 2048),
            tensor_parallel_size=1,
        )
        kwargs.update(_colocated_memory_cap())
        env: dict[str, str] = {}
        self.aligned = aligned
        # Blockwise FP8 inside the model (recipe model.fp8): this argument, else the checkpoint's
        # config.json key "rz_fp8" (kernels.models.qwen3_dsv3.FP8_CONFIG_KEY), else none.
        self.fp8 = str(fp8 if fp8 is not None else _config(self.model_dir).get("rz_fp8", "none"))
        if self.fp8 not in ("none", "blockwise"):
            raise RolloutEngineError(f"fp8={self.fp8!r}: expected 'none' or 'blockwise'")
        if self.fp8 != "none" and not aligned:
            raise RolloutEngineError(
                "fp8=blockwise runs in the aligned Qwen3-MoE / DeepSeek-V3 / DeepSeek-V4 model classes only (the "
                "stock vLLM classes have no matching FP8 linears): use mode=aligned, or model.fp8=none"
            )
        from vllm_bridge import vllm_compat

        if vllm_compat.is_cuda():
            # CUDA vLLM 0.26: CUDA graphs unless asked to run eagerly; the aligned classes decode in
            # FULL graphs with torch.compile off (vllm_compat, item 2); chunked prefill on.
            if aligned:
                # DeepSeek-V4's compact cache (dsv4_cache) and V4.1's payload cache are read one
                # sequence at a time with host sizes: eager, no graphs
                graphs = not enforce_eager and not _is_deepseek_v4(str(self.model_dir))
                kwargs.update(vllm_compat.aligned_engine_kwargs(cuda_graphs=graphs))
            else:
                kwargs.update(enforce_eager=bool(enforce_eager), enable_chunked_prefill=True)
        else:
            why = cpu_onednn_isa_refusal(str(dtype), aligned)
            if why is not None:
                raise RolloutEngineError(why)
            if enforce_eager is None:
                kwargs["enforce_eager"] = True  # vLLM-CPU
        if aligned:
            # Our kernels-backed model class for the checkpoint's architecture (vllm_bridge.aligned).
            kwargs["hf_overrides"] = {"architectures": [_aligned_architecture(self.model_dir)]}
            if _is_deepseek_v4(self.model_dir) and _config(self.model_dir).get("quantization_config"):
                # DeepSeek's FP8 form (e4m3 weights + ".scale", stock's V4 layout): the aligned class
                # dequantises it while loading (kernels.models.dsv4.dequantized_weights); vLLM's own
                # FP8 method must not claim its layers
                kwargs["hf_overrides"]["quantization_config"] = None
            if fp8 is not None:
                kwargs["hf_overrides"]["rz_fp8"] = self.fp8
            # The sampler computes the processed logprob with kernels.sampling, the learner's
            # function (vllm_bridge/sampler_patch.py). It patches the V1 model runner's sampler and,
            # on CUDA vLLM 0.26, the V2 runner's. Which runner: the caller's VLLM_USE_V2_MODEL_RUNNER,
            # else the one stock vLLM picks for the checkpoint (aligned_model_runner).
            env["RZ_ALIGNED_SAMPLER"] = "1"
            env.setdefault("VLLM_USE_V2_MODEL_RUNNER", os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
                           or ("1" if aligned_model_runner(self.model_dir, vllm_compat.is_cuda()) == "v2" else "0"))
            if self.is_mla or _is_deepseek_v4(self.model_dir):
                # The aligned DeepSeek-V3/V4 caches expanded per-head K/V in a standard paged cache;
                # vLLM's MLA bookkeeping (latent head size) must be off to size that cache.
                env["VLLM_MLA_DISABLE"] = "1"
            if _family(self.model_dir).attention == "kda":
                # hybrid (KDA state cache): vLLM's prefix caching for it is mamba_cache_mode "align",
                # which needs chunked prefill (off here, see above); the class is tested without it
                kwargs["enable_prefix_caching"] = False
        elif self.is_mla:
            # vLLM 0.32 CPU bug: the CPU rotary custom op is wrong for 3-D query tensors (MLA):
            # logprob errors ~0.5. Use the native torch rotary implementation instead.
            kwargs["compilation_config"] = {"custom_ops": ["all", "-rotary_embedding"]}
            if dtype not in ("bfloat16", "float16", "bf16", "fp16"):
                # vLLM 0.32 CPU: on hosts with AMX tiles the AMX_MLA backend is preferred, but its
                # weight prepack only accepts bf16/fp16 ("expect weight to be bfloat16, ...") and
                # start-up fails for fp32 models: ask for the reference CPU_MLA backend.
                kwargs["attention_backend"] = "CPU_MLA"
        self.is_stock_deepseek_v4 = not aligned and _is_deepseek_v4(self.model_dir)
        if self.is_stock_deepseek_v4:
            from vllm.platforms import current_platform

            if current_platform.is_cpu():
                dsv4_env, dsv4_kwargs = _stock_deepseek_v4_cpu_settings(dtype)
                env.update(dsv4_env)
                kwargs.update(dsv4_kwargs)
            else:
                # CUDA vLLM 0.26: its FlashMLA V4 attention stores the fp8_ds_mla format only and
                # asserts an fp8 KV-cache dtype ("auto" stays "auto" for a block-FP8 checkpoint:
                # models/deepseek_v4/attention.py, _resolve_dsv4_kv_cache_dtype); "fp8" is rewritten
                # to fp8_ds_mla there
                kwargs["kv_cache_dtype"] = "fp8"
        kwargs.update(engine_kwargs)
        pp = int(kwargs.get("pipeline_parallel_size") or 1)
        if pp > 1 and aligned and kwargs["hf_overrides"]["architectures"][0] not in PP_ALIGNED_ARCHITECTURES:
            raise RolloutEngineError(
                f"pipeline_parallel_size={pp}: the aligned {kwargs['hf_overrides']['architectures'][0]} class has its "
                f"own layer loop without pipeline stages; pipeline-parallel aligned engines: "
                f"{', '.join(PP_ALIGNED_ARCHITECTURES)} (use rollout.pipeline_parallel_size: 1)")
        self.engine_kwargs = kwargs
        if before_start is not None:  # a multi-node engine publishes these to its other nodes
            before_start(dict(kwargs), dict(env))
        # vLLM-CPU, several workers in this (single-node, offline) engine and no thread binding set:
        # vLLM's "auto" wants one NUMA node per worker; bind each worker to a share of this process's
        # CPUs instead. Not published through before_start: a `vllm serve` spanning nodes has fewer
        # local workers per node than tensor_parallel_size (each node sets its own binding).
        workers = int(kwargs.get("tensor_parallel_size") or 1) * int(kwargs.get("pipeline_parallel_size") or 1)
        if workers > 1:
            from vllm.platforms import current_platform

            bind = cpu_threads_bind(workers) if current_platform.is_cpu() else None
            if bind is not None:  # set while the engine spawns its workers, then restored (_env)
                env["VLLM_CPU_OMP_THREADS_BIND"] = bind
                logger.warning("vLLM-CPU with %d workers and no VLLM_CPU_OMP_THREADS_BIND: binding them to this "
                               "process's allowed CPUs, VLLM_CPU_OMP_THREADS_BIND=%s", workers, bind)

        from vllm import LLM

        t0 = time.perf_counter()
        with clean_dist_env(), _env(env):
            try:
                self.llm = LLM(**kwargs)
            except Exception as e:  # start-up failure: say so clearly
                raise RolloutEngineError(
                    f"vLLM engine failed to start for {self.model_dir!r}: {type(e).__name__}: {e}. "
                    "Check the checkpoint (config.json/safetensors), the CPU constraints in "
                    "docs (head_dim in {32,64,80,...}, MLA kv_lora_rank=512/qk_rope_head_dim=64) "
                    "and the engine kwargs."
                ) from e
        self.startup_s = time.perf_counter() - t0
        self._beat_engine_steps()
        # An interrupted caller (exception, SystemExit from SIGTERM) must not leave vLLM's engine-core
        # and worker processes behind: close() is idempotent, so also run it at interpreter exit.
        atexit.register(self.close)
        # (pid, start time) of the worker processes, to reap them in close() if the engine core
        # died without taking them down.
        # (an in-process engine, VLLM_ENABLE_V1_MULTIPROCESSING=0, runs its worker in this process:
        # never reap ourselves)
        self._worker_procs = [(pid, _proc_start_time(pid)) for pid in self._rpc("rz_pid") if pid != os.getpid()]
        if aligned and not all(self._rpc("rz_aligned_sampler")):
            self.close()
            raise RolloutEngineError(
                "aligned engine without the aligned sampler (vllm_bridge.sampler_patch): this vLLM's "
                "Sampler was not patched (V1 runner: vLLM 0.32 CPU / 0.26 CUDA; V2 runner, "
                "VLLM_USE_V2_MODEL_RUNNER=1: CUDA 0.26 only); the processed logprobs would not be the learner's.")
        if kwargs.get("skip_tokenizer_init"):  # token ids in and out (benchmarks): EOS from config.json
            self.eos_token_id = _config(self.model_dir).get("eos_token_id")
        else:
            self.eos_token_id = getattr(self.llm.get_tokenizer(), "eos_token_id", None)
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()

    # ---- lifecycle -----------------------------------------------------------------------------
    def __enter__(self) -> "RolloutEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # best effort; close() is the supported way
        with contextlib.suppress(Exception):
            self.close()

    def close(self) -> None:
        """Shut the engine down: engine-core process and its workers exit, sockets close."""
        if self._closed:
            return
        self._closed = True
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        # Reap anything still alive (a hung engine core): terminate, then kill.
        for p in self._engine_processes():
            with contextlib.suppress(Exception):
                if p.is_alive():
                    p.terminate()
                    p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join(5)
        for pid, start in self._worker_procs:
            reap_process(pid, start)
        self.llm = None

    def worker_pids(self) -> list[int]:
        return [pid for pid, _ in self._worker_procs]

    @property
    def weight_version(self) -> int:
        return self._version

    def _engine_processes(self) -> list:
        llm = getattr(self, "llm", None)
        if llm is None:
            return []
        core = getattr(llm.llm_engine, "engine_core", None)
        resources = getattr(core, "resources", None)
        manager = getattr(resources, "engine_manager", None)
        return list(getattr(manager, "processes", []) or [])

    def engine_pids(self) -> list[int]:
        """PIDs of the engine-core processes (empty for an in-process engine core)."""
        return [p.pid for p in self._engine_processes() if p.pid is not None]

    def process_ids(self) -> list[tuple[int, str | None]]:
        """(pid, start time) of every process this engine started (engine cores, then workers): what a
        parent reaps if the process owning this engine dies without closing it (reap_process)."""
        cores = [(pid, _proc_start_time(pid)) for pid in self.engine_pids()]
        return cores + list(self._worker_procs)

    @property
    def llm_engine(self):
        """vLLM's LLMEngine under the offline LLM (add_request / step / abort: streaming.py)."""
        if self.llm is None:
            raise RolloutEngineError(f"RolloutEngine for {self.model_dir!r}: the engine was closed")
        return self.llm.llm_engine

    @contextlib.contextmanager
    def paused(self):
        """vLLM's scheduler paused at the next engine-step boundary with in-flight requests kept
        resident (their KV cache too), resumed on exit: weights change between two engine steps."""
        core = self.llm_engine.engine_core
        self._utility("pause_scheduler", lambda: core.call_utility("pause_scheduler", "keep", False))
        try:
            yield
        finally:
            if self.dead_reason() is None:
                self._utility("resume_scheduler", lambda: core.call_utility("resume_scheduler"))

    def _utility(self, what: str, fn: Callable[[], Any]) -> Any:
        """One blocking call into the engine core (vLLM's call_utility: pause / resume the
        scheduler, the weight-version label, the prefix-cache reset) under guard and the death
        watch: vLLM's SyncMPClient.call_utility waits on its future forever when the engine core
        dies meanwhile (its monitor marks the engine dead but fails no pending future)."""
        with self.guard(what):
            return self._watched(fn, what)

    def _beat_engine_steps(self) -> None:
        """Note the time of every engine step that returns (LLM.generate and StreamingGenerator both
        drive llm_engine.step(); each return is the engine core's output of one engine step)."""
        engine = self.llm.llm_engine
        inner = engine.step

        def step(*args, **kwargs):
            out = inner(*args, **kwargs)
            self._beat = time.monotonic()
            return out

        engine.step = step

    def dead_reason(self) -> str | None:
        if self._closed or getattr(self, "llm", None) is None:
            return "the engine was closed"
        if self._stuck is not None:
            return self._stuck
        for p in self._engine_processes():
            if not p.is_alive():
                return f"the vLLM engine-core process (pid {p.pid}) exited with code {p.exitcode}"
        core = getattr(self.llm.llm_engine, "engine_core", None)
        if getattr(getattr(core, "resources", None), "engine_dead", False):
            return "vLLM reports the engine core dead (EngineDeadError)"
        return None

    def _dead_error(self, reason: str) -> RolloutEngineError:
        return RolloutEngineError(
            f"RolloutEngine for {self.model_dir!r} is dead: {reason}. It cannot recover: call "
            "close() and build a new RolloutEngine (then push the current weights with "
            "update_weights). Look above in the log for the engine core's own error (e.g. out "
            "of memory / killed by the OOM killer: lower kv_cache_gb or max_num_seqs)."
        )

    @contextlib.contextmanager
    def guard(self, what: str):
        """Context for one engine call: refuses when the engine is dead already; an error raised
        inside it because the engine core died becomes RolloutEngineError naming the death."""
        reason = self.dead_reason()
        if reason is not None:
            raise self._dead_error(reason)
        try:
            yield
        except RolloutEngineError:
            raise
        except Exception as e:
            from vllm.v1.engine.exceptions import EngineDeadError

            reason = self.dead_reason()
            if reason is None and isinstance(e, EngineDeadError):
                reason = "vLLM raised EngineDeadError"
            if reason is not None:
                raise self._dead_error(f"{reason} (during {what})") from e
            raise

    def _watched(self, fn: Callable[[], Any], what: str, poll_s: float = 0.5, stall_s: float | None = None) -> Any:
        """Run a blocking engine call (``LLM.generate``) in a helper thread while this thread checks
        every ``poll_s`` that the engine core is alive. vLLM-CPU 0.32's ``LLM.generate`` never returns
        when its engine core is killed mid-call (it logs "engine core exited unexpectedly" and waits
        on its output queue forever), so a dead core must be noticed from outside the call: then
        the call is abandoned (its daemon thread stays blocked, harmless) and RolloutEngineError
        names the death, within ``poll_s``. Exceptions of the call itself are re-raised here.
        ``stall_s``: a call during which the engine returns no engine step for that long (a live
        but stuck engine core: no new token) is abandoned the same way, and the engine is then
        dead for every later call (restart it)."""
        import threading

        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["out"] = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                box["err"] = e

        t = threading.Thread(target=run, name=f"rz-{what}", daemon=True)
        start = time.monotonic()
        t.start()
        while True:
            t.join(poll_s if stall_s is None else min(poll_s, stall_s))
            if not t.is_alive():
                break
            reason = self.dead_reason()
            if reason is not None:
                raise self._dead_error(f"{reason} (during {what})")
            quiet = 0.0 if stall_s is None else time.monotonic() - max(start, self._beat)
            if stall_s is not None and quiet > stall_s:
                self._stuck = (f"the engine core is alive but stuck: no engine step (no new token) for {quiet:.1f} s "
                               f"> rollout.stall_timeout_s={stall_s:g}")
                raise self._dead_error(f"{self._stuck} (during {what})")
        if "err" in box:
            raise box["err"]
        return box["out"]

    def watched(self, fn: Callable[[], Any], what: str, *, stall_s: float | None = None) -> Any:
        """``fn()`` (a blocking call into this engine) under the death and stall watch of _watched."""
        return self._watched(fn, what, stall_s=stall_s)

    def collective_rpc(self, method: str, *args: Any) -> list:
        """Call a worker-extension method (vllm_bridge.worker_ext) on every worker: the per-worker
        results in rank order. A dead engine raises RolloutEngineError."""
        return self._rpc(method, *args)

    def _rpc(self, method: str, *args: Any) -> list:
        # watched as generate is: an engine core killed during an RPC (a weight push into a dying
        # engine) is named within the watch's poll, not after rpc_timeout_s
        with self.guard(f"collective_rpc {method}"):
            return self._watched(lambda: self.llm.collective_rpc(method, timeout=self.rpc_timeout_s, args=args),
                                 f"collective_rpc {method}")

    # ---- localisation (rz check) ----------------------------------------------------------------
    def traced_generate(self, prompt_ids: list[int], **kw) -> tuple[Sample, list[tuple[str, torch.Tensor]]]:
        """Generate ONE sequence alone while the aligned model records its activation taps.
        Alone, every forward holds only this sequence's rows: the prefill's prompt rows, then one
        row per decode step, so concatenating a tap's records in call order gives its rows for
        positions 0 .. len(prompt) + len(response) - 2 (the last sampled token is never fed back).
        Aligned engines only (the stock model classes have no taps)."""
        if not self.aligned:
            raise ValueError("traced_generate needs an aligned engine (aligned=True)")
        self._rpc("rz_trace", True)
        try:
            sample = self.generate([prompt_ids], n=1, **kw)[0]
        finally:
            import io

            trace = torch.load(io.BytesIO(self._rpc("rz_trace", False)[0]), weights_only=True)
        return sample, trace

    def perturb_parameter(self, name: str, factor: float) -> None:
        """Scale one vLLM parameter in place (fault injection for the localiser's self-test)."""
        self._rpc("rz_perturb", name, float(factor))

    # ---- generation ----------------------------------------------------------------------------
    def generate(
        self,
        prompt_ids: list[list[int]],
        n: int,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 64,
        seed: int | None = None,
        top_k: int = -1,
        **sampling_kwargs: Any,
    ) -> list[Sample]:
        """n samples per prompt, grouped by prompt: result[i*n + j] is sample j of prompt i.

        Stops at the model's EOS (included as the last response token, finish_reason "stop") or
        after max_new_tokens (finish_reason "length"). With ``seed`` the result is reproducible
        (prompt i uses seeds seed + i*n .. seed + i*n + n-1). ``sampling_kwargs``: other vLLM
        SamplingParams fields (penalties, min_p, ...; fast mode only: an aligned engine's sampler
        refuses what the learner does not compute, vllm_bridge/sampler_patch.py).
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompt_ids]
        params = []
        for i in range(len(prompts)):
            params.append(
                SamplingParams(
                    n=n,
                    temperature=temperature,
                    top_p=top_p,
                    top_k=top_k,
                    max_tokens=max_new_tokens,
                    logprobs=0,  # the sampled token's logprob only
                    seed=None if seed is None else int(seed) + i * n,
                    skip_special_tokens=False,
                    detokenize=False,
                    **sampling_kwargs,
                )
            )
        version = self._version
        with self.guard("generate"):
            outs = self._watched(lambda: self.llm.generate(prompts, params, use_tqdm=False), "generate",
                                 stall_s=self.stall_timeout_s)
        samples: list[Sample] = []
        for i, out in enumerate(outs):
            comps = sorted(out.outputs, key=lambda c: c.index)
            if len(comps) != n:
                raise RolloutEngineError(f"prompt {i}: vLLM returned {len(comps)} samples, wanted {n}")
            for c in comps:
                ids = list(c.token_ids)
                lps = []
                for tid, d in zip(ids, c.logprobs or []):
                    lps.append(float(d[tid].logprob))
                if len(lps) != len(ids):
                    raise RolloutEngineError(f"prompt {i}: {len(ids)} tokens but {len(lps)} logprobs")
                samples.append(
                    Sample(
                        prompt_ids=list(prompt_ids[i]),
                        response_ids=ids,
                        logprobs=lps,
                        versions=[version] * len(ids),
                        finish_reason=str(c.finish_reason),
                        group=i,
                        index_in_group=c.index,
                        temperature=temperature,
                        top_p=top_p,
                        top_k=top_k,
                    )
                )
        return samples

    # ---- scoring -------------------------------------------------------------------------------
    def score(self, sequences: list[list[int]], temperature: float = 1.0) -> list[list[float | None]]:
        """vLLM's own logprob of every token given its prefix: log_softmax(logits / T)[token].

        result[k][0] is None (the first token has no prefix), result[k][t] for t >= 1 is the
        logprob of sequences[k][t]. Computed with prompt logprobs, which in vLLM 0.32 ignore the
        request temperature (and logprobs_mode), so temperature is applied by temporarily scaling
        the model's LogitsProcessor by 1/T in the worker (logits * (1/T), equal to logits / T up
        to one rounding). Not safe to call concurrently with generate() (it is synchronous here).
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if temperature <= 0:
            raise ValueError("score: temperature must be > 0")
        prompts = [TokensPrompt(prompt_token_ids=list(map(int, s))) for s in sequences]
        sp = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        scaled = temperature != 1.0
        if scaled:
            self._rpc("rz_set_logit_scale", 1.0 / float(temperature))
        try:
            with self.guard("score"):
                outs = self._watched(lambda: self.llm.generate(prompts, sp, use_tqdm=False), "score",
                                     stall_s=self.stall_timeout_s)
        finally:
            if scaled and self.dead_reason() is None:
                self._rpc("rz_reset_logit_scale")
        result: list[list[float | None]] = []
        for seq, out in zip(sequences, outs):
            pl = out.prompt_logprobs or []
            row: list[float | None] = [None]
            for t in range(1, len(seq)):
                d = pl[t] if t < len(pl) else None
                if d is None or int(seq[t]) not in d:
                    raise RolloutEngineError(f"score: no prompt logprob for position {t}")
                row.append(float(d[int(seq[t])].logprob))
            result.append(row)
        return result

    # ---- weight sync ---------------------------------------------------------------------------
    def apply_weights(self, payloads: Iterable[bytes | str], version: int, *, reload: bool = True,
                      stage: str = "rz_stage_weights") -> dict:
        """The staging protocol, the only one: abort anything half-staged, stage every bucket
        (safetensors bytes, or the path of a safetensors file the worker reads itself), commit them
        with one in-place reload (a layer split over two reloads would be half empty: worker_ext),
        then set the version (set_weight_version: label and prefix-cache reset). A failure aborts
        the staged buckets (when the engine is still alive) and re-raises: the old weights and
        version stay. ``reload=False`` is a test hook that transfers but never loads (a broken sync
        verify_sync must catch). ``stage="rz_stage_shards"``: each payload is a resharded version
        directory (vllm_bridge.weights.reshard). Returns sizes and timings (also kept in ``last_sync``), and
        "workers", each worker's report of its last staged payload."""
        t0 = time.perf_counter()
        info = stage_and_commit(self._rpc, payloads, version, reload=reload, alive=lambda: self.dead_reason() is None,
                                stage=stage)
        self.set_weight_version(version)
        self.last_sync = {
            "version": int(version),
            "num_tensors": info["num_tensors"],
            "bytes": info["bytes"],
            "rpcs": info["staged"] + 2,
            "reload_s": info["reload_s"],
            "total_s": time.perf_counter() - t0,
            "workers": info["workers"],
        }
        return dict(self.last_sync)

    def set_weight_version(self, version: int) -> None:
        """The end of every weight update: vLLM labels every later engine step's tokens with
        ``version`` (Sample.versions, streaming.py), and the prefix cache is reset (its blocks were
        computed with the old weights; with requests in flight it is best effort: vLLM keeps
        blocks that are in use)."""
        from vllm_bridge import vllm_compat

        llm_engine = self.llm_engine
        # 0.26 cannot label (vllm_compat item 4)
        self._utility("set_weight_version", lambda: vllm_compat.set_weight_version(llm_engine, version))
        self._version = int(version)

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        verify: bool = False,
        _reload: bool = True,
    ) -> dict:
        """Push HF-named tensors into the running engine in place (buckets of ~bucket_bytes as
        safetensors bytes, apply_weights) and set the version. With verify=True the readable
        parameters are checked afterwards (verify_sync). Returns timing info."""
        check: dict[str, torch.Tensor] = {}

        def payloads():
            for bucket in iter_buckets(named_tensors, self.bucket_bytes):
                if verify:
                    check.update(readable(bucket.items()))
                yield to_safetensors(bucket)

        t0 = time.perf_counter()
        self.apply_weights(payloads(), version, reload=_reload)
        if verify:
            self.verify_sync(check.items())
            self.last_sync["total_s"] = time.perf_counter() - t0
        return dict(self.last_sync)

    def engine_checksums(self, names: list[str] | None = None) -> dict[str, dict]:
        """Every worker's read-back, merged: a pipeline stage reports only the layers it holds.
        A name two workers report (a tensor-parallel replica) with different bits is reported with
        ``bits = -1``, so check_weights flags it."""
        merged: dict[str, dict] = {}
        for part in self._rpc("rz_checksums", names):
            for n, e in part.items():
                if n not in merged:
                    merged[n] = e
                elif merged[n].get("bits") != e.get("bits") or merged[n]["shape"] != e["shape"]:
                    merged[n] = dict(merged[n], bits=-1)
        return merged

    def verify_sync(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, rtol: float = 1e-6, min_checked: int = 1
    ) -> dict:
        """Check that the engine's readable parameters equal the learner's tensors
        (transport.check_weights, the one verification of every transport). Raises WeightSyncError
        on any mismatch or when fewer than ``min_checked`` tensors could be compared.
        Returns {"checked": [...], "max_rel_err": float}."""
        return check_weights(named_tensors, self.engine_checksums, self._version, rtol=rtol,
                             min_checked=min_checked)
