"""What the launch plans need to know about the GPU (host side only): its SM count, cached per device."""

from __future__ import annotations

import torch

__all__ = ["sm_count"]

_SM_COUNT: dict = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a CUDA device; its index, or the current device)."""
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SM_COUNT:
        _SM_COUNT[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SM_COUNT[i]
