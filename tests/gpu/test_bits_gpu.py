"""The batched exact checksum kernel compiled on the GPU (kernels.triton.bits): the numbers of
tensor_bits' torch path on the CPU copies, for every element size, non-contiguous views, tensors
past the weights' period and past 2^31 elements; a flipped bit anywhere changes the checksum."""

import pytest
import torch

from gpu_util import need_cuda

pytestmark = pytest.mark.gpu


def test_bits_many_equals_the_cpu_checksums():
    need_cuda()
    from kernels.triton.bits import bits_many
    from vllm_bridge.worker_ext import tensor_bits, tensors_bits

    g = torch.Generator(device="cuda").manual_seed(0)
    ts = [torch.randn(1000, device="cuda", generator=g).to(torch.bfloat16),
          torch.randn(3, 7, device="cuda", generator=g),
          torch.randint(-2**62, 2**62, (50,), device="cuda", generator=g),
          torch.randn(5000, device="cuda", generator=g).to(torch.float8_e4m3fn),
          torch.randn(64, 48, device="cuda", generator=g)[:, ::3],
          torch.zeros(0, device="cuda"),
          torch.randn(3_000_017, device="cuda", generator=g).to(torch.float16),
          torch.randint(0, 255, (77,), device="cuda", dtype=torch.uint8, generator=g),
          torch.randn(2048, 4096, device="cuda", generator=g).to(torch.bfloat16)[:, 100:3000]]
    got = bits_many(ts).tolist()
    want = [tensor_bits(t.cpu()) for t in ts]
    assert got == want
    assert tensors_bits(ts) == want  # the worker's entry point (one synchronisation)
    x = ts[6].clone()
    for pos in (0, 1_000_002, 1_000_003, x.numel() - 1):
        y = x.clone()
        y.view(torch.int16)[pos] ^= 1
        assert bits_many([y]).tolist() != bits_many([x]).tolist(), pos


def test_bits_of_a_tensor_past_two_to_the_31_elements():
    need_cuda()
    from kernels.triton.bits import bits_many
    from vllm_bridge.worker_ext import tensor_bits

    n = (1 << 31) + 4099
    x = torch.zeros(n, dtype=torch.uint8, device="cuda")
    x[-1] = 7
    x[5] = 3
    # only two non-zero bytes: the checksum is their patterns times their weights
    want = (7 * ((n - 1) % 1000003 * 2 + 1) + 3 * (5 * 2 + 1)) % (1 << 64)
    assert bits_many([x]).tolist()[0] % (1 << 64) == want
    assert tensor_bits(x) % (1 << 64) == want
    del x
    torch.cuda.empty_cache()
