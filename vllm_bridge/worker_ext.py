"""Worker extension for weight sync: methods mixed into vLLM's Worker class.

vLLM builds its Worker class with ``worker_extension_cls`` as an extra base, so these methods run
in the worker process (``self`` is the Worker) and are called from the driver with
``llm.collective_rpc("rz_...", args=(...))``. Runs inside vLLM workers: never import megatron here.

Transport: tensors cannot be pickled as RPC arguments (vLLM 0.32's serializer rejects memoryview),
so each bucket travels either as safetensors bytes or as the path of a safetensors file written
by the driver. Buckets are *staged* (kept in worker memory) and applied together by
``rz_commit_weights``: for an aligned class (``RZ_LOADS_IN_PLACE``) one call of its own in-place
``load_weights``; for a stock class one ``Worker.reload_weights(weights_iterator=...)`` call:
vLLM's layerwise reload processes a layer only when all of its parameters arrived, and a layer
whose weights are split over two reload calls would be materialised half-empty, so never reload
per bucket.
"""

from __future__ import annotations

import inspect
import math
import time
from typing import Any

import torch

# Parameters whose vLLM name, shape and layout are the checkpoint's (embeddings, RMSNorm weights,
# router gates, DeepSeek score bias): what the older check_weights compares. On CPU the router gate
# too is moved into an sgl pack (emptied). The every-parameter check of a stock class covers the rest
# through stock_pieces (below).
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
    if t.is_cuda:  # one Triton launch (kernels.triton.bits), the same number
        return tensors_bits([t])[0]
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


def tensors_bits(tensors: list[torch.Tensor]) -> list[int]:
    """tensor_bits of each tensor. CUDA tensors: all of them in one Triton launch per element size
    (``kernels.triton.bits.bits_many``: each byte read once, no widened copies) and one host
    synchronisation for the list; CPU tensors: tensor_bits one by one."""
    return [int(v) for v in tensors_bits_lazy(tensors)]


def tensors_bits_lazy(tensors: list[torch.Tensor]) -> list:
    """tensors_bits without the host synchronisation: CUDA tensors' checksums come back as 0-d
    int64 device tensors (read them later, all at once, with :func:`resolve_bits`), CPU tensors'
    as ints."""
    cuda = [i for i, t in enumerate(tensors) if t.is_cuda]
    out: list = [None] * len(tensors)
    by_dev: dict = {}
    for i in cuda:
        by_dev.setdefault(tensors[i].device, []).append(i)
    if by_dev:
        from kernels.triton.bits import bits_many

        for idx in by_dev.values():
            vals = bits_many([tensors[i] for i in idx])
            for j, i in enumerate(idx):
                out[i] = vals[j]
    for i, t in enumerate(tensors):
        if out[i] is None:
            out[i] = tensor_bits(t)
    return out


def resolve_bits(values: list) -> list[int]:
    """Ints of tensors_bits_lazy's values: device tensors read in one synchronisation per device."""
    out = list(values)
    dev = [i for i, v in enumerate(out) if isinstance(v, torch.Tensor)]
    if dev:
        got = torch.stack([out[i].to(out[dev[0]].device) for i in dev]).tolist()
        for i, g in zip(dev, got):
            out[i] = int(g)
    return out


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


# ------------------------------------------------------------------ stock vLLM classes (mode=fast)
#
# A stock class holds most checkpoint tensors in its own layouts: q/k/v packed into qkv_proj, gate/up into
# gate_up_proj, experts stacked into w13_weight / w2_weight, TP shards of each; on CPU, vLLM then moves the
# linear weights into oneDNN / sgl packs (the parameter is emptied: nothing left to read back) and
# re-lays the MoE stacks out for the CPU grouped GEMM. Where each checkpoint tensor lands is what vLLM's
# own weight loaders do, so that is what is asked: ``stock_pieces`` runs the model's load_weights
# through vLLM's layerwise-reload machinery on shape-only (meta) tensors (nothing is written: every layer
# gets its own tensors back untouched), then replays each recorded loader call on a float64 scratch copy
# of its parameter with a tensor of flat indices as the loaded weight. The scratch then says, element by
# element, which checkpoint element the loader put there; each (checkpoint tensor -> parameter) write is
# kept when it is one box of the parameter filled, in row-major order, by one box of the checkpoint
# tensor (a narrow copy: the TP shard of q_proj into its rows of qkv_proj, expert 3's gate_proj into
# w13_weight[3, :I]) -- then the bits of that engine box equal tensor_bits of that checkpoint box, and
# the learner's side checks it as any other box (vllm_bridge.weights.verify.SyncCheck). Anything else
# (a transposing or scattering loader) is reported unverified with its bytes.
#
# The engine's bits of a piece are taken at load time: rz_commit_weights's reload runs with a hook
# (``_capture_loaded``) that checksums every piece of a layer after vLLM's loaders wrote it and before
# process_weights_after_loading packs it. A parameter that processing leaves as loaded (norms,
# embeddings, router gates; every linear on GPU) is read back live at verify time instead, so a later
# change of its memory is caught as well; a packed one (CPU oneDNN linears, CPU MoE stacks) is checked
# as loaded: the bytes the pack was built from, not the pack.


def _checkpoint_shapes(model_dir: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, safetensors dtype)} from the headers of the checkpoint's safetensors files (the
    learner's export has the checkpoint's names and shapes)."""
    import json
    import struct
    from pathlib import Path

    out = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        out.update({k: (tuple(v["shape"]), v["dtype"]) for k, v in header.items() if k != "__metadata__"})
    return out


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn}


def _record_loads(model, vllm_config, shapes: dict) -> list[tuple[str, str, Any, str]]:
    """[(module name, parameter name, bound loader arguments, checkpoint name)] of every loader call the
    model's load_weights makes for meta tensors of the checkpoint's shapes; the model keeps its tensors."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import layerwise as lw
    from vllm_bridge.vllm_compat import skip_load_tensors
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

    module_name = {id(m): n for n, m in model.named_modules()}
    probes = {n: torch.empty(s, dtype=_ST_DTYPES.get(d, torch.float32), device="meta") for n, (s, d) in shapes.items()
              if not n.endswith(tuple(skip_load_tensors()))}  # those are written straight into the live tensor
    of_probe = {id(t): n for n, t in probes.items()}
    records: list = []
    real = lw._layerwise_process

    def record(layer, info):  # instead of materialise + load + process: note the calls, put the layer back
        for pname, args in info.loaded_weights:
            t = next((v for k, v in args.arguments.items() if k != "param" and isinstance(v, torch.Tensor)
                      and id(v if v._base is None else v._base) in of_probe), None)
            name = None if t is None else of_probe[id(t if t._base is None else t._base)]
            records.append((module_name.get(id(layer), "?"), pname, args, name))
        for t in get_layer_tensors(layer).values():
            t.weight_loader = lw._get_original_loader(t)
        lw._place_kernel_tensors(layer, info)
        info.reset()

    lw._layerwise_process = record
    try:
        with set_current_vllm_config(vllm_config):
            lw.initialize_layerwise_reload(model)
            try:
                model.load_weights(iter(probes.items()))
            finally:
                lw.finalize_layerwise_reload(model, vllm_config.model_config)
    finally:
        lw._layerwise_process = real
    return records


def _box_of(sel: torch.Tensor) -> list[list[int]] | None:
    """The box [[lo, hi), ...] that the True elements of ``sel`` fill exactly, or None."""
    count = int(sel.sum())
    if count == 0:
        return None
    box = []
    for d in range(sel.dim()):  # per dimension, the span of the indices that hold a True element
        hit = sel.movedim(d, 0).reshape(sel.shape[d], -1).any(1).nonzero().flatten()
        box.append([int(hit[0]), int(hit[-1]) + 1])
    return box if math.prod(b - a for a, b in box) == count else None


def stock_pieces(model, vllm_config, model_dir: str) -> dict:
    """Where vLLM's loaders put each checkpoint tensor in a stock model (see above): {"pieces":
    {checkpoint name: {"param", "engine_box", "shape" (the checkpoint tensor's), "box" (of it), "dtype"}},
    "unverified": {parameter: bytes the pieces do not cover}, "irregular": [checkpoint names]}."""
    from vllm_bridge.shards import narrow

    shapes = _checkpoint_shapes(model_dir)
    records = _record_loads(model, vllm_config, shapes)
    params = dict(model.named_parameters())
    by_param: dict[str, list] = {}
    for mod, pname, args, name in records:
        by_param.setdefault(f"{mod}.{pname}" if mod else pname, []).append((args, name))
    pieces, irregular, covered, written = {}, [], {}, {}
    for qual, calls in by_param.items():
        meta_p = calls[0][0].arguments["param"]
        scratch = torch.zeros(tuple(meta_p.shape), dtype=torch.float64)
        scratch.__class__ = meta_p.__class__
        scratch.__dict__ = meta_p.__dict__.copy()
        spans, off = [], 0
        for args, name in calls:
            if name is None:
                continue
            full = math.prod(shapes[name][0])
            a = inspect.BoundArguments(args.signature, dict(args.arguments))
            for k, v in args.arguments.items():
                if k != "param" and isinstance(v, torch.Tensor) and v.is_meta:
                    idx = torch.arange(off + 1, off + 1 + full, dtype=torch.float64)
                    a.arguments[k] = idx.as_strided(v.size(), v.stride(), v.storage_offset())
            a.arguments["param"] = scratch
            getattr(meta_p, "weight_loader")(*a.args, **a.kwargs)
            spans.append((name, off, full))
            off += full
        s = scratch.data
        written[qual] = int((s > 0).sum())
        dtype = str(meta_p.dtype).replace("torch.", "")
        for name, o, n in spans:
            sel = (s > o) & (s <= o + n)
            ebox = _box_of(sel)
            if ebox is None or name in pieces:
                irregular.append(name)
                continue
            src = narrow(s, ebox).reshape(-1).to(torch.int64) - (o + 1)
            grid = torch.arange(n, dtype=torch.int64).view(shapes[name][0])
            hbox = _box_of(torch.zeros(shapes[name][0], dtype=torch.bool).view(-1).index_fill_(
                0, src, True).view(shapes[name][0]))
            if hbox is None or not torch.equal(narrow(grid, hbox).reshape(-1), src):
                irregular.append(name)  # not a box-to-box copy in row-major order
                continue
            pieces[name] = {"param": qual, "engine_box": ebox, "shape": list(shapes[name][0]), "box": hbox,
                            "dtype": dtype}
    for name in irregular:
        pieces.pop(name, None)
    for p in pieces.values():
        covered[p["param"]] = covered.get(p["param"], 0) + math.prod(b - a for a, b in p["engine_box"])
    by_module: dict[str, dict[str, list]] = {}
    for name, p in pieces.items():
        mod, _, pname = p["param"].rpartition(".")
        by_module.setdefault(mod, {}).setdefault(pname, []).append((name, p["engine_box"]))
    unverified = {}
    for qual, p in params.items():
        if qual in written:
            left = written[qual] - covered.get(qual, 0)
            if left:
                unverified[qual] = int(left * p.element_size())
        elif not is_readable_name(qual):
            unverified[qual] = int(p.numel() * p.element_size())
    return {"pieces": pieces, "by_module": by_module, "unverified": unverified,
            "irregular": sorted(set(irregular)), "shapes": {q: list(c[0][0].arguments["param"].shape)
                                                            for q, c in by_param.items()}}


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
        path = None
        if reload and names:
            device = getattr(self, "device", torch.device("cpu"))

            def weights():
                for bucket in staged:
                    for name, t in bucket.items():
                        yield name, t.to(device)

            model = self.model_runner.get_model()
            path = "in_place" if getattr(model, "RZ_LOADS_IN_PLACE", False) else "layerwise"
            if path == "in_place":
                # An aligned class: its load_weights copies each tensor into its parameter's storage
                # (default_weight_loader), packs stay views, no weight processing to re-run. What
                # vLLM's reload does with is_checkpoint_format=False (param.copy_ by name), but
                # through the class's loader, which also takes this rank's TP block. vLLM's
                # layerwise reload (below) would stage every layer in new tensors and copy back.
                with torch.no_grad():
                    model.load_weights(weights())
            # Worker.reload_weights -> vllm.model_executor.model_loader.reload.reload_weights:
            # layerwise in-place reload (keeps parameter storage, re-runs weight processing).
            # The vLLM 0.32 CPU MoE prepack bug on reload is fixed by vllm_bridge.vllm_patches.
            elif getattr(self, "_rz_stock", None) is not None:  # a stock class whose layout was asked
                with self._rz_capture_loaded():
                    self.reload_weights(weights_iterator=weights(), is_checkpoint_format=True)
            else:
                self.reload_weights(weights_iterator=weights(), is_checkpoint_format=True)
        self._rz_version = int(version)
        return {"num_tensors": len(names), "reload_s": time.perf_counter() - t0, "reloaded": bool(reload),
                "path": path}

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
        computed where the parameters live (on the device on GPU). A stock class (its layout asked:
        rz_verify_layout) also reports the checkpoint tensors it holds in its own layouts, by checkpoint
        name: the bits of the box of the parameter holding it, read live where vLLM's processing left the
        parameter as loaded (``"at": "live"``), else the bits taken when it was loaded (``"at": "load"``:
        a CPU oneDNN-packed linear, a CPU MoE stack), before the pack was built from them."""
        from vllm_bridge.shards import narrow

        model = self.model_runner.get_model()
        params = dict(model.named_parameters())
        stock = getattr(self, "_rz_stock", None)
        wanted = list(params) if names is None else names
        sums = {}
        whole = [n for n in wanted if n in params and (stock is None or n not in stock["pieces"])]
        # every whole parameter at once: on the GPU one launch per element size and one synchronisation
        for n, b in zip(whole, tensors_bits([params[n] for n in whole])):
            p = params[n]
            sums[n] = {"shape": list(p.shape), "dtype": str(p.dtype).replace("torch.", ""), "bits": b}
        for n in wanted:
            piece = None if stock is None else stock["pieces"].get(n)
            if piece is None:
                continue
            shape = [b - a for a, b in piece["box"]]
            if self._rz_live.get(piece["param"]) and piece["param"] in params:
                sums[n] = {"shape": shape, "dtype": piece["dtype"], "at": "live",
                           "bits": tensor_bits(narrow(params[piece["param"]].detach(), piece["engine_box"]))}
            elif n in self._rz_loaded:
                sums[n] = {"shape": shape, "dtype": piece["dtype"], "at": "load", "bits": self._rz_loaded[n]}
        return {"rank": int(self.rank), "sums": sums}

    def _rz_capture_loaded(self):
        """A context for one reload of a stock class: vLLM's layerwise reload processes each layer once
        all its checkpoint tensors arrived (layerwise._layerwise_process: materialise, run the loaders,
        process_weights_after_loading, copy into the kernel tensors); this wraps that step so the bits
        of every piece (stock_pieces) are taken after the loaders wrote them and before processing packs
        them (into ``_rz_loaded``), and, the first time a parameter is seen, records whether processing
        left it as loaded (then it is read back live: ``_rz_live``)."""
        import contextlib

        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
        from vllm.model_executor.model_loader.reload import layerwise as lw

        from vllm_bridge.shards import narrow

        stock, loaded, live = self._rz_stock, self._rz_loaded, self._rz_live
        module_name = {id(m): n for n, m in self.model_runner.get_model().named_modules()}
        real = lw._layerwise_process

        def take(layer, mine) -> dict:
            got = {}
            for pname, items in mine.items():
                t = getattr(layer, pname, None)
                for name, ebox in items:
                    if t is not None and t.dim() == len(ebox) and all(b <= s for (_, b), s in zip(ebox, t.shape)):
                        got[name] = tensor_bits(narrow(t.detach(), ebox))
            return got

        def hooked(layer, info):
            mod = module_name.get(id(layer))
            mine = stock["by_module"].get(mod)
            if not mine:
                return real(layer, info)
            qm = getattr(layer, "quant_method", None)
            got: dict = {}
            if isinstance(qm, QuantizeMethodBase):
                before = qm.__dict__.get("process_weights_after_loading")
                orig = qm.process_weights_after_loading

                def process(lay, *a, **k):
                    if lay is layer:
                        got.update(take(layer, mine))
                    return orig(lay, *a, **k)

                qm.process_weights_after_loading = process
                try:
                    out = real(layer, info)
                finally:
                    if before is None:
                        del qm.process_weights_after_loading
                    else:
                        qm.process_weights_after_loading = before
            else:
                out = real(layer, info)
            if not got:  # no processing step (a norm): the parameters now hold what was loaded
                got = take(layer, mine)
            loaded.update(got)
            for pname, items in mine.items():
                qual = f"{mod}.{pname}" if mod else pname
                if qual not in live:
                    t = getattr(layer, pname, None)
                    live[qual] = (t is not None and list(t.shape) == stock["shapes"][qual]
                                  and all(n in got for n, _ in items)
                                  and take(layer, {pname: items}) == {n: got[n] for n, _ in items})
            return out

        @contextlib.contextmanager
        def ctx():
            lw._layerwise_process = hooked
            try:
                yield
            finally:
                lw._layerwise_process = real

        return ctx()

    def rz_live_pieces(self) -> dict:
        """{parameter: [[checkpoint name, box of the parameter], ...]} of a stock class's parameters that
        are read back live (held as loaded); the flip tests draw in-memory flips from these."""
        stock = getattr(self, "_rz_stock", None) or {"pieces": {}}
        out: dict = {}
        for name, p in stock["pieces"].items():
            if self._rz_live.get(p["param"]):
                out.setdefault(p["param"], []).append([name, p["engine_box"]])
        return out

    def rz_verify_layout(self) -> dict:
        """What the every-parameter verification compares on this worker (transport.SyncCheck):
        an aligned class's rz_shard_layout (every parameter, with the box of the Hugging Face tensor
        it holds). A stock vLLM class (no rz_shards): every checkpoint tensor that vLLM's loaders copy
        into a box of a parameter (stock_pieces: packed q/k/v and gate/up, stacked experts, TP shards,
        embeddings, norms, router), with the box of the checkpoint tensor this worker holds; the
        readable parameters no loader call reached (READABLE_SUFFIXES: e.g. the DeepSeek score bias,
        written straight into the live tensor) whole; and under "unverified" {parameter: bytes} of what
        is left (a loader that transposes or scatters, a parameter no checkpoint tensor fills). The map
        is made once per worker (a dry run of the loaders on meta tensors: the model is not changed);
        every later sync's reload then takes the bits of each piece as loaded (_rz_capture_loaded)."""
        model = self.model_runner.get_model()
        if hasattr(model, "rz_shards"):
            return {**self.rz_shard_layout(), "unverified": {}}
        if getattr(self, "_rz_stock", None) is None:
            self._rz_stock = stock_pieces(model, self.vllm_config, self.vllm_config.model_config.model)
            self._rz_loaded, self._rz_live = {}, {}
        stock = self._rz_stock
        params = {n: {k: p[k] for k in ("shape", "box", "dtype")} for n, p in stock["pieces"].items()}
        covered = {p["param"] for p in stock["pieces"].values()}
        for n, p in model.named_parameters():
            if n not in covered and n not in params and is_readable_name(n) and p.numel() > 0:
                params[n] = {"shape": list(p.shape), "box": [[0, s] for s in p.shape],
                             "dtype": str(p.dtype).replace("torch.", "")}
        return {"rank": int(self.rank), "params": params, "unverified": dict(stock["unverified"])}

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

    def rz_storage_ptrs(self) -> dict[str, int]:
        """Each parameter's storage address: equal before and after a sync when it loaded in place
        (what the engine's captured CUDA graphs need)."""
        return {n: p.data_ptr() for n, p in self.model_runner.get_model().named_parameters()}

    def rz_param_shapes(self) -> dict[str, list[int]]:
        """{parameter name: shape} of this worker's model (a tensor-parallel worker's shards)."""
        return {n: list(p.shape) for n, p in self.model_runner.get_model().named_parameters()}

    def rz_kv_cache_layers(self) -> dict[str, dict]:
        """{cache layer name: {spec, sliding_window, block_size, bytes_per_token}} of this worker's
        attention layers: the spec class vLLM allocated from, and the bytes of its cache tensor per
        token slot (tensor bytes / (blocks x block size))."""
        from vllm.model_executor.layers.attention import Attention

        out = {}
        for _, mod in self.model_runner.get_model().named_modules():
            if not isinstance(mod, Attention):
                continue
            spec = mod.get_kv_cache_spec(self.vllm_config)
            kv = mod.kv_cache[0] if isinstance(mod.kv_cache, (list, tuple)) else mod.kv_cache
            slots = kv.shape[0] * kv.shape[2] if kv.dim() == 4 else 0
            out[mod.layer_name] = {"spec": type(spec).__name__, "sliding_window": getattr(spec, "sliding_window", None),
                                   "block_size": int(kv.shape[2]) if kv.dim() == 4 else 0,
                                   "bytes_per_token": kv.numel() * kv.element_size() / slots if slots else 0.0}
        return out

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

    def rz_model_runner(self) -> str:
        """This worker's model runner class, ``module.Name`` (vLLM's V1 ``gpu_model_runner`` or the
        V2 ``gpu.model_runner``, which stock picks for dense models on CUDA)."""
        t = type(self.model_runner)
        return f"{t.__module__}.{t.__name__}"

    def rz_pid(self) -> int:
        import os

        return os.getpid()
