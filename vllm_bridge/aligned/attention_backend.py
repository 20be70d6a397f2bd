"""vLLM attention backend whose attention is ``kernels.attention`` over the paged KV cache.

Registered as ``AttentionBackendEnum.CUSTOM`` by :func:`vllm_bridge.aligned.register_aligned`, and
handed to every aligned ``Attention`` layer as ``attn_backend=`` (vLLM 0.32's CPU platform ignores a
backend chosen by config: platforms/cpu.py get_attn_backend_cls).

Built on vLLM's CPU backend: same KV cache shape ``[num_blocks, kv_heads, block_size, 2 * head]``
(viewed as ``[num_blocks, kv_heads, 2 * block_size, head]``: K rows then V rows of each block), same
metadata builder (query_start_loc, seq_lens, block_table, slot_mapping), and
``forward_includes_kv_cache_update = False`` so vLLM calls :meth:`do_kv_cache_update` before
:meth:`forward`. The differences:

* ``do_kv_cache_update`` is a plain indexed copy (exact), skipping slots < 0 (padding);
* ``forward`` gathers every sequence's keys/values 0..seq_len-1 from its blocks (one indexed copy
  for the whole batch) and makes ONE ``kernels.attn.attention_packed`` call for all sequences'
  queries, at positions ``seq_len - n_query + j`` (prefill, chunked prefill and decode alike). Row
  for row that is the bits of ``kernels.attention`` called per sequence (the compiled CPU kernels
  of ``kernels/_native.c``, or exactly that per-sequence call where they are unavailable); it
  reduces with zero-extension invariant trees, so a query's bits do not depend on how many keys
  follow it or on the batch. (The per-sequence loop remains for ``rz_history_fn`` and non-CPU
  tensors.)
* the profiling run (``attn_metadata is None``) writes zeros.

Value head size: vLLM's CPU KV cache stores K and V with one head size. DeepSeek-V3 MLA computed in
expanded form has qk head 96 and v head 32: the model writes V zero-padded to 96 into the cache and
passes ``rz_v_head_dim=32`` to the impl, which attends over the first 32 V channels only (the output
channels beyond are zero). ``kernels.attention``'s per-channel result does not depend on Dv.
"""

from __future__ import annotations

import torch

import kernels
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

__all__ = ["RZAlignedAttentionBackend", "RZAlignedAttentionImpl"]


class RZAlignedAttentionImpl(CPUAttentionBackendImpl):
    def __init__(self, *args, rz_v_head_dim: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rz_v_head_dim = rz_v_head_dim
        # Set by a model for the duration of one call (aligned DeepSeek-V4): instead of attention,
        # hand each sequence's cached rows (K then V channels) to fn(a, b, positions, history),
        # which returns the output rows a:b. Used for caches that hold per-token payloads.
        self.rz_history_fn = None

    @staticmethod
    def _split_cache(kv_cache: torch.Tensor):
        nb, kvh, bs, two_d = kv_cache.shape
        kv = kv_cache.view(nb, kvh, 2 * bs, two_d // 2)
        return kv[:, :, :bs], kv[:, :, bs:], bs

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if kv_cache is None or kv_cache.numel() == 0:
            return
        kc, vc, bs = self._split_cache(kv_cache)
        n = slot_mapping.shape[0]
        slots = slot_mapping.to(torch.long)
        valid = slots >= 0
        if not bool(valid.all()):
            idx = valid.nonzero().squeeze(1)
            slots = slots[idx]
            key, value = key[:n][idx], value[:n][idx]
        else:
            key, value = key[:n], value[:n]
        blk = torch.div(slots, bs, rounding_mode="floor")
        off = slots - blk * bs
        # kc[blk, :, off] is [n, kv_heads, head]
        kc[blk, :, off] = key.to(kc.dtype)
        vc[blk, :, off] = value.to(vc.dtype)

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported")
        if attn_metadata is None:  # profiling / warm-up run
            return output.zero_()
        kc, vc, bs = self._split_cache(kv_cache)
        kvh, D = kc.shape[1], kc.shape[3]
        dv = self.rz_v_head_dim or D
        n_tok = attn_metadata.num_actual_tokens
        qsl = attn_metadata.query_start_loc.tolist()
        num_reqs = len(qsl) - 1
        seq_lens = attn_metadata.seq_lens[:num_reqs].tolist()
        out = output.view(output.shape[0], self.num_heads, -1)
        out.zero_()
        fn = self.rz_history_fn
        if fn is None and query.device.type == "cpu":
            self._forward_packed(query, kc, vc, bs, dv, qsl, seq_lens, attn_metadata.block_table, out)
            if n_tok < out.shape[0]:
                out[n_tok:] = 0
            return output
        for i in range(num_reqs):
            a, b = qsl[i], qsl[i + 1]
            nq = b - a
            if nq <= 0:
                continue
            L = int(seq_lens[i])
            nblk = (L + bs - 1) // bs
            blocks = attn_metadata.block_table[i, :nblk].to(torch.long)
            k = kc[blocks].permute(0, 2, 1, 3).reshape(nblk * bs, kvh, D)[:L]
            pos = torch.arange(L - nq, L)
            if fn is not None:
                v = vc[blocks].permute(0, 2, 1, 3).reshape(nblk * bs, kvh, D)[:L]
                o = fn(a, b, pos, torch.cat([k.reshape(L, -1), v.reshape(L, -1)], dim=-1))
                out.view(out.shape[0], -1)[a:b, : o.shape[1]] = o.to(out.dtype)
                continue
            v = vc[blocks].permute(0, 2, 1, 3).reshape(nblk * bs, kvh, D)[:L, :, :dv]
            o = kernels.attention(query[a:b], k, v, pos, self.scale, out_dtype=out.dtype)
            out[a:b, :, :dv] = o
        if n_tok < out.shape[0]:
            out[n_tok:] = 0
        return output


    def _forward_packed(self, query, kc, vc, bs, dv, qsl, seq_lens, block_table, out) -> None:
        """Every sequence of the batch in one ``kernels.attn.attention_packed`` call: each sequence's
        keys/values 0..seq_len-1 gathered from its blocks (one indexed copy for the batch), its
        queries at positions ``seq_len - n_query + j``. Row for row the bits of the per-sequence
        ``kernels.attention`` call (the compiled CPU kernels, or that very call as the fallback)."""
        from kernels.attn import attention_packed

        num_reqs = len(qsl) - 1
        q_start, nq, key_start, kept = [], [], [], []
        k0 = 0
        for i in range(num_reqs):
            n = qsl[i + 1] - qsl[i]
            if n <= 0:
                continue
            L = int(seq_lens[i])
            q_start.append(qsl[i])
            nq.append(n)
            key_start.append(k0)
            kept.append((i, L))
            k0 += L
        if not kept:
            return
        lens = torch.tensor([L for _, L in kept], dtype=torch.long)
        rows = torch.tensor([i for i, _ in kept], dtype=torch.long)
        seq_of_key = torch.repeat_interleave(torch.arange(len(kept)), lens)
        starts = torch.cumsum(lens, 0) - lens
        j = torch.arange(k0) - starts[seq_of_key]
        blk = block_table[rows[seq_of_key], torch.div(j, bs, rounding_mode="floor")].to(torch.long)
        off = j % bs
        k = kc[blk, :, off]  # [sum L, kv_heads, head]
        v = vc[blk, :, off][..., :dv]
        n_tok = qsl[-1]
        pos = torch.zeros(n_tok, dtype=torch.long)
        nq_t = torch.tensor(nq, dtype=torch.long)
        qs_t = torch.tensor(q_start, dtype=torch.long)
        seq_of_q = torch.repeat_interleave(torch.arange(len(kept)), nq_t)
        owned = torch.repeat_interleave(qs_t, nq_t) + (torch.arange(int(nq_t.sum())) - (torch.cumsum(nq_t, 0) - nq_t)[seq_of_q])
        pos[owned] = (lens - nq_t)[seq_of_q] + (owned - qs_t[seq_of_q])
        o = attention_packed(query[:n_tok], k, v, q_start, nq, key_start, pos, self.scale, out_dtype=out.dtype)
        out[:n_tok, :, :dv] = o

class RZAlignedAttentionBackend(CPUAttentionBackend):
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any head size: the attention is computed in torch

    @staticmethod
    def get_supported_kernel_block_sizes(*args, **kwargs) -> list:
        # Any block size: blocks are gathered in torch. (vLLM-CPU forces block_size 16 for MLA
        # models on CPUs without AMX (platforms/cpu.py), which the stock CPU backend's
        # MultipleOf(32) would refuse: "No common block size for 16".)
        from vllm.v1.attention.backend import MultipleOf

        return [MultipleOf(1)]

    @staticmethod
    def get_impl_cls():
        return RZAlignedAttentionImpl
