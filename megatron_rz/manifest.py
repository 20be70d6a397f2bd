"""Checkpoint manifests: a checkpoint directory is complete only with its COMPLETE manifest.

Each rank writes a BLAKE2b digest beside every file it saved (``write_digest``); rank 0 then writes
the manifest (step, every file's size and digest) atomically (``mark_complete``);
``verify_checkpoint`` says what is wrong with a directory (missing marker, a missing, truncated or
corrupted file) or None. ``set_verify`` (recipe ``checkpoint.verify``, applied by
megatron_rz.launch.runtime) chooses digests or sizes only. Files only: no torch, no Megatron; the
learner's checkpoints (megatron_rz.learner.checkpoint) and exact resume (megatron_rz.loop.resume)
both use it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

COMPLETE = "COMPLETE"


DIGEST_SUFFIX = ".blake2b"


def file_digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def write_digest(path: Path) -> None:
    """Each rank, right after writing a checkpoint file: its digest beside it (ranks hash in parallel)."""
    path = Path(path)
    tmp = path.with_name(path.name + DIGEST_SUFFIX + ".tmp")
    tmp.write_text(file_digest(path))
    os.replace(tmp, path.with_name(path.name + DIGEST_SUFFIX))


def mark_complete(ckpt_dir: Path, step: int) -> None:
    """Rank 0, once every rank's file and digest are on disk: the COMPLETE manifest, atomically."""
    d = Path(ckpt_dir)
    files = {}
    for f in sorted(d.iterdir()):
        if f.name == COMPLETE or f.name.endswith((DIGEST_SUFFIX, ".tmp")) or not f.is_file():
            continue
        side = f.with_name(f.name + DIGEST_SUFFIX)
        files[f.name] = {"size": f.stat().st_size,
                         "blake2b": side.read_text().strip() if side.is_file() else file_digest(f)}
    tmp = d / (COMPLETE + ".tmp")
    tmp.write_text(json.dumps({"step": int(step), "files": files}, indent=1))
    os.replace(tmp, d / COMPLETE)


_verify = "hash"  # recipe checkpoint.verify, set through set_verify


def set_verify(mode: str) -> None:
    """How verify_checkpoint checks files by default: "hash" (sizes and BLAKE2b digests) or "size"."""
    global _verify
    if mode not in ("hash", "size"):
        raise ValueError(f"checkpoint verify mode {mode!r}: must be 'hash' or 'size'")
    _verify = mode


def verify_mode() -> str:
    """The default of verify_checkpoint: "hash" or "size"."""
    return _verify


def verify_checkpoint(ckpt_dir: Path, hashes: bool | None = None) -> str | None:
    """None when the checkpoint is complete and intact, else what is wrong with it (naming the file).
    A marker without a manifest (written before manifests existed) counts as complete."""
    d = Path(ckpt_dir)
    marker = d / COMPLETE
    if not marker.is_file():
        return f"no {COMPLETE} marker (killed while saving)"
    text = marker.read_text(errors="replace")
    if not text.lstrip().startswith("{"):
        return None if text.startswith("step ") else f"{COMPLETE} marker is unreadable"
    try:
        files = json.loads(text)["files"]
    except (ValueError, KeyError, TypeError):
        return f"{COMPLETE} marker is torn or unreadable"
    if hashes is None:
        hashes = _verify != "size"
    for name, want in files.items():
        f = d / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != want["size"]:
            return f"{name} has {f.stat().st_size} bytes, {want['size']} were written (truncated or overwritten)"
        if hashes and file_digest(f) != want["blake2b"]:
            return f"{name} is corrupted (its BLAKE2b digest differs from the one written with it)"
    return None
