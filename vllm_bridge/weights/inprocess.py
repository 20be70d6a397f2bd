"""In-process transport: the engine lives in this process (a RolloutEngine on the learner's
rank 0); each bucket is serialised to safetensors bytes and staged over vLLM's collective_rpc."""

from __future__ import annotations

import time
from collections.abc import Iterable

from vllm_bridge.weights.buckets import Bucket, WeightTransport, WeightUpdate, to_safetensors


class InProcessTransport(WeightTransport):
    """Buckets staged straight into an engine of this process (safetensors bytes per RPC)."""

    name = "inprocess"

    def __init__(self, engine):
        self.engine = engine

    def push(self, buckets: Iterable[Bucket], version: int, *, reload: bool = True) -> WeightUpdate:
        t0 = time.perf_counter()
        info = self.engine.apply_weights((to_safetensors(b) for b in buckets), version, reload=reload)
        info["total_s"] = time.perf_counter() - t0
        return WeightUpdate(int(version), [], info)

    def deliver(self, buckets: Iterable[Bucket], version: int, engine=None) -> dict:
        """Push into ``engine`` (a restarted engine replaces the one this transport was built on)."""
        if engine is not None:
            self.engine = engine
        return self.push(buckets, version).info
