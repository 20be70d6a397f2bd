"""The NCCL weight transport (vllm_bridge.weights.nccl.NCCLTransport) against a real CUDA vLLM engine:
vLLM's weight-transfer API (init_weight_transfer_engine / start_weight_update / update_weights /
finish_weight_update, backend "nccl") moves a bucketed stream from this process (NCCL rank 0,
cuda:0) into the engine's worker (NCCL rank 1, on cuda:1: NCCL refuses two ranks on one GPU).

The engine's weights after the NCCL push are checked with the one verification
(transport.verify_weights) and its scores must be torch.equal to those after the same weights
arrive through the in-process transport (same engine, same bits, whatever the transport).
Needs 2 GPUs and CUDA vLLM (docs/gpu.md); skipped otherwise."""

import os
import socket

import pytest
import torch

from gpu_util import need_cuda

pytestmark = pytest.mark.gpu


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    need_cuda()
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (NCCL refuses two ranks on one device)")
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cuda():
            pytest.skip("needs CUDA vLLM")
    except Exception:
        pytest.skip("needs CUDA vLLM")
    from megatron_rz.recipe import load_recipe
    from megatron_rz.learner.tiny_models import make_random_checkpoint
    from vllm_bridge.engine import RolloutEngine

    ckpt = tmp_path_factory.mktemp("nccl") / "ckpt"
    make_random_checkpoint(load_recipe(None, []), ckpt)
    torch.cuda.set_device(0)
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = "1"  # the engine's processes see GPU 1 only
    try:
        eng = RolloutEngine(ckpt, max_model_len=128, kv_cache_gb=1.0, enforce_eager=True,
                            weight_transfer_config={"backend": "nccl"})
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
    yield eng, ckpt
    eng.close()


def test_nccl_push_equals_in_process_push(engine):
    from safetensors.torch import load_file

    from vllm_bridge.weights.buckets import iter_buckets
    from vllm_bridge.weights.inprocess import InProcessTransport
    from vllm_bridge.weights.nccl import LLMWeightSyncClient, NCCLTransport
    from vllm_bridge.weights.verify import verify_weights

    eng, ckpt = engine
    base = load_file(str(ckpt / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    new = {k: v + 0.02 * v.abs().mean().clamp_min(0.02) * torch.randn(v.shape, generator=g) for k, v in base.items()}
    seqs = [[5, 6, 7, 30, 31, 40, 41, 2, 9], [8, 9, 10, 11, 12, 17, 3]]

    nccl = NCCLTransport(LLMWeightSyncClient(eng.llm), master_address="127.0.0.1", master_port=_free_port(),
                         world_size=2, engine=eng)
    try:
        info = nccl.push(iter_buckets(new.items(), 1 << 16, device="cuda:0"), 1).info
        assert info["num_tensors"] == len(new) and eng.weight_version == 1
        assert verify_weights(eng, new.items())["checked"]
        via_nccl = eng.score(seqs)
        samples = eng.generate([seqs[0][:3]], 2, max_new_tokens=4, seed=1)
        assert all(s.versions == [1] * len(s.response_ids) for s in samples)
        # back to the base weights and forward again, now in-process: the same bits
        InProcessTransport(eng).push(iter_buckets(base.items()), 2)
        assert eng.score(seqs) != via_nccl
        InProcessTransport(eng).push(iter_buckets(new.items()), 3)
        assert eng.score(seqs) == via_nccl
        # and a second NCCL round on the same group lands too
        nccl.push(iter_buckets(base.items(), 1 << 16, device="cuda:0"), 4)
        assert verify_weights(eng, base.items())["checked"] and eng.weight_version == 4
    finally:
        nccl.close()
