"""Compiled exact CPU kernels (``_native.c``): the same bits as the torch reference, ~BLAS speed.

The torch reference of :mod:`kernels.gemm` and :mod:`kernels.attn` builds every product explicitly
and reduces it with :func:`~kernels._common.tree_sum`. ``_native.c`` performs exactly the same IEEE
fp32 operations in the same order (products rounded once, no FMA, the same adjacent-pair tree), in
C, with SIMD across independent outputs only. So a call returns the reference's bits, and, like the
reference, an output does not depend on the batch, its position, the other rows, N, the thread count
or alignment (each output is computed by the same scalar-equivalent code; threads only split the
outputs).

Built at first use with the system C compiler (``cc``, no torch headers, < 2 s) into a cache
directory (``$RZ_KERNELS_CACHE`` or ``~/.cache/reinforce_zero/kernels``), keyed by the source, the
flags and the CPU; loaded with ctypes (calls release the GIL). Before first use a quick self-test
compares the compiled kernels with the torch reference on shapes that exercise every branch of the
tree (``torch.equal``); on any mismatch, a missing compiler, or ``RZ_KERNELS_NATIVE=0``, the
reference torch code is used instead, with a one-line warning (none for ``=0``). The result is cached
for the process.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Optional

import torch

from ._common import tree_sum

__all__ = ["available", "gemm", "attention_packed", "status", "disable"]

_SRC = Path(__file__).with_name("_native.c")
# -ffp-contract=off: no fused multiply-add (the reference rounds every product). No -ffast-math.
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared", "-pthread", "-std=c11"]
_LOCK = threading.Lock()
_LIB: Optional[ctypes.CDLL] = None
_STATE: Optional[str] = None  # None: not tried; "ok"; otherwise the reason it is off
_P = ctypes.c_void_p
_I = ctypes.c_int
_L = ctypes.c_ssize_t
_F = ctypes.c_float

# Below this many multiply-adds a call runs on one thread (thread start-up would dominate).
_THREAD_MIN_WORK = 1 << 19


def _cpu_key() -> str:
    info = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags")):
                    info += line
                if line.startswith("flags"):
                    break
    except OSError:
        pass
    return info


def _cache_dir() -> Path:
    d = os.environ.get("RZ_KERNELS_CACHE")
    return Path(d) if d else Path.home() / ".cache" / "reinforce_zero" / "kernels"


def _build() -> Path:
    src = _SRC.read_bytes()
    cc = os.environ.get("CC", "cc")
    key = hashlib.sha256(src + " ".join([cc] + _FLAGS).encode() + _cpu_key().encode()).hexdigest()[:16]
    out = _cache_dir() / f"rz_native_{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, *_FLAGS, str(_SRC), "-o", tmp], capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"{cc} failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
        os.replace(tmp, out)  # atomic: processes building at the same time each install a complete file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.rz_abi_version.restype = _I
    lib.rz_tree_gemm.argtypes = [_I, _I, _I, _P, _L, _P, _L, _L, _P, _L, _I]
    lib.rz_tree_gemm.restype = _I
    lib.rz_attn_scores.argtypes = [_I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _L, _L, _P, _L, _L, _P, _F, _I, _I]
    lib.rz_attn_scores.restype = _I
    lib.rz_attn_pv.argtypes = [_I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _L, _L, _P, _P, _L, _L, _I, _I]
    lib.rz_attn_pv.restype = _I
    if lib.rz_abi_version() != 1:
        raise RuntimeError("stale compiled kernel library")
    return lib


def disable(reason: str = "disabled") -> None:
    """Use the torch reference from now on (tests use this to compare both paths)."""
    global _STATE
    _STATE = reason


def status() -> str:
    available()
    return _STATE or "untried"


def available() -> bool:
    """True when the compiled kernels are built, loaded and passed the self-test (cached)."""
    global _LIB, _STATE
    if _STATE is not None:
        return _STATE == "ok"
    with _LOCK:
        if _STATE is not None:
            return _STATE == "ok"
        if os.environ.get("RZ_KERNELS_NATIVE", "1") == "0":
            _STATE = "off (RZ_KERNELS_NATIVE=0)"
            return False
        try:
            _LIB = _load(_build())
            _STATE = "testing"
            bad = _self_test()
        except Exception as e:  # noqa: BLE001 - any failure means: use the reference
            _LIB = None
            _STATE = f"unavailable ({type(e).__name__}: {e})"
            warnings.warn(f"kernels: compiled CPU kernels {_STATE}; using the (slower) torch reference", stacklevel=2)
            return False
        if bad:
            _LIB = None
            _STATE = f"self-test failed ({bad})"
            warnings.warn(f"kernels: compiled CPU kernels {_STATE} on this CPU; using the (slower) torch reference",
                          stacklevel=2)
            return False
        _STATE = "ok"
        return True


def _threads(work: int) -> int:
    return 1 if work < _THREAD_MIN_WORK else max(1, torch.get_num_threads())


def _need() -> None:
    if _LIB is None and not available():
        raise RuntimeError(f"kernels: compiled CPU kernels {_STATE}")


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def gemm(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 ``[M, N]`` = tree over K of ``x2[M, K] * w[N, K]`` (bitwise ``gemm.partial_fp32``'s torch path)."""
    _need()
    M, K = x2.shape
    N = w.shape[0]
    if x2.stride(1) != 1 and M > 0:
        x2 = x2.contiguous()
    out = torch.empty(M, N, dtype=torch.float32)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    rc = _LIB.rz_tree_gemm(M, N, K, _ptr(x2), x2.stride(0), _ptr(w), w.stride(0), w.stride(1), _ptr(out),
                           out.stride(0), _threads(M * N * K))
    if rc:
        raise MemoryError("rz_tree_gemm failed")
    return out


def _meta(*arrays) -> list[torch.Tensor]:
    return [torch.as_tensor(a, dtype=torch.int64).contiguous() for a in arrays]


def attention_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start, nq, key_start,
                     pos: torch.Tensor, scale: float) -> torch.Tensor:
    """Many sequences in one call: fp32 ``[T, Hq, Dv]``.

    ``q[T, Hq, D]``, ``k[Sk, Hkv, D]``, ``v[Sk, Hkv, Dv]`` fp32 with a contiguous last dimension
    (any other strides). Sequence ``i`` owns query rows ``q_start[i] : q_start[i] + nq[i]`` and keys
    ``key_start[i] + j``; query token ``t`` is at position ``pos[t]`` and sees keys ``0..pos[t]`` of its
    sequence. Row bits equal :func:`kernels.attn.attention`'s for that sequence alone.
    """
    _need()
    T, Hq, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[2]
    for t in (q, k, v):
        if t.dtype != torch.float32 or (t.numel() and t.stride(-1) != 1):
            raise ValueError("attention_packed: fp32 tensors with a contiguous last dimension expected")
    q_start, nq, key_start = _meta(q_start, nq, key_start)
    pos = pos.to(torch.int64).contiguous()
    out = torch.empty(T, Hq, Dv, dtype=torch.float32)
    nseq = q_start.numel()
    if T == 0 or nseq == 0:
        return out
    # score rows of pos + 1 floats, per token then head; sequence i's rows start at s_start[i]
    row = (pos + 1) * Hq
    csum = torch.cumsum(row, 0)
    ends = q_start + nq
    tot_before = torch.where(q_start > 0, csum[(q_start - 1).clamp(min=0)], torch.zeros_like(q_start))
    s_start = tot_before.contiguous()
    total = int(csum[-1])
    max_keys = int(pos.max()) + 1
    sbuf = torch.empty(total, dtype=torch.float32)
    work = total * max(D, Dv)
    nt = _threads(work)
    with torch.no_grad():
        rc = _LIB.rz_attn_scores(nseq, Hq, Hkv, D, _ptr(q_start), _ptr(nq), _ptr(key_start), _ptr(pos),
                                 _ptr(s_start), _ptr(q), q.stride(0), q.stride(1), _ptr(k), k.stride(0),
                                 k.stride(1), _ptr(sbuf), float(torch.tensor(scale, dtype=torch.float32)),
                                 max_keys, nt)
        if rc:
            raise MemoryError("rz_attn_scores failed")
        torch.exp(sbuf, out=sbuf)
        rc = _LIB.rz_attn_pv(nseq, Hq, Hkv, Dv, _ptr(q_start), _ptr(nq), _ptr(key_start), _ptr(pos),
                             _ptr(s_start), _ptr(v), v.stride(0), v.stride(1), _ptr(sbuf), _ptr(out),
                             out.stride(0), out.stride(1), max_keys, nt)
        if rc:
            raise MemoryError("rz_attn_pv failed")
    del ends
    return out


# ------------------------------------------------------------------------------------ self-test


def _ref_gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The torch reference's arithmetic (kernels/gemm.py): every product, then tree_sum over K."""
    return tree_sum(x.t()[:, :, None] * w.t()[:, None, :], dim=0)


def _ref_attention(q, k, v, pos, scale):
    """The torch reference's arithmetic (kernels/attn.py) for one sequence, fp32."""
    T, Hq, D = q.shape
    S, Hkv, _ = k.shape
    G = Hq // Hkv
    out = torch.empty(T, Hq, v.shape[-1])
    for h in range(Hkv):
        qh = q[:, h * G:(h + 1) * G].reshape(T * G, D)
        s = tree_sum(qh.t()[:, :, None] * k[:, h].t()[:, None, :], dim=0) * scale
        s = s.masked_fill(torch.arange(S)[None, :] > pos.repeat_interleave(G)[:, None], float("-inf"))
        e = torch.exp(s - s.amax(dim=-1, keepdim=True))
        acc = tree_sum(e.t()[:, :, None] * v[:, h][:, None, :], dim=0)
        out[:, h * G:(h + 1) * G] = (acc / tree_sum(e, dim=-1, keepdim=True)).view(T, G, -1)
    return out


def _self_test() -> str:
    """Compare the compiled kernels with the torch reference's arithmetic bit for bit; '' when all
    agree. (tests/unit/test_kernels.py also compares them with kernels.gemm / kernels.attn.)"""
    g = torch.Generator().manual_seed(20261201)

    def rnd(*shape):
        # wide exponent range: any change of the addition order shows up in the bits
        return torch.randn(*shape, generator=g) * torch.exp(torch.randn(*shape, generator=g) * 3)

    for K in (1, 2, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 24, 31, 33, 63, 64, 100, 129, 257, 1000):
        for M, N in ((1, 1), (3, 17), (6, 33)):
            x, w = rnd(M, K), rnd(N, K)
            if not torch.equal(gemm(x, w), _ref_gemm(x, w)):
                return f"gemm M={M} N={N} K={K}"
    x, w = rnd(70, 48), rnd(40, 96)
    if not torch.equal(gemm(x, w[:, ::2]), _ref_gemm(x, w[:, ::2])):
        return "gemm strided weight"
    if not torch.equal(gemm(x, w.t().contiguous().t()[:, :48]), _ref_gemm(x, w[:, :48])):
        return "gemm transposed weight"
    # attention: 3 sequences, GQA, D != Dv, prefill / chunk / decode query sets
    for D, Dv, Hq, Hkv in ((8, 8, 4, 2), (24, 16, 2, 1), (17, 5, 3, 3)):
        lens, nqs = [13, 1, 40], [13, 1, 7]
        k = torch.randn(sum(lens), Hkv, D, generator=g)
        v = torch.randn(sum(lens), Hkv, Dv, generator=g)
        q = torch.randn(sum(nqs), Hq, D, generator=g)
        pos = torch.cat([torch.arange(L - n, L) for L, n in zip(lens, nqs)])
        qs = [0, 13, 14]
        ks = [0, 13, 14]
        out = attention_packed(q, k, v, qs, nqs, ks, pos, 0.3)
        for i in range(3):
            a, b = qs[i], qs[i] + nqs[i]
            ref = _ref_attention(q[a:b], k[ks[i]:ks[i] + lens[i]], v[ks[i]:ks[i] + lens[i]], pos[a:b], 0.3)
            if not torch.equal(out[a:b], ref):
                return f"attention D={D} Dv={Dv} Hq={Hq} Hkv={Hkv} seq {i}"
    return ""


if __name__ == "__main__":  # python -m kernels._native: build, self-test, print the state
    print(status(), file=sys.stdout)
