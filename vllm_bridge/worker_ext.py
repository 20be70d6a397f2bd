"""Worker extension for weight sync: methods mixed into vLLM's Worker class.

vLLM builds its Worker class with ``worker_extension_cls`` as an extra base, so these methods run
in the worker process (``self`` is the Worker) and are called from the driver with
``llm.collective_rpc("rz_...", args=(...))``. Runs inside vLLM workers: never import megatron here.

Transport: tensors cannot be pickled as RPC arguments (vLLM 0.32's serializer rejects memoryview),
so each bucket travels either as safetensors bytes or as the path of a safetensors file written
by the driver. Buckets are *staged* (kept in worker memory) and applied together by
``rz_commit_weights`` with one ``Worker.reload_weights(weights_iterator=...)`` call: vLLM's
layerwise reload processes a layer only when all of its parameters arrived, and a layer whose
weights are split over two reload calls would be materialised half-empty, so never reload per
bucket.
"""

from __future__ import annotations

import time
from typing import Any

import torch

# Parameters that stay readable after vLLM CPU weight processing (plain tensors in checkpoint
# layout: embeddings, RMSNorm weights, router gates, DeepSeek score bias). Most linear weights
# are prepacked for oneDNN on CPU and MoE experts for the CPU grouped GEMM: not comparable.
READABLE_SUFFIXES = (
    "embed_tokens.weight",
    "norm.weight",  # input_layernorm, post_attention_layernorm, q_norm, k_norm, kv_a_layernorm, final
    "layernorm.weight",
    "mlp.gate.weight",
    "e_score_correction_bias",
)


def tensor_checksum(t: torch.Tensor) -> tuple[float, float]:
    """Two float64 checksums: the plain sum and a position-weighted sum (catches permutations).

    Computed on the CPU whatever the tensor's device, so the learner's (CUDA or CPU) and the
    engine's (CUDA or CPU) checksums of the same values are summed in one order."""
    x = t.detach().reshape(-1).to("cpu", torch.float64)
    w = (torch.arange(x.numel(), dtype=torch.float64) % 1009 + 1.0) / 1009.0
    return float(x.sum()), float((x * w).sum())


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensor_bits(t: torch.Tensor) -> int:
    """An exact checksum of the tensor's bytes: sum of its elements' bit patterns (as integers)
    times odd position weights, modulo 2^64. One changed element changes it by d * w with d != 0 and
    w odd, which is never 0 mod 2^64: any single flipped byte (or bit) is caught, always (the float
    sums above miss flips in low mantissa bits: they change a sum of ~1e3 values by ~1e-7).

    Computed where the tensor lives (CUDA tensors on their device), reading each element once:
    the flat tensor in chunks of the weights' period (BITS_PERIOD elements), each chunk's patterns
    widened to int64 in one reused buffer, multiplied by the cached weight table and summed. Integer
    sums wrap mod 2^64 and do not depend on the order of the additions, so the result is the same on
    every device, thread count and chunking (``bit_patterns`` x ``bits_weights`` summed at once, as
    vllm_bridge.weights.reshard.part_bits does for a part, gives the same number). ~0.27 s per GB on one CPU
    core (docs/architecture.md "Reliability")."""
    x = t.detach().reshape(-1)
    if not x.is_contiguous():
        x = x.contiguous()
    x = x.view(_INT_VIEW[x.element_size()])
    n = x.numel()
    if n == 0:
        return 0
    w = _weight_table(x.device)
    buf = torch.empty(min(n, BITS_PERIOD), dtype=torch.int64, device=x.device)
    total = torch.zeros((), dtype=torch.int64, device=x.device)
    for s in range(0, n, BITS_PERIOD):
        m = min(BITS_PERIOD, n - s)
        b = buf[:m]
        b.copy_(x[s:s + m])  # widen (sign-extends int16 / int32, as bit_patterns' .to(int64))
        b.mul_(w[:m])  # int64 products wrap mod 2^64
        total += b.sum()
    return int(total)  # the one host synchronisation


BITS_PERIOD = 1000003  # bits_weights repeats with this period (a prime)
_WEIGHT_TABLES: dict = {}


def _weight_table(device: torch.device) -> torch.Tensor:
    """bits_weights of flat positions 0 .. BITS_PERIOD - 1 on ``device`` (8 MB, made once)."""
    key = str(device)
    w = _WEIGHT_TABLES.get(key)
    if w is None:
        w = _WEIGHT_TABLES[key] = bits_weights(torch.arange(BITS_PERIOD, dtype=torch.int64, device=device))
    return w


def bit_patterns(t: torch.Tensor) -> torch.Tensor:
    """The elements' bit patterns as flat int64 (what tensor_bits weighs)."""
    x = t.detach().contiguous().reshape(-1)
    return x.view(_INT_VIEW[x.element_size()]).to(torch.int64)


def bits_weights(flat_index: torch.Tensor) -> torch.Tensor:
    """tensor_bits' odd position weights of flat positions (int64); the sum over parts of a tensor
    of bits x weight is the tensor's (vllm_bridge.weights.reshard.part_bits)."""
    return (flat_index % BITS_PERIOD) * 2 + 1


def bits_entry(p: torch.Tensor) -> dict:
    """What an engine reports for one parameter in the every-parameter verification
    (rz_shard_checksums; compared by vllm_bridge.weights.reshard.check_resharded)."""
    return {"shape": list(p.shape), "dtype": str(p.dtype).replace("torch.", ""), "bits": tensor_bits(p)}


def checksum_entry(p: torch.Tensor) -> dict:
    """What an engine reports for one parameter (rz_checksums; compared by engine.check_weights)."""
    s, ws = tensor_checksum(p)
    return {"shape": list(p.shape), "dtype": str(p.dtype).replace("torch.", ""), "sum": s, "wsum": ws,
            "bits": tensor_bits(p)}


def is_readable_name(name: str) -> bool:
    return name.endswith(READABLE_SUFFIXES)


class WeightSyncExtension:
    """Mixed into vLLM's Worker. All state lives in attributes prefixed ``_rz_``."""

    # ---- staging -------------------------------------------------------------------------------
    def _rz_staged_list(self) -> list[dict[str, torch.Tensor]]:
        if not hasattr(self, "_rz_staged"):
            self._rz_staged = []
        return self._rz_staged

    def rz_stage_weights(self, payload: Any) -> int:
        """Stage one bucket: ``bytes`` (safetensors serialisation) or ``str`` (safetensors path).

        Returns the number of tensors staged so far.
        """
        from safetensors.torch import load, load_file

        if isinstance(payload, (bytes, bytearray, memoryview)):
            tensors = load(bytes(payload))
        elif isinstance(payload, str):
            tensors = load_file(payload)
        else:
            raise TypeError(f"rz_stage_weights: bytes or path expected, got {type(payload)}")
        staged = self._rz_staged_list()
        staged.append(tensors)
        return sum(len(b) for b in staged)

    def rz_stage_ipc(self, payload: dict) -> int:
        """Stage one bucket handed over by CUDA IPC (vllm_bridge.weights.ipc): copied out of the
        learner's buffer onto this worker's device. Returns the number of tensors staged so far."""
        from vllm_bridge.weights import ipc

        staged = self._rz_staged_list()
        staged.append(ipc.stage(payload, getattr(self, "device", torch.device("cuda"))))
        return sum(len(b) for b in staged)

    def rz_abort_weights(self) -> None:
        self._rz_staged = []

    def rz_commit_weights(self, version: int, reload: bool = True) -> dict:
        """Load all staged buckets into the running model in place, then set the version.

        reload=False drops the staged tensors without loading them: only for testing that
        verification catches a sync that transferred nothing.
        """
        staged = self._rz_staged_list()
        self._rz_staged = []
        names = [n for b in staged for n in b]
        t0 = time.perf_counter()
        if reload and names:
            device = getattr(self, "device", torch.device("cpu"))

            def weights():
                for bucket in staged:
                    for name, t in bucket.items():
                        yield name, t.to(device)

            # Worker.reload_weights -> vllm.model_executor.model_loader.reload.reload_weights:
            # layerwise in-place reload (keeps parameter storage, re-runs weight processing).
            # The vLLM 0.32 CPU MoE prepack bug on reload is fixed by vllm_bridge.vllm_patches.
            self.reload_weights(weights_iterator=weights(), is_checkpoint_format=True)
        self._rz_version = int(version)
        return {"num_tensors": len(names), "reload_s": time.perf_counter() - t0, "reloaded": bool(reload)}

    def rz_weight_version(self) -> int:
        return int(getattr(self, "_rz_version", 0))

    # ---- read back -----------------------------------------------------------------------------
    def rz_checksums(self, names: list[str] | None = None) -> dict[str, dict]:
        """Checksums of readable parameters, keyed by vLLM parameter name (= HF name for the
        readable kinds of Qwen3-MoE / DeepSeek-V3). names=None: every readable parameter."""
        model = self.model_runner.get_model()
        params = dict(model.named_parameters())
        params.update(dict(model.named_buffers()))
        wanted = names if names is not None else [n for n in params if is_readable_name(n)]
        out = {}
        for n in wanted:
            p = params.get(n)
            if p is None:
                continue
            out[n] = checksum_entry(p)
        return out

    def rz_shard_checksums(self, names: list[str] | None = None) -> dict:
        """{"rank", "sums": bits_entry of every parameter} (names: only those): the read-back of the
        every-parameter verification (vllm_bridge.weights.verify.SyncCheck, weights.reshard.check_resharded),
        computed where the parameters live (on the device on GPU)."""
        model = self.model_runner.get_model()
        params = dict(model.named_parameters())
        wanted = params if names is None else [n for n in names if n in params]
        return {"rank": int(self.rank), "sums": {n: bits_entry(params[n]) for n in wanted}}

    def rz_verify_layout(self) -> dict:
        """What the every-parameter verification compares on this worker (transport.SyncCheck):
        an aligned class's rz_shard_layout (every parameter, with the box of the Hugging Face tensor
        it holds); a stock vLLM class (no rz_shards) only the parameters that keep their checkpoint
        name, shape and bytes (READABLE_SUFFIXES), and under "unverified" {name: bytes} of the rest
        (packed q/k/v and gate/up, stacked experts, weights moved into oneDNN / CPU MoE packs on CPU:
        their bytes are not the checkpoint's, or, emptied, not held at all: 0 bytes)."""
        model = self.model_runner.get_model()
        if hasattr(model, "rz_shards"):
            return {**self.rz_shard_layout(), "unverified": {}}
        params, unverified = {}, {}
        for n, p in model.named_parameters():
            if is_readable_name(n) and p.numel() > 0:  # vLLM-CPU empties the weights it moved into a GEMM pack
                params[n] = {"shape": list(p.shape), "box": [[0, s] for s in p.shape],
                             "dtype": str(p.dtype).replace("torch.", "")}
            else:
                unverified[n] = int(p.numel() * p.element_size())
        return {"rank": int(self.rank), "params": params, "unverified": unverified}

    def rz_flip_byte(self, name: str, index: int, xor: int) -> bool:
        """XOR one byte of a parameter in place (the flip tests corrupt a synced engine this way;
        the same call again undoes it). False when this worker does not hold ``name``."""
        p = dict(self.model_runner.get_model().named_parameters()).get(name)
        if p is None:
            return False
        with torch.no_grad():
            raw = p.data.view(-1).view(torch.uint8)
            raw[int(index)] ^= int(xor)
        return True

    def rz_param_names(self) -> list[str]:
        return [n for n, _ in self.model_runner.get_model().named_parameters()]

    def rz_shard_layout(self) -> dict:
        """What this worker holds, for a resharded sync (vllm_bridge.weights.reshard): its rank and, per
        parameter (HF name), the full tensor's shape and the box (per dimension [start, stop)) this
        worker holds of it, read from the aligned class's own ``rz_shards`` (name -> (dim, start,
        n) of a TP-split parameter; every other parameter is held whole)."""
        model = self.model_runner.get_model()
        if not hasattr(model, "rz_shards"):
            raise ValueError(f"rz_shard_layout: {type(model).__name__} is not an aligned class (no rz_shards): "
                             "a resharded weight sync needs an aligned engine (rollout.weight_transport=auto otherwise)")
        shards, tp = model.rz_shards, int(getattr(model, "rz_tp", 1))
        params = {}
        for n, p in model.named_parameters():
            shape, box = list(p.shape), [[0, s] for s in p.shape]
            if n in shards:
                dim, start, k = shards[n]
                shape[dim] = k * tp
                box[dim] = [start, start + k]
            params[n] = {"shape": shape, "box": box, "dtype": str(p.dtype).replace("torch.", "")}
        return {"rank": int(self.rank), "params": params}

    def rz_stage_shards(self, directory: str) -> dict:
        """Stage this worker's parts of a resharded version (``directory/rank{rank}/part-*.safetensors``,
        vllm_bridge.weights.reshard.ShardedFilesystemTransport), each parameter assembled to this worker's
        shard; rz_commit_weights then loads them in place. Returns what was read."""
        from pathlib import Path

        from safetensors.torch import load_file

        from vllm_bridge.shards import assemble, layout_from_reports

        me = self.rz_shard_layout()
        files = sorted((Path(directory) / f"rank{me['rank']}").glob("part-*.safetensors"))
        parts: dict[str, torch.Tensor] = {}
        for f in files:
            parts.update(load_file(str(f)))
        params = layout_from_reports([{**me, "rank": 0}])[0]
        bucket = assemble(parts, params)
        self._rz_staged_list().append(bucket)
        return {"rank": me["rank"], "files": len(files), "file_bytes": sum(f.stat().st_size for f in files),
                "bytes": sum(t.numel() * t.element_size() for t in parts.values()), "num_tensors": len(bucket)}

    def rz_param_shapes(self) -> dict[str, list[int]]:
        """{parameter name: shape} of this worker's model (a tensor-parallel worker's shards)."""
        return {n: list(p.shape) for n, p in self.model_runner.get_model().named_parameters()}

    # ---- scoring helpers -----------------------------------------------------------------------
    def rz_set_logit_scale(self, factor: float) -> float:
        """Multiply the model's LogitsProcessor scale by ``factor`` (1/T for score at temperature
        T; prompt logprobs in vLLM 0.32 ignore the request temperature). Returns the old scale."""
        lp = self.model_runner.get_model().logits_processor
        old = float(lp.scale)
        if not hasattr(self, "_rz_base_logit_scale"):
            self._rz_base_logit_scale = old
        lp.scale = self._rz_base_logit_scale * float(factor)
        return old

    def rz_reset_logit_scale(self) -> None:
        if hasattr(self, "_rz_base_logit_scale"):
            self.model_runner.get_model().logits_processor.scale = self._rz_base_logit_scale

    # ---- localisation (rz check) ----------------------------------------------------------------
    def rz_trace(self, on: bool) -> bytes:
        """Start (on=True) or stop recording the aligned model's activation taps
        (kernels.models.trace); stopping returns torch.save bytes of
        [(name, tensor)] in call order (bytes: the RPC's serializer does not keep tensors)."""
        import io

        from kernels.models import trace

        out = trace.stop_trace()
        if on:
            trace.start_trace()
        buf = io.BytesIO()
        torch.save([] if on else out, buf)
        return buf.getvalue()

    def rz_perturb(self, name: str, factor: float) -> None:
        """Scale one parameter in place (the localiser's self-test injects a fault this way)."""
        p = dict(self.model_runner.get_model().named_parameters())[name]
        with torch.no_grad():
            p.mul_(factor)

    def rz_aligned_sampler(self) -> bool:
        """Whether this worker's sampler is the aligned one (vllm_bridge.sampler_patch)."""
        from vllm_bridge.sampler_patch import is_aligned

        return is_aligned(getattr(self.model_runner, "sampler", None))

    def rz_pid(self) -> int:
        import os

        return os.getpid()
