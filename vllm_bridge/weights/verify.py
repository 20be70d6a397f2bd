"""Weight verification after a sync.

Verification after a sync, every parameter (``SyncCheck``; the training loop's, for every
transport): each engine worker reports what it holds (worker_ext.rz_verify_layout: every parameter of
an aligned class with the box of the Hugging Face tensor it holds, a TP shard or the whole tensor);
while the learner's tensors stream past, the exact byte checksum (worker_ext.tensor_bits) of each
worker's box of each tensor is computed, in the engine parameter's dtype; after the commit every
worker checksums every parameter where it lives (rz_shard_checksums, on the device on GPU) and
any difference, missing or unexpected parameter raises WeightSyncError naming it. The same bits
and boxes as the resharded sync's check (vllm_bridge.weights.reshard). A stock vLLM class (mode=fast)
holds most checkpoint tensors in its own layouts (packed q/k/v and gate/up, stacked experts, and on
CPU linears moved into oneDNN packs): its workers report, per checkpoint tensor, the box of it they
hold, found by running vLLM's own weight loaders on index tensors (worker_ext.stock_pieces), and the
bits of the box of the parameter holding it -- read live where the parameter stays as loaded, else
taken as the reload wrote it, before vLLM packed it (``"at": "load"``; counted in ``at_load``).
Whatever the loaders put elsewhere than one box is reported as unverified. ``check_weights`` is the
older readable-tensor comparison (RolloutEngine.verify_sync).

Runs on both sides; never imports megatron.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from vllm_bridge.weights.buckets import Bucket, WeightSyncError
from vllm_bridge.worker_ext import is_readable_name, resolve_bits, tensor_bits, tensor_checksum, tensors_bits_lazy


def check_weights(named_tensors: Iterable[tuple[str, torch.Tensor]], checksums: dict | Callable[[list[str]], dict],
                  version: int, *, rtol: float = 1e-6, min_checked: int = 1) -> dict:
    """The one weight verification, whatever the transport: the learner's readable tensors
    against an engine's checksums.

    ``checksums`` is the engine's {name: {"shape", "dtype", "sum", "wsum"[, "bits"]}} or a function
    of the wanted names returning it (RolloutEngine.engine_checksums). Only names that stay
    readable inside vLLM are compared (worker_ext.READABLE_SUFFIXES); "bits" (when reported) makes
    the comparison exact. Raises WeightSyncError on a mismatch or when fewer than ``min_checked``
    tensors could be compared (a check that checks nothing is not a check). Returns
    {"checked": [...], "max_rel_err": float}."""
    want = {n: t for n, t in named_tensors if is_readable_name(n)}
    got = checksums(sorted(want)) if callable(checksums) else checksums
    checked, bad, max_rel = [], [], 0.0
    for name, t in want.items():
        g = got.get(name)
        if g is None or list(t.shape) != g["shape"]:
            continue
        same_dtype = t.detach().cpu().to(getattr(torch, g["dtype"]))
        s, ws = tensor_checksum(same_dtype)
        scale = float(t.detach().double().abs().sum()) + 1e-12
        err = max(abs(s - g["sum"]), abs(ws - g["wsum"])) / scale
        max_rel = max(max_rel, err)
        checked.append(name)
        if not math.isfinite(err) or err > rtol:
            bad.append(f"{name} (rel err {err:.3g})")
        elif "bits" in g and tensor_bits(same_dtype) != g["bits"]:  # exact: any changed byte
            bad.append(f"{name} (bytes differ; rel err only {err:.3g})")
    if bad:
        raise WeightSyncError(
            f"engine weights differ from the learner's after sync to version {version}: "
            f"{len(bad)}/{len(checked)} checked tensors mismatch: {', '.join(bad[:8])}. The "
            "update did not reach the model (wrong names, dropped buckets, reload skipped)."
        )
    if len(checked) < min_checked:
        raise WeightSyncError(
            f"verify_sync could compare only {len(checked)} tensors (need {min_checked}); "
            f"names given: {len(want)} readable of those passed"
        )
    return {"checked": checked, "max_rel_err": max_rel}


def readable(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The tensors check_weights can compare, copied out of a stream (a small part of a model:
    embeddings, norms, router gates), so a bucket stream can be verified after it was sent."""
    return {n: t.detach().cpu().clone() for n, t in named_tensors if is_readable_name(n)}


def verify_weights(engine, named_tensors: Iterable[tuple[str, torch.Tensor]], **kw: Any) -> dict:
    """check_weights against an engine (anything with engine_checksums(names) and weight_version)."""
    return check_weights(named_tensors, engine.engine_checksums, engine.weight_version, **kw)


# ------------------------------------------------------------------ every parameter, every sync

_MOD = 1 << 64


def worker_targets(engine) -> list[tuple[str, Callable[..., list]]]:
    """(label, rpc) per engine process group: a local RolloutEngine is one (its collective_rpc reaches
    every worker); the vLLM servers' RolloutClient one per server (``worker_rpcs``)."""
    if hasattr(engine, "worker_rpcs"):
        return list(engine.worker_rpcs())
    return [("the rollout engine", engine.collective_rpc)]


class SyncCheck:
    """The every-parameter verification of one sync (see the module docstring).

    ``reports``: the workers' rz_verify_layout replies (``SyncCheck.layout_of(engine)``; ask once per
    engine and keep them). Feed it the learner's tensors as they are sent (``stream(buckets)``,
    ``add(name, tensor)``), then ``verify(engine, version)`` after the commit."""

    FLUSH_BYTES = 256 << 20  # checksum the pending boxes once they hold this much

    def __init__(self, reports: list[dict]):
        from vllm_bridge.shards import layout_from_reports

        reports = sorted(reports, key=lambda r: int(r["rank"]))
        self.layout = layout_from_reports([{"rank": r["rank"], "params": r["params"]} for r in reports])
        self.unverified = {n: b for r in reports for n, b in r.get("unverified", {}).items()}
        self.expected: dict[tuple[int, str], int] = {}
        self.wrong_shape: dict[tuple[int, str], str] = {}
        self._holders: dict[str, list[tuple[int, object]]] = {}
        for e, lay in enumerate(self.layout):
            for name, p in lay.items():
                self._holders.setdefault(name, []).append((e, p))
        self.bytes = 0
        self.seconds = 0.0
        self._pending: list[torch.Tensor] = []  # boxes added, not yet checksummed (flush)
        self._waiting: list[tuple[tuple[int, str], int]] = []  # ((worker, name), index into _pending)
        self._pending_bytes = 0

    @staticmethod
    def layout_of(engine) -> list[dict]:
        """The first engine target's rz_verify_layout replies (every worker's)."""
        return worker_targets(engine)[0][1]("rz_verify_layout")

    def add(self, name: str, t: torch.Tensor) -> None:
        """One learner tensor (its full Hugging Face tensor): the bits of every worker's box of it."""
        from vllm_bridge.shards import narrow

        held = self._holders.get(name)
        if not held:
            return  # no worker holds it (a tied lm_head, MTP layers, another stage's layers)
        t0 = time.perf_counter()
        done: dict = {}
        for e, p in held:
            if tuple(t.shape) != tuple(p.shape):
                self.wrong_shape[(e, name)] = f"learner {tuple(t.shape)}, engine full tensor {tuple(p.shape)}"
                continue
            key = (p.box, p.dtype)
            if key not in done:
                x = narrow(t.detach(), p.box)
                if str(x.dtype).replace("torch.", "") != p.dtype:
                    x = x.to(getattr(torch, p.dtype))
                done[key] = len(self._pending)
                self._pending.append(x)
                self._pending_bytes += x.numel() * x.element_size()
                self.bytes += x.numel() * x.element_size()
            self._waiting.append(((e, name), done[key]))
        self.seconds += time.perf_counter() - t0
        if self._pending_bytes > self.FLUSH_BYTES:  # never hold more than this many tensors' bytes
            self.flush()

    def flush(self) -> None:
        """Checksum the boxes added since the last flush: on the GPU one launch per element size,
        no host synchronisation (the values are read in compare)."""
        if not self._pending:
            return
        t0 = time.perf_counter()
        vals = tensors_bits_lazy(self._pending)
        for key, j in self._waiting:
            self.expected[key] = vals[j]
        self._pending, self._waiting, self._pending_bytes = [], [], 0
        self.seconds += time.perf_counter() - t0

    def stream(self, buckets: Iterable[Bucket]) -> Iterator[Bucket]:
        """The bucket stream, unchanged, with every tensor added as it passes (checksummed per
        bucket, before the bucket goes on: a transport may reuse its memory afterwards)."""
        for b in buckets:
            for n, t in b.items():
                self.add(n, t)
            self.flush()
            yield b

    def named(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> "SyncCheck":
        for n, t in named_tensors:
            self.add(n, t)
        self.flush()
        return self

    def _resolve(self) -> None:
        self.flush()
        keys = [k for k, v in self.expected.items() if not isinstance(v, int)]
        if keys:
            t0 = time.perf_counter()
            for k, v in zip(keys, resolve_bits([self.expected[k] for k in keys])):
                self.expected[k] = v
            self.seconds += time.perf_counter() - t0
        for k, v in self.expected.items():
            self.expected[k] = v % _MOD

    def compare(self, reported: list[dict], version: int, where: str = "the rollout engine") -> dict:
        """``reported[e]``: worker e's rz_shard_checksums "sums". Raises WeightSyncError (one line)
        naming every parameter whose bytes differ, that the learner did not send, or that the
        worker did not report."""
        self._resolve()
        bad, ranks, checked = [], [], 0
        if len(reported) != len(self.layout):
            raise WeightSyncError(f"weight sync to version {version}: {where} reported {len(reported)} workers, its "
                                  f"layout has {len(self.layout)}")
        for e, lay in enumerate(self.layout):
            for name, p in lay.items():
                got, want = reported[e].get(name), self.expected.get((e, name))
                if (e, name) in self.wrong_shape:
                    bad.append(f"rank {e} {name} (shape: {self.wrong_shape[(e, name)]})")
                elif want is None:
                    bad.append(f"rank {e} {name} (not sent by the learner)")
                elif got is None or [b - a for a, b in p.box] != list(got["shape"]):
                    bad.append(f"rank {e} {name} (not reported, or shape {None if got is None else got['shape']})")
                elif (int(got["bits"]) - want) % _MOD:
                    bad.append(f"rank {e} {name} (bytes differ)")
                if len(bad) > len(ranks):
                    ranks.append(e)
                checked += 1
        if bad:
            raise WeightSyncError(
                f"{where} (worker {ranks[0]}): its weights differ from the learner's after the sync to version "
                f"{version}: {len(bad)}/{checked} parameters: {', '.join(bad[:8])}{' ...' if len(bad) > 8 else ''}. "
                "The update did not reach the model intact (a corrupted transfer, dropped buckets, a skipped reload)")
        if checked == 0:
            raise WeightSyncError(f"weight sync to version {version}: {where} holds no parameter the check can compare "
                                  "(rollout.verify_sync=false turns the check off)")
        return {"checked": checked}

    def verify(self, engine, version: int) -> dict:
        """Every worker of every engine target against the learner's bits. Returns {"checked"
        (parameters per target), "targets", "bytes" (learner bytes checksummed), "learner_s",
        "engine_s" (read-back, all targets), "at_load" (of those checked, the pieces a stock class
        packed after loading, checked as loaded), "unverified" (parameters a stock class holds in a
        layout its loaders do not fill box by box), "unverified_bytes"}."""
        t0 = time.perf_counter()
        checked = at_load = 0
        targets = worker_targets(engine)
        names = sorted({n for lay in self.layout for n in lay})
        for label, rpc in targets:
            reported = [x["sums"] for x in sorted(rpc("rz_shard_checksums", names), key=lambda x: int(x["rank"]))]
            checked = self.compare(reported, version, label)["checked"]
            at_load = sum(e.get("at") == "load" for r in reported for e in r.values())
        return {"checked": checked, "targets": len(targets), "bytes": self.bytes, "learner_s": self.seconds,
                "engine_s": time.perf_counter() - t0, "at_load": at_load, "unverified": len(self.unverified),
                "unverified_bytes": sum(self.unverified.values())}
