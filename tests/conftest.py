"""Shared test policy: GPU tests skip without CUDA; `slow` tests are opt-in (RZ_SLOW=1)."""

import os

import pytest


def pytest_collection_modifyitems(config, items):
    import torch

    no_cuda = pytest.mark.skip(reason="needs CUDA (run on the GPU machine; results in benchmarks/)")
    not_slow = pytest.mark.skip(reason="opt-in long test: set RZ_SLOW=1")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_cuda)
        if "slow" in item.keywords and os.environ.get("RZ_SLOW") != "1":
            item.add_marker(not_slow)
