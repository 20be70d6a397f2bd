"""Background weight writes from CUDA weights (vllm_bridge.weights.filesystem): the bucket copies go
into pinned host buffers asynchronously, so the push must wait for them before it returns; the
weights changed in place right after the push (the learner's next optimizer step) must not reach
the files, version after version, while torch's caching host allocator hands the same pinned blocks
back."""

import pytest
import torch

from gpu_util import need_cuda

pytestmark = pytest.mark.gpu


def test_files_hold_the_pushed_cuda_weights_while_the_learner_changes_them(tmp_path):
    need_cuda()
    from safetensors.torch import load_file

    from vllm_bridge.weights import make_transport
    from vllm_bridge.weights.buckets import iter_buckets

    g = torch.Generator(device="cuda").manual_seed(0)
    params = {f"w{i}": torch.randn(1024 * (1 + i % 4), 1024, device="cuda", generator=g).to(torch.bfloat16)
              for i in range(24)}
    t = make_transport("filesystem", run_dir=tmp_path, max_lag=2, background_bytes=64 << 20)
    got, want = [], {}
    for version in range(1, 6):
        want[version] = {k: v.cpu() for k, v in params.items()}
        t.push_background(iter_buckets(params.items(), bucket_bytes=8 << 20, device=None), version, got.append)
        for v in params.values():  # the next update, in place, on the default stream
            v.mul_(1.5).add_(0.25)
    t.flush()
    t.close()
    assert [u.version for u in got] == [1, 2, 3, 4, 5]
    for u in got:
        files = {}
        for p in u.paths:
            files.update(load_file(p))
        assert files.keys() == want[u.version].keys()
        for k, v in want[u.version].items():
            assert torch.equal(files[k], v), (u.version, k)
