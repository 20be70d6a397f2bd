"""The CUDA IPC weight transport (vllm_bridge.weights.ipc) against a real CUDA vLLM engine on the same
GPU as this process (the colocated layout): buckets packed into one device buffer per bucket, the
engine's worker (its own process) opens the handle and copies the bytes out.

Checked: after an IPC push every parameter of the worker is verified bit for bit (verify.SyncCheck,
the every-sync check), the engine's scores are torch.equal to those after the same weights arrive
through the in-process transport, and a byte flipped on the way (in a tensor drawn from all of them,
weighted by size, after the learner-side checksum was taken) is caught every time. Needs CUDA vLLM
(docs/gpu.md); skipped otherwise."""

import os

import pytest
import torch

from gpu_util import have_cuda_vllm, need_cuda

# the engine's processes must not fork this one once it has touched CUDA (measured 2026-12-06 on an
# H100: the engine core died with "Cannot re-initialize CUDA in forked subprocess")
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    need_cuda()
    if not have_cuda_vllm():
        pytest.skip("needs CUDA vLLM (docs/gpu.md)")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from learner_gpu import bench_recipe, random_hf_weights
    from sync_gpu import write_ckpt
    from vllm_bridge.engine import RolloutEngine

    # gpu_moe's shapes (the aligned CUDA kernels need K segments of >= 16: the tiny CPU model is too small)
    ckpt = tmp_path_factory.mktemp("ipc") / "ckpt"
    r = bench_recipe("gpu_moe", "aligned")
    write_ckpt(r.model, random_hf_weights(r.model, device="cpu"), ckpt)
    eng = RolloutEngine(ckpt, aligned=True, dtype="bfloat16", max_model_len=256, kv_cache_gb=2.0,
                        skip_tokenizer_init=True, gpu_memory_utilization=0.3)
    yield eng, ckpt
    eng.close()


def _new_weights(base: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: (v + 0.02 * v.abs().mean().clamp_min(0.02) * torch.randn(v.shape, generator=g)).to(v.dtype)
            for k, v in base.items()}


def test_ipc_push_is_verified_and_equals_in_process_push(engine):
    from safetensors.torch import load_file

    from vllm_bridge.weights.buckets import iter_buckets
    from vllm_bridge.weights.inprocess import InProcessTransport
    from vllm_bridge.weights.ipc import IPCTransport
    from vllm_bridge.weights.verify import SyncCheck

    eng, ckpt = engine
    base = load_file(str(ckpt / "model.safetensors"))
    new = _new_weights(base, 1)
    seqs = [[5, 6, 7, 30, 31, 40, 41, 2, 9], [8, 9, 10, 11, 12, 17, 3]]  # vocab 64
    layout = SyncCheck.layout_of(eng)
    check = SyncCheck(layout)
    info = IPCTransport(eng).deliver(check.stream(iter_buckets(new.items(), 1 << 16, device="cuda")), 1, eng)
    assert info["num_tensors"] == len(new) and eng.weight_version == 1 and info["staged"] > 1
    v = check.verify(eng, 1)
    assert v["checked"] == sum(len(x) for x in check.layout) > 0 and v["unverified"] == 0
    via_ipc = eng.score(seqs)
    InProcessTransport(eng).push(iter_buckets(base.items()), 2)
    assert eng.score(seqs) != via_ipc
    InProcessTransport(eng).push(iter_buckets(new.items()), 3)
    assert eng.score(seqs) == via_ipc
    # a second IPC round into the same engine (handles opened again, buffers reused) lands too
    check = SyncCheck(layout)
    IPCTransport(eng).deliver(check.stream(iter_buckets(base.items(), 1 << 16, device="cuda")), 4, eng)
    assert check.verify(eng, 4)["checked"] and eng.weight_version == 4


def test_a_flipped_byte_in_any_parameter_is_caught(engine):
    from safetensors.torch import load_file

    from vllm_bridge.weights.buckets import WeightSyncError, iter_buckets
    from vllm_bridge.weights.ipc import IPCTransport
    from vllm_bridge.weights.verify import SyncCheck

    eng, ckpt = engine
    base = load_file(str(ckpt / "model.safetensors"))
    names = sorted(base)
    sizes = torch.tensor([base[n].numel() * base[n].element_size() for n in names], dtype=torch.float64)
    g = torch.Generator().manual_seed(7)
    layout = SyncCheck.layout_of(eng)
    caught, n = 0, 12
    for trial in range(n):
        name = names[int(torch.multinomial(sizes, 1, generator=g))]
        nbytes = int(sizes[names.index(name)])
        at = int(torch.randint(0, nbytes, (1,), generator=g))
        check = SyncCheck(layout)

        def corrupted(buckets):
            for b in buckets:  # after check.stream took the learner's bits: the transfer flips one byte
                if name in b:
                    t = b[name]
                    t.view(-1).view(torch.uint8)[at] ^= 0x10
                yield b

        stream = corrupted(check.stream(iter_buckets(base.items(), 1 << 16, device="cuda")))
        IPCTransport(eng).deliver(stream, 10 + trial, eng)
        try:
            check.verify(eng, 10 + trial)
        except WeightSyncError as e:
            caught += name in str(e)
    assert caught == n, f"{caught}/{n} flips caught"
