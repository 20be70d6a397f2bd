"""Filesystem transport: each version a directory of safetensors bucket files (``v{version}``
under the run's weights directory, shared in a job), written under a temporary name and renamed,
so a reader never sees a partial version. The push returns a ``WeightUpdate`` (version + bucket
paths) that travels to wherever the engine is (a rollout process, a rollout node) and is applied
there; the worker reads the files itself, so tensors never cross a pipe."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

from vllm_bridge.weights.buckets import Bucket, WeightTransport, WeightUpdate, version_dir


class FilesystemTransport(WeightTransport):
    """Versions as directories of safetensors bucket files under ``directory``."""

    name = "filesystem"

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)

    def push(self, buckets: Iterable[Bucket], version: int) -> WeightUpdate:
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        final = version_dir(self.directory, version)
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        names, n_bytes = 0, 0
        for i, bucket in enumerate(buckets):
            path = tmp / f"bucket-{i:05d}.safetensors"
            save_file({k: v.detach().cpu().contiguous() for k, v in bucket.items()}, str(path),
                      metadata={"format": "pt"})
            names += len(bucket)
            n_bytes += path.stat().st_size
        if final.exists():  # a re-push of the same version (a restarted step): replace it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        paths = sorted(str(p) for p in final.glob("bucket-*.safetensors"))
        return WeightUpdate(int(version), paths, {"version": int(version), "num_tensors": names,
                                                  "bytes": n_bytes, "write_s": time.perf_counter() - t0})

    @staticmethod
    def apply(update: WeightUpdate, engine) -> dict:
        """Stage the version's bucket files (the worker reads them) and commit them."""
        return engine.apply_weights(list(update.paths), update.version)

    @staticmethod
    def release(update: WeightUpdate) -> None:
        if update.paths:
            shutil.rmtree(Path(update.paths[0]).parent, ignore_errors=True)
