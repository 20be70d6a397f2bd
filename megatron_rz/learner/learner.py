"""The learner: a Megatron-Core GPTModel, Megatron's DDP wrapper and Megatron's optimizer.

Batch conventions (the same on every rank of the layout):
- Every rank passes the same full batch `input_ids` [B, S] (right padding allowed: the model is
  causal, so tokens after a sequence never change its log-probabilities).
- Rows are split across data-parallel ranks (contiguous chunks). Each rank pads its chunk with
  dummy rows to ceil(B / dp) rows so that every rank runs the same number of equally shaped
  forwards and backwards (the MoE token dispatcher and tensor parallelism are collective); dummy
  rows are never shown to the loss function and get zero gradient.
- The sequence is right-padded to a multiple of tp (sequence parallelism splits it).

`logprobs` returns out[:, t] = log p(input_ids[:, t] | input_ids[:, :t]) for t >= 1 and 0 at t = 0,
computed as log_softmax(logits / temperature) in float32 (vocab-parallel when tp > 1); with
top-k / top-p (`top_k`, `top_p` arguments, the recipe's rollout settings) the processed logprob
of kernels.sampled_logprobs instead, in both modes (the distribution the rollout sampled from;
-inf for a token outside the kept set).

`train_step` loss convention: for each micro batch `loss_fn(logp, rows)` returns
`(loss_sum, metrics)` where loss_sum is a SUM over the micro batch's rows (responses) and every
numeric metric is also a SUM over those rows. The optimizer step uses the gradient of
(sum over all B rows) / B, whatever the dp and micro-batch split; the returned metrics are the
sums over all micro batches and dp ranks divided by B (i.e. means over the B rows), plus
`loss` (same convention), `grad_norm` (before clipping) and `lr`.

Checkpoints: `save_checkpoint(dir)` writes a Megatron dist_checkpointing checkpoint (torch_dist
format: every tensor under its global name and shape; model, optimizer incl. Adam moments, version,
RNG; see megatron_rz.learner.checkpoint), so a run saved at one tp / ep / dp layout resumes at another
(`load_checkpoint`), e.g. TP=2/EP=2 on two ranks -> TP=1/EP=1 on one and back.

Parameters must be float32 on CPU: Megatron's bf16 optimizer only accepts CUDA tensors.

Devices: on a CPU host everything runs on the CPU over gloo. When CUDA is available the model lives
on GPU LOCAL_RANK and the collectives run over NCCL (model.init_parallel / build_gpt_model); inputs
and per-row tensors may be passed on the CPU (they are moved per micro batch), and `logprobs` /
`train_step(...)["logprobs"]` are returned on the CPU either way (what the trainers expect).

`mode="aligned"` (recipe field `mode`) builds the model from megatron_rz.learner.aligned_spec: every forward
op goes through `kernels`, the vocab-parallel logits are gathered to the full vocabulary and
`kernels.logprobs_from_logits` (log_softmax(logits / T) in fp32) is applied, so `logprobs` is
torch.equal to kernels.models.qwen3_dsv3.reference_logprobs for any micro-batch size, batch
composition, right padding, TP in {1, 2} and EP in {1, 2}. Backward is the plain gradient
(correct to rounding, not invariant). `mode="fast"` is Megatron's stock numerics.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from megatron_rz.learner import hf_convert
from megatron_rz.learner.model import build_gpt_model, init_parallel
from megatron_rz.recipe import AlgoConfig, ModelConfig, ParallelConfig
from kernels.sampling import truncation_active

LossFn = Callable[[torch.Tensor, dict], tuple[torch.Tensor, dict]]


def _pad_token_id(hf_dir) -> int | None:
    import json

    if isinstance(hf_dir, (str, Path)) and (Path(hf_dir) / "config.json").is_file():
        return json.loads((Path(hf_dir) / "config.json").read_text()).get("pad_token_id")
    return None


class Learner:
    def __init__(self, model_cfg: ModelConfig, parallel: ParallelConfig, algo: AlgoConfig, hf_dir, seed: int = 0,
                 mode: str = "fast", train: bool = True, te: str = "off"):
        """train=False builds the model for scoring only (no optimizer): `rz check` uses it, and it
        allows bf16 on CPU, where Megatron's bf16 optimizer cannot run. te: the recipe's runtime.te
        (auto | on | off; fast mode only): which layer spec the fast learner builds
        (megatron_rz.learner.te_spec.resolve_spec), kept as ``self.spec`` (aligned | te | local)."""
        from megatron_rz.learner import te_spec
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        if train and model_cfg.dtype == "bfloat16" and not torch.cuda.is_available():
            # Megatron's mixed-precision optimizer (Float16OptimizerWithFloat16Params) accepts only
            # torch.cuda.*Tensor parameters in 0.16.1; build_gpt_model itself works in bf16.
            raise ValueError("model.dtype=bfloat16 training needs CUDA (Megatron's bf16 optimizer); use model.dtype=float32 on CPU")
        init_parallel(parallel, seed)
        if mode not in ("fast", "aligned"):
            raise ValueError(f"Learner: mode must be 'fast' or 'aligned', not {mode!r}")
        own = hf_convert.family_learner(model_cfg)  # the family's own learner module, or None: GPTModel
        if own is not None:
            # One DeepSeek-V4 (Kimi-K3) learner implementation, the aligned one; in fast mode it faces the
            # stock vLLM model (the mismatch fast mode measures).
            mode = "aligned"
        self.model_cfg, self.parallel, self.algo, self.mode = model_cfg, parallel, algo, mode
        self.spec = te_spec.resolve_spec(mode, te, model_cfg.arch)  # raises for te=on where TE cannot run
        self.version = 0
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.dp = ps.get_data_parallel_world_size()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_group = ps.get_data_parallel_group()

        if own is not None:  # V4.1, Kimi-K3: sizes and layer schedule read from the checkpoint's config
            model = own.build_model(model_cfg, parallel, hf_dir)
        else:
            model = build_gpt_model(model_cfg, parallel, mode=mode, te=self.spec == "te")
        hf_convert.load_hf_into_megatron(model, hf_dir, model_cfg)
        self.model = model
        self.device = next(model.parameters()).device  # cuda:LOCAL_RANK on a GPU, else cpu
        bf16 = model_cfg.dtype == "bfloat16"
        dist_opt = parallel.distributed_optimizer
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=dist_opt
        )
        self.ddp = DistributedDataParallel(model.config, ddp_config, model)
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=algo.lr,
            weight_decay=algo.weight_decay,
            adam_beta1=algo.adam_beta1,
            adam_beta2=algo.adam_beta2,
            adam_eps=1e-8,
            clip_grad=algo.grad_clip,
            bf16=bf16,
            params_dtype=getattr(torch, model_cfg.dtype),
            use_distributed_optimizer=dist_opt,
        )
        self.optimizer = get_megatron_optimizer(opt_config, [self.ddp]) if train else None
        # Hugging Face builds the embedding with padding_idx=pad_token_id: that row gets no
        # gradient (it stays as loaded). Mirror it so both sides train the same parameters.
        self.pad_token_id = _pad_token_id(hf_dir)

    # ------------------------------------------------------------------ forward helpers

    def _my_rows(self, batch: int) -> tuple[torch.Tensor, int]:
        """This dp rank's global row indices and the padded per-rank row count."""
        per = math.ceil(batch / self.dp)
        start = min(self.dp_rank * per, batch)
        return torch.arange(start, min(start + per, batch)), per

    def _forward_logp(self, ids: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
        """[b, S] token log-probs (with grad if enabled) for a micro batch every rank runs: the
        processed logprob of the sampling settings (kernels.sampled_logprobs: temperature, then
        top-k / top-p; -inf for a token outside the kept set, see kernels/sampling.py)."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        ids = ids.to(self.device)  # rows are picked / padded on the CPU; the forward runs on the model's device
        b, s = ids.shape
        s_pad = math.ceil(s / self.tp) * self.tp
        if s_pad != s:
            ids = torch.cat([ids, ids.new_zeros(b, s_pad - s)], dim=1)
        pos = torch.arange(s_pad, device=ids.device).unsqueeze(0).expand(b, s_pad)
        target = ids[:, 1:s]
        if self.mode == "aligned" or bool(truncation_active(self.model_cfg.vocab_size, top_k, top_p)):
            # fast mode with top-k / top-p: the same processed logprob on the stock logits
            return self._aligned_logp(self.ddp(ids, pos, None)[:, : s - 1], target, temperature, top_k, top_p)
        logits = self.ddp(ids, pos, None)[:, : s - 1].float() / temperature  # [b, s-1, V/tp]
        if self.tp == 1:
            lp = torch.log_softmax(logits, dim=-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
        else:
            lp = -vocab_parallel_cross_entropy(logits.contiguous(), target)
        return torch.cat([lp.new_zeros(b, 1), lp], dim=1)

    def _aligned_logp(self, logits: torch.Tensor, target: torch.Tensor, temperature: float, top_k: int = 0,
                      top_p: float = 1.0) -> torch.Tensor:
        """fp32 logits [b, s-1, V/tp] (aligned output layer) -> [b, s] log-probs, exactly
        `kernels.sampled_logprobs` on full-vocabulary rows (= the reference's
        `kernels.logprobs_from_logits` when top-k / top-p are off): the engine's sampler calls the
        same function (vllm_bridge/sampler_patch.py)."""
        import kernels
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

        b, s1 = target.shape
        if self.tp > 1:  # exact: an all-gather of the vocab shards (backward: take own shard)
            logits = gather_from_tensor_model_parallel_region(logits.contiguous())
        lp = kernels.sampled_logprobs(logits.reshape(b * s1, -1).float().contiguous(), target.reshape(-1),
                                      temperature, top_k, top_p)
        lp = lp.view(b, s1)
        return torch.cat([lp.new_zeros(b, 1), lp], dim=1)

    @staticmethod
    def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
        if x.shape[0] == rows:
            return x
        pad = x.new_zeros((rows - x.shape[0],) + tuple(x.shape[1:]))
        return torch.cat([x, pad], dim=0)

    # ------------------------------------------------------------------ public API

    @torch.no_grad()
    def logprobs(self, input_ids: torch.Tensor, temperature: float = 1.0, micro_batch_size: int | None = None, *,
                 top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
        """Full [B, S] float32 log-probs on every rank (rows computed dp-split, then all-gathered),
        processed with the sampling settings (temperature, top-k, top-p) the rollout used."""
        input_ids = input_ids.long().cpu()
        batch, _ = input_ids.shape
        mbs = micro_batch_size or self.algo.micro_batch_size
        rows, per = self._my_rows(batch)
        ids = self._pad_rows(input_ids[rows], per)
        self.ddp.eval()
        out = torch.cat([self._forward_logp(ids[i : i + mbs], temperature, top_k, top_p) for i in range(0, per, mbs)],
                        dim=0)
        self.ddp.train()
        if self.dp > 1:
            parts = [torch.empty_like(out) for _ in range(self.dp)]
            dist.all_gather(parts, out.contiguous(), group=self.dp_group)
            out = torch.cat(parts, dim=0)
        return out[:batch].cpu()  # no-op on a CPU host

    def train_step(self, input_ids: torch.Tensor, loss_fn: LossFn, temperature: float = 1.0,
                   micro_batch_size: int = 64, top_k: int = 0, top_p: float = 1.0, **per_row_tensors) -> dict:
        """One optimizer step on the whole batch; see the module docstring for the conventions."""
        from megatron.core.distributed import finalize_model_grads

        if self.optimizer is None:
            raise RuntimeError("this Learner was built with train=False (scoring only); build it with train=True")

        input_ids = input_ids.long().cpu()
        batch = input_ids.shape[0]
        rows, per = self._my_rows(batch)
        ids = self._pad_rows(input_ids[rows], per)
        self.ddp.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        sums: dict[str, torch.Tensor] = {}
        loss_total = torch.zeros((), dtype=torch.float64)
        seen = []  # the logprobs the loss used, detached: returned so callers need no second forward
        for i in range(0, per, micro_batch_size):
            logp = self._forward_logp(ids[i : i + micro_batch_size], temperature, top_k, top_p)
            seen.append(logp.detach())
            real = rows[i : i + micro_batch_size]  # global rows of this micro batch (may be empty)
            n = real.numel()
            loss = logp.sum() * 0.0  # keeps every rank's backward (collectives) in step
            if n:
                sel = {k: v[real].to(logp.device) for k, v in per_row_tensors.items()}
                loss_sum, metrics = loss_fn(logp[:n], sel)
                loss = loss + loss_sum / batch
                loss_total += float(loss_sum.detach())
                for k, v in metrics.items():
                    sums[k] = sums.get(k, torch.zeros((), dtype=torch.float64)) + float(v)
            loss.backward()
        finalize_model_grads([self.ddp])
        self._zero_pad_row_grad()
        ok, grad_norm, _ = self.optimizer.step()
        self.version += 1

        keys = sorted(sums)
        if self.dp > 1:  # a dp rank without real rows (batch < dp, or its rows padding) has no metrics
            every = [None] * self.dp
            dist.all_gather_object(every, keys, group=self.dp_group)
            keys = sorted(set().union(*every))
        vec = torch.stack([loss_total] + [sums.get(k, torch.zeros((), dtype=torch.float64)) for k in keys])
        if self.dp > 1:  # every dp rank now has the same metric keys
            vec = vec.to(self.device)  # NCCL reduces device tensors only (a no-op on the CPU)
            dist.all_reduce(vec, group=self.dp_group)
            vec = vec.cpu()
        out = {"loss": float(vec[0]) / batch}
        out.update({k: float(v) / batch for k, v in zip(keys, vec[1:])})
        out["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        out["lr"] = float(self.optimizer.param_groups[0]["lr"])
        out["update_successful"] = bool(ok)
        out["version"] = self.version
        logp_all = torch.cat(seen, dim=0)
        if self.dp > 1:
            parts = [torch.empty_like(logp_all) for _ in range(self.dp)]
            dist.all_gather(parts, logp_all.contiguous(), group=self.dp_group)
            logp_all = torch.cat(parts, dim=0)
        # [B, S] logprobs under the pre-update weights, exactly those the loss saw (not a metric).
        out["logprobs"] = logp_all[:batch].cpu()
        return out

    def _zero_pad_row_grad(self) -> None:
        emb = self.model.embedding.word_embeddings
        pid = self.pad_token_id
        if pid is not None and emb.vocab_start_index <= pid < emb.vocab_end_index:
            emb.weight.main_grad[pid - emb.vocab_start_index].zero_()

    def export_hf_weights(self):
        """Collective generator of (HF name, full tensor); see hf_convert.export_hf_weights."""
        return hf_convert.export_hf_weights(self.model, self.model_cfg)

    def local_hf_pieces(self):
        """This rank's weights as HF-named pieces, no collective: (HF name, local tensor, full HF
        shape, the piece's box in it) per piece (hf_convert.local_hf_pieces), for a resharded sync
        (megatron_rz.loop.weights.write_resharded)."""
        return hf_convert.local_hf_pieces(self.model, self.model_cfg)

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, ckpt_dir, step: int | None = None) -> Path:
        """Collective: a Megatron dist_checkpointing checkpoint of model, optimizer, version and RNG
        (megatron_rz.learner.checkpoint), resumable under any layout; `step` (the trainer's step; default:
        version) is stored and returned by load_checkpoint. COMPLETE is written last."""
        from megatron_rz.learner import checkpoint

        if self.optimizer is None:
            raise RuntimeError("this Learner was built with train=False (scoring only): it has no optimizer to checkpoint")
        return checkpoint.save(self, ckpt_dir, self.version if step is None else int(step))

    def load_checkpoint(self, ckpt_dir) -> int:
        """Restore model, optimizer and version from save_checkpoint's files (written under any
        tp / ep / dp layout); returns the stored step."""
        from megatron_rz.learner import checkpoint

        if self.optimizer is None:
            raise RuntimeError("this Learner was built with train=False (scoring only): load a checkpoint into a training learner")
        return checkpoint.load(self, ckpt_dir)
